"""``adapt embed`` over 2 CPU processes against 1, and a kill -9 mid-run then a rerun, on the same texts.

    python -m benchmarks.tools.embed_scale --quick        # 112 real news texts, SmolLM2-135M bidirectional (untrained)
    python -m benchmarks.tools.embed_scale --model DIR --shard-size 16

1 process: ``adapt embed ENC -i texts.txt -o one/`` with every core's threads. 2 processes:
``torchrun --nproc_per_node 2 -m adapt embed ... -o two/`` with ``OMP_NUM_THREADS`` = cores / 2 each, so
both use the whole machine. Resume: the same 2-process command killed with SIGKILL (every process) once a
random number of shards is done, rerun, and merged. Reported: wall seconds (process start included),
texts/s, the max abs difference between the vectors, shards redone. Results go to
``benchmarks/results/embed_scale.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, ROOT, adapt_command, lee_texts, load_average, process_env, smollm2_encoder


def command(procs: int, model, texts, out, shard_size) -> list[str]:
    return adapt_command(procs, "embed", str(model), "-i", str(texts), "-o", f"{out}/", "--shard-size",
                         str(shard_size), "--quiet")


def run(procs, *a) -> float:
    start = time.perf_counter()
    done = subprocess.run(command(procs, *a), cwd=ROOT, env=process_env(procs), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    print(done.stderr.strip().splitlines()[-1], flush=True)
    return time.perf_counter() - start


def merged(folder: Path) -> np.ndarray:
    from adapt.inference.embed import merge_shards

    merge_shards(folder, folder.with_suffix(".npy"))
    return np.load(folder.with_suffix(".npy"))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shard-size", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "adapt-bench")
    parser.add_argument("--out", type=Path, default=RESULTS / "embed_scale.json")
    parser.add_argument("--seed", type=int, default=None, help="seed of the random kill point")
    parser.add_argument("--limit", type=int, help="only the first N texts (a loaded machine)")
    args = parser.parse_args(argv)
    model = args.model or smollm2_encoder(args.workdir)
    work = Path(tempfile.mkdtemp(prefix="embed-scale-", dir=args.workdir))
    texts = lee_texts(args.quick)[:args.limit]
    (work / "texts.txt").write_text("".join(t.replace("\n", " ") + "\n" for t in texts), encoding="utf-8")
    a = (model, work / "texts.txt")
    one = run(1, *a, work / "one", args.shard_size)
    two = run(2, *a, work / "two", args.shard_size)
    v1, v2 = merged(work / "one"), merged(work / "two")
    shards = -(-len(texts) // args.shard_size)
    # kill -9 at a random point of a 2-process run, then rerun the same command
    target = int(np.random.default_rng(args.seed).integers(1, shards - 1))
    proc = subprocess.Popen(command(2, *a, work / "killed", args.shard_size), cwd=ROOT, env=process_env(2),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while len(list((work / "killed").glob("shard-*.json"))) < target and proc.poll() is None:
        time.sleep(0.01)
    import psutil

    for pid in [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    done_at_kill = len(list((work / "killed").glob("shard-*.json")))
    resumed = run(2, *a, work / "killed", args.shard_size)
    v3 = merged(work / "killed")
    manifest = json.loads((work / "two" / "manifest.json").read_text())
    result = {"model": str(model), "texts": len(texts), "tokens": manifest["tokens"], "shard_size": args.shard_size,
              "shards": shards, "cores": os.cpu_count(), "load_average_at_end": load_average(),
              "one_process_seconds": round(one, 2), "two_processes_seconds": round(two, 2),
              "one_process_texts_per_s": round(len(texts) / one, 2), "two_processes_texts_per_s": round(len(texts) / two, 2),
              "scaling": round(one / two, 3), "max_abs_diff_two_vs_one": float(np.abs(v1 - v2).max()),
              "kill_after_shards": target, "shards_done_at_kill": done_at_kill,
              "shards_redone_by_rerun": shards - done_at_kill, "rerun_seconds": round(resumed, 2),
              "max_abs_diff_resumed_vs_uninterrupted": float(np.abs(v3 - v2).max()),
              "max_abs_diff_resumed_vs_one": float(np.abs(v3 - v1).max())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    r = result
    args.out.with_suffix(".md").write_text("\n".join([
        "# adapt embed: 2 CPU processes vs 1, and a kill -9 then a rerun", "",
        f"Model `{r['model']}`, {r['texts']} texts ({r['tokens']} tokens), {r['shards']} shards of {r['shard_size']}, "
        f"{r['cores']} cores; load average at the end {', '.join(f'{x:.1f}' for x in r['load_average_at_end'])} "
        "(a shared machine). Wall time includes starting the processes and loading the model.", "",
        "| run | wall s | texts/s |", "|---|---|---|",
        f"| 1 process ({r['cores']} threads) | {r['one_process_seconds']} | {r['one_process_texts_per_s']} |",
        f"| 2 processes (torchrun, {max(1, r['cores'] // 2)} thread each) | {r['two_processes_seconds']} | "
        f"{r['two_processes_texts_per_s']} |", "",
        f"Scaling 2 vs 1: {r['scaling']}x. Max abs difference of the vectors, 2 processes vs 1: "
        f"{r['max_abs_diff_two_vs_one']:.2e}.", "",
        f"Resume: killed (SIGKILL, every process) once {r['kill_after_shards']} shards were done "
        f"({r['shards_done_at_kill']} done at the kill); the rerun embedded the {r['shards_redone_by_rerun']} others in "
        f"{r['rerun_seconds']} s. Max abs difference of the merged vectors vs the uninterrupted 2-process run: "
        f"{r['max_abs_diff_resumed_vs_uninterrupted']:.2e} (vs 1 process: {r['max_abs_diff_resumed_vs_one']:.2e}).", ""]))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
