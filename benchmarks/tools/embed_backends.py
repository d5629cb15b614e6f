"""ONNX int8 and OpenVINO int8 against torch fp32, on the same encoder, texts and threads, in one run.

    python -m benchmarks.tools.embed_backends --quick          # 112 texts, 2 repetitions
    python -m benchmarks.tools.embed_backends --model DIR --reps 3 --fp32-graphs

The encoder is SmolLM2-135M-Instruct made bidirectional without training and exported once with adapt
(``benchmarks/common.py``'s ``smollm2_encoder``, cached under ``--workdir``), or ``--model DIR``.
Each backend is written by ``adapt export --backend ... --quantize int8`` (the same checks run: probe on
the graph, cosine vs torch) and run through adapt's encoder (same tokenization, batching and pooling),
in interleaved repetitions; the median counts. Reported: texts/s, tokens/s, peak resident memory added
during a run and by loading, min and mean cosine against torch fp32. With ``--suite quick`` the same run
then scores torch fp32 and each graph on that ``adapt bench`` suite (no cache) and reports each average's
change against torch fp32 with its paired-bootstrap p-value (the issue's target: int8 within 0.01).
Results go to ``benchmarks/results/embed_backends.json`` and ``.md``.

The row ``onnx int8 (plain dynamic, before)`` is the ONNX int8 adapt wrote before issue 32 (onnxruntime's
``quantize_dynamic``: one activation scale per batch), made by this script from the fp32 graph since the
export's int8 floor now refuses it (``--no-plain`` leaves it out); ``texts < 0.95`` counts the texts under
that floor. The issue's before/after run (the demo preset stopped at 40 of its 116 steps, D below):

    adapt convert --preset demo -o D --max-steps 40
    python -m benchmarks.tools.embed_backends --model D --quick

    python -m benchmarks.tools.embed_backends --model runs/recipe-study/mlm40+simcse-s0 --reps 3 --suite quick
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (RESULTS, PeakRSS, command_line, cpu_model, lee_texts, load_average, relative,
                               smollm2_encoder, timed)

PLAIN = "onnx int8 (plain dynamic, before)"
FLOOR = 0.95  # adapt.export.graphs.INT8_MIN_COSINE, the int8 floor: texts below it are counted


def cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="an exported encoder folder (default: SmolLM2-135M, bidirectional)")
    parser.add_argument("--quick", action="store_true", help="a subset of the texts and 2 repetitions")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fp32-graphs", action="store_true", help="also time the fp32 ONNX and OpenVINO graphs")
    parser.add_argument("--no-plain", action="store_true",
                        help=f"leave out the row '{PLAIN}' (the ONNX int8 of adapt before issue 32)")
    parser.add_argument("--texts", type=int, help="only the first N texts (after the shuffle)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "adapt-bench")
    parser.add_argument("--out", type=Path, default=RESULTS / "embed_backends.json")
    parser.add_argument("--suite", help="also score every backend on this adapt bench suite (e.g. quick)")
    parser.add_argument("--suite-only", action="store_true",
                        help="with --suite: keep the timings in --out, score the suite again (cached embeddings)")
    args = parser.parse_args(argv)
    load_at_start = load_average()
    from adapt.inference.encoder import load_encoder
    from adapt.pipeline.reexport import export_from_path

    reps = args.reps or (2 if args.quick else 3)
    source = args.model or smollm2_encoder(args.workdir)
    if args.suite_only:
        result = json.loads(args.out.read_text())
        folders = {name: args.workdir / f"{Path(source).name}-{name.replace(' ', '-')}" for name in result["methods"]
                   if name != "torch fp32"}
        result["suite"] = suite_scores(source, folders, args.suite, args.workdir, args.batch_size)
        write_results(result, args.out)
        return result
    texts = lee_texts(args.quick)[:args.texts]
    variants = [("onnx", "int8"), ("openvino", "int8")] + ([("onnx", None), ("openvino", None)] if args.fp32_graphs else [])
    folders, export_seconds, records = {}, {}, {}
    for backend, quantize in variants:
        name = f"{backend} {quantize or 'fp32'}"
        folder = args.workdir / f"{Path(source).name}-{backend}-{quantize or 'fp32'}"
        record = json.loads((folder / "adapt_export.json").read_text()).get("backend", {}) \
            if (folder / "adapt_export.json").is_file() else {}
        if record.get("quantize") != quantize or ((backend, quantize) == ("onnx", "int8") and "int8" not in record):
            start = time.perf_counter()  # (an onnx int8 folder without the int8 record is the old quantizer's)
            export_from_path(source, folder, backend=backend, quantize=quantize)
            export_seconds[name] = round(time.perf_counter() - start, 1)
            print(f"exported {name} in {export_seconds[name]} s", flush=True)
        folders[name] = folder
        records[name] = json.loads((folder / "adapt_export.json").read_text())["backend"]
    if not args.no_plain:  # the int8 adapt wrote before (issue 32): onnxruntime's quantize_dynamic, unchecked
        folders[PLAIN] = plain_dynamic(source, args.workdir, export_from_path)
        records[PLAIN] = json.loads((folders[PLAIN] / "adapt_export.json").read_text())["backend"]
    encoders, load_mb = {}, {}
    with PeakRSS() as mem:
        encoders["torch fp32"] = load_encoder(source, backend="torch", dtype="float32", device="cpu")
    load_mb["torch fp32"] = round(mem.added_mb, 1)
    for name, folder in folders.items():
        with PeakRSS() as mem:
            encoders[name] = load_encoder(folder)
        load_mb[name] = round(mem.added_mb, 1)
    for enc in encoders.values():  # first-call allocations and kernel choices stay out of the timing
        enc.encode(texts[:8], batch_size=4)
    tokens = sum(len(ids) for ids in encoders["torch fp32"].tokenize(texts)[0])
    times, peaks, vectors = {k: [] for k in encoders}, {k: [] for k in encoders}, {}
    for rep in range(reps):
        order = list(encoders) if rep % 2 == 0 else list(reversed(encoders))
        for name in order:
            vectors[name], seconds, _, added = timed(lambda: encoders[name].encode(texts, batch_size=args.batch_size))
            times[name].append(seconds)
            peaks[name].append(added)
            print(f"rep {rep + 1}/{reps} {name}: {seconds:.2f} s, {len(texts) / seconds:.1f} texts/s", flush=True)
    base = vectors["torch fp32"]
    result = {"command": command_line("benchmarks.tools.embed_backends", argv), "model": str(source), "texts": len(texts), "tokens": tokens, "batch_size": args.batch_size, "reps": reps,
              "quick": args.quick, "torch_threads": torch.get_num_threads(), "cpu": cpu_model(),
              "load_average_at_start": load_at_start, "load_average_at_end": load_average(),
              "export_seconds": export_seconds, "exports": {k: {"check": v.get("parity"), "int8": v.get("int8")}
                                                            for k, v in records.items()}, "methods": {}}
    for name in encoders:
        seconds = statistics.median(times[name])
        cos = cosines(base, vectors[name])
        result["methods"][name] = {
            "median_seconds": round(seconds, 3), "texts_per_s": round(len(texts) / seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "peak_added_mb": round(max(peaks[name]), 1),
            "load_added_mb": load_mb[name], "all_seconds": [round(t, 3) for t in times[name]],
            "min_cosine_vs_torch": round(float(cos.min()), 6), "mean_cosine_vs_torch": round(float(cos.mean()), 6),
            "speedup_vs_torch": round(statistics.median(times["torch fp32"]) / seconds, 2),
            "texts_below_floor": int((cos < FLOOR).sum()), "worst_text": texts[int(cos.argmin())][:80]}
    write_results(result, args.out)  # the timings are kept even if the suite run fails
    if args.suite:
        del encoders, vectors
        result["suite"] = suite_scores(source, folders, args.suite, args.workdir, args.batch_size)
        write_results(result, args.out)
    for name, m in result["methods"].items():
        print(f"{name:15s} {m['texts_per_s']:8.2f} texts/s {m['tokens_per_s']:9.1f} tokens/s  x{m['speedup_vs_torch']:.2f}"
              f"  cos min {m['min_cosine_vs_torch']:.4f} mean {m['mean_cosine_vs_torch']:.4f}  peak +{m['peak_added_mb']:.0f} MB")
    return result


def plain_dynamic(source: Path, workdir: Path, export_from_path) -> Path:
    """The ONNX int8 adapt wrote before issue 32 (onnxruntime's quantize_dynamic: int8 weights per channel, one
    activation scale per batch), made here from an fp32 ONNX export, since the export now refuses it."""
    import shutil

    from onnxruntime.quantization import QuantType, quantize_dynamic

    fp32 = workdir / f"{Path(source).name}-onnx-fp32"
    if not (fp32 / "onnx" / "model.onnx").is_file():
        export_from_path(source, fp32, backend="onnx")
    folder = workdir / f"{Path(source).name}-onnx-int8-plain-dynamic"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(fp32, folder, ignore=shutil.ignore_patterns("model.onnx*"))
    quantize_dynamic(str(fp32 / "onnx" / "model.onnx"), str(folder / "onnx" / "model.onnx"),
                     weight_type=QuantType.QInt8, per_channel=True)
    manifest = json.loads((folder / "adapt_export.json").read_text())
    manifest["backend"].update(quantize="int8", parity=None)  # not checked: the floor would refuse it
    (folder / "adapt_export.json").write_text(json.dumps(manifest, indent=2))
    return folder


def suite_scores(source: Path, folders: dict[str, Path], suite: str, workdir: Path, batch_size: int) -> dict:
    """The suite's average for torch fp32 and each graph, with each graph's change against torch fp32."""
    from adapt.bench.runner import run_bench

    names = ["torch fp32", *folders]
    report = run_bench([str(source), *map(str, folders.values())], suite=suite, out_dir=workdir / f"bench-{suite}",
                       batch_size=batch_size, update_cards=False, reference=None)
    averages = [row for row in report.rows if row.get("kind") == "average"]
    if len(averages) != len(names):
        raise RuntimeError(f"expected {len(names)} average rows from the {suite} suite, got {len(averages)}")
    out = {"suite": suite, "report": str(report.paths.get("markdown", "")), "models": {}}
    base = averages[0]["value"]
    for name, row in zip(names, averages):
        out["models"][name] = {"average": round(row["value"], 4), "ci": [round(row["ci_low"], 4), round(row["ci_high"], 4)],
                               "change_vs_torch": round(row["value"] - base, 4), "p_value": row.get("p_value"),
                               "change_ci": [None if row.get(k) is None else round(row[k], 4)
                                             for k in ("delta_ci_low", "delta_ci_high")]}
        print(f"{suite} suite {name:15s} average {row['value']:.4f} change {row['value'] - base:+.4f} "
              f"p={row.get('p_value')}", flush=True)
    return out


def write_results(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(relative(json.dumps(result, indent=2)) + "\n")
    r = result
    lines = ["# Embedding backends: ONNX / OpenVINO int8 vs torch fp32", "",
             f"Model `{r['model']}`, {r['texts']} texts ({r['tokens']} tokens), batch size {r['batch_size']}, "
             f"{r['torch_threads']} threads, {r['reps']} interleaved repetitions (median){' (quick)' if r['quick'] else ''}; "
             f"load average (1, 5, 15 min) at the start {', '.join(f'{x:.1f}' for x in r['load_average_at_start'])}, "
             f"at the end {', '.join(f'{x:.1f}' for x in r['load_average_at_end'])}, on {os.cpu_count()} cores.", "",
             "| backend | texts/s | tokens/s | vs torch fp32 | min cosine | mean cosine | texts < 0.95 | "
             "peak added MB (run) | added MB (load) | runs, s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in r["methods"].items():
        lines.append(f"| {name} | {m['texts_per_s']} | {m['tokens_per_s']} | {m['speedup_vs_torch']}x | "
                     f"{m['min_cosine_vs_torch']} | {m['mean_cosine_vs_torch']} | {m.get('texts_below_floor', '')} | "
                     f"{m['peak_added_mb']} | {m['load_added_mb']} | {', '.join(map(str, m['all_seconds']))} |")
    if r.get("command"):
        lines += ["", f"Command: `{r['command']}`"]
    for name, e in r.get("exports", {}).items():
        check = e.get("check") or {}
        lines += [f"- {name}: the export's check {'min ' + str(check.get('min_cosine')) + ' mean ' + str(check.get('mean_cosine')) if check else 'none (not written by adapt export)'}"
                  + (f"; int8 MatMuls {e['int8']['int8_matmuls']}, kept in float32 {e['int8']['float_matmuls']}, "
                     f"search (min cosine by float MatMuls) {e['int8']['tried']}" if e.get("int8") else "")]
    if r["export_seconds"]:
        lines += ["", "Export (adapt export --backend, checks included): " +
                  ", ".join(f"{k} {v} s" for k, v in r["export_seconds"].items())]
    if r.get("suite"):
        lines += ["", f"`{r['suite']['suite']}` suite, same encoders (paired bootstrap against torch fp32):", "",
                  "| backend | average [95%] | change vs torch fp32 [95%] | p |", "|---|---|---|---|"]
        for name, m in r["suite"]["models"].items():
            low, high = m.get("change_ci") or (None, None)
            change = f"{m['change_vs_torch']:+.4f}" + (f" [{low:+.4f}, {high:+.4f}]" if low is not None else "")
            lines.append(f"| {name} | {m['average']:.4f} [{m['ci'][0]:.3f}, {m['ci'][1]:.3f}] | {change} | "
                         f"{m['p_value'] if name != 'torch fp32' else '-'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
