"""Why does (or doesn't) the converted demo model beat its causal source? A small study.

Converts the embedded default's MLM recipe (SmolLM2-135M, presets/demo-mlm.yaml) under a few variants - steps,
mask ratio, objective, learning rate - and scores every variant side by side with the source
decoder (causal mean / last-token pooled, bidirectional untrained) on the offline `quick` suite.

    python -m benchmarks.studies.demo_study                 # all variants (long: ~10 min each on 2 CPU cores)
    python -m benchmarks.studies.demo_study --only base mntp --steps 40

Writes benchmarks/results/demo_study.{json,md,png} (the bench report) and keeps the runs under
runs/study/ (not committed). Finished variants are reused, so an interrupted study resumes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, publish  # no machine paths in results


VARIANTS = {
    "base": [],                                              # the demo as shipped: MLM 30%, lr 5e-5
    "mlm-40": ["objective.mask_ratio=0.4"],                  # the paper's ratio
    "mntp": ["objective.schedule=mntp", "objective.mask_ratio=0.2"],  # LLM2Vec's objective
    "lr-2e-4": ["train.lr=2.0e-4"],                          # a larger step
    "lora": ["tuning.method=lora", "train.lr=2.0e-4"],       # LLM2Vec's tuning
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=sorted(VARIANTS), help="variants to run (default: all)")
    ap.add_argument("--steps", type=int, help="override train.max_steps for every variant")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "study"))
    ap.add_argument("--limit", type=int, help="examples per bench task (quicker, noisier)")
    args = ap.parse_args()

    from adapt.bench.runner import run_bench
    from adapt.pipeline.convert import convert

    runs = Path(args.runs)
    names = args.only or list(VARIANTS)
    timings = {}
    for name in names:
        out = runs / name
        if (out / "run" / "summary.json").exists():
            continue
        overrides = list(VARIANTS[name]) + ([f"train.max_steps={args.steps}"] if args.steps else [])
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        convert(None, out, preset="demo-mlm", overrides=overrides + ["train.save_every=0"], show_progress=True)
        timings[name] = round(time.perf_counter() - t0, 1)
    models = [f"{runs / name}@label={name}" for name in names]
    report = run_bench(models, suite="quick", out_dir=runs / "bench", baselines=True, limit=args.limit)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for key, path in report.paths.items():
        publish(path, RESULTS / f"demo_study{Path(path).suffix}")
    summaries = {n: json.loads((runs / n / "run" / "summary.json").read_text()) for n in names}
    (RESULTS / "demo_study_runs.json").write_text(json.dumps(
        {n: {"overrides": VARIANTS[n], "steps": s["steps"], "final_eval": s["final_eval"],
             "train_seconds": s["train_seconds"]} for n, s in summaries.items()}, indent=2) + "\n")
    print(report.markdown)


if __name__ == "__main__":
    main()
