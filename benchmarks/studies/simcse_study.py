"""Does a SimCSE stage after MLM help here? Causal source, MLM-only and MLM + SimCSE side by side.

Runs ``adapt convert --preset demo-simcse`` (the embedded default's MLM stage, then unsupervised
SimCSE on the sentences of the same text) and scores, on the offline `quick` suite with the source
baselines, the MLM-only encoder (``OUT/stages/1-mlm``) and the final MLM + SimCSE encoder (``OUT``):

    python -m benchmarks.studies.simcse_study                      # ~30 min on 2 CPU cores
    python -m benchmarks.studies.simcse_study --set simcse.train.max_steps=80

Writes benchmarks/results/simcse_study.{json,md,png} and simcse_study_runs.json (per-stage training
figures); the run stays under runs/simcse-study/ (not committed). An interrupted study resumes.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, publish  # no machine paths in results



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo-simcse")
    ap.add_argument("--out", default=str(ROOT / "runs" / "simcse-study"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--limit", type=int, help="examples per bench task (quicker, noisier)")
    ap.add_argument("--name", default="simcse_study", help="results file stem under benchmarks/results/")
    args = ap.parse_args()

    from adapt.bench.runner import run_bench
    from adapt.pipeline.chain import run_stages

    out = Path(args.out)
    t0 = time.perf_counter()
    if not (out / "run" / "summary.json").exists():
        resume = (out / "run" / "stages").is_dir()
        run_stages(None, out, preset=args.preset, overrides=args.overrides, resume=resume, show_progress=True)
    convert_s = round(time.perf_counter() - t0, 1)
    summary = json.loads((out / "run" / "summary.json").read_text())
    first, last = summary["stages"][0], summary["stages"][-1]
    models = [f"{out / 'stages' / first}@label=MLM-only ({first})", f"{out}@label=MLM+SimCSE"]
    t1 = time.perf_counter()
    report = run_bench(models, suite="quick", out_dir=out / "bench", baselines=True, limit=args.limit)
    RESULTS.mkdir(parents=True, exist_ok=True)
    for path in report.paths.values():
        publish(path, RESULTS / f"{args.name}{Path(path).suffix}")
    per_stage = {name: {k: s.get(k) for k in ("steps", "tokens", "train_seconds", "final_eval", "mini_batch")
                        if k in s} for name, s in summary["per_stage"].items()}
    (RESULTS / f"{args.name}_runs.json").write_text(json.dumps(
        {"preset": args.preset, "overrides": args.overrides, "stages": summary["stages"], "per_stage": per_stage,
         "final": last, "convert_seconds_this_call": convert_s,
         "bench_seconds": round(time.perf_counter() - t1, 1)}, indent=2) + "\n")
    print(report.markdown)


if __name__ == "__main__":
    main()
