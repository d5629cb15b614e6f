"""``adapt bench`` over 2 CPU processes against 1: wall time, and the main scores (they must be equal).

    python -m benchmarks.tools.bench_scale --quick             # quick suite, 48 examples per task, SmolLM2-135M (untrained)
    python -m benchmarks.tools.bench_scale --model DIR --suite standard-dev --limit 200

1 process: ``adapt bench ENC --suite S --no-cache`` with every core's threads. 2 processes:
``torchrun --nproc_per_node 2 -m adapt bench ...`` with ``OMP_NUM_THREADS`` = cores / 2 each, so both use
the whole machine. Wall seconds include starting the processes and loading the model. Results go to
``benchmarks/results/bench_scale.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, adapt_command, load_average, process_env, smollm2_encoder


def command(procs: int, model, suite: str, limit: int | None, out: Path) -> list[str]:
    args = ["bench", str(model), "--suite", suite, "-o", str(out), "--no-cache", "--no-card", "--quiet"]
    return adapt_command(procs, *args, *(["--limit", str(limit)] if limit else []))


def run(procs: int, *a) -> float:
    start = time.perf_counter()
    done = subprocess.run(command(procs, *a), cwd=ROOT, env=process_env(procs), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return time.perf_counter() - start


def mains(out: Path) -> dict[str, float]:
    rows = json.loads((out / "results.json").read_text())
    return {r["task"]: r["value"] for r in rows if r["main"] and r["kind"] != "average"}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--quick", action="store_true", help="--limit 48 unless given")
    parser.add_argument("--suite", default="quick")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "adapt-bench")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_scale.json")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    limit = args.limit or (48 if args.quick else None)
    model = args.model or smollm2_encoder(args.workdir)
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.workdir))
    one = run(1, model, args.suite, limit, work / "one")
    two = run(2, model, args.suite, limit, work / "two")
    s1, s2 = mains(work / "one"), mains(work / "two")
    r = {"model": str(model), "suite": args.suite, "limit": limit, "cores": os.cpu_count(),
         "load_average_at_end": load_average(), "one_process_seconds": round(one, 2),
         "two_processes_seconds": round(two, 2), "scaling": round(one / two, 3),
         "max_abs_diff_main_scores": max(abs(s1[t] - s2[t]) for t in s1) if s1.keys() == s2.keys() else None,
         "main_scores": s1}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2) + "\n")
    args.out.with_suffix(".md").write_text("\n".join([
        "# adapt bench: 2 CPU processes vs 1", "",
        f"Model `{r['model']}`, suite {r['suite']} (limit {r['limit']}), {r['cores']} cores; load average at the end "
        f"{', '.join(f'{x:.1f}' for x in r['load_average_at_end'])}. Wall time includes starting the processes and "
        "loading the model; no embedding cache.", "",
        "| run | wall s |", "|---|---|",
        f"| 1 process ({r['cores']} threads) | {r['one_process_seconds']} |",
        f"| 2 processes (torchrun, {max(1, r['cores'] // 2)} threads each) | {r['two_processes_seconds']} |", "",
        f"Scaling 2 vs 1: {r['scaling']}x. Max abs difference of the main scores: {r['max_abs_diff_main_scores']}.",
        ""]))
    print(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main()
