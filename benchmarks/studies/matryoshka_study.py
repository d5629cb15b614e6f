"""Does Matryoshka training let the embedded default serve smaller vectors? With and without, at each size.

Converts SmolLM2-135M with the demo recipe (the `demo-simcse` preset: the demo's MLM stage, then
SimCSE on the sentences of the same text), twice from the same MLM encoder: the SimCSE stage once as it
is, once with ``contrastive.matryoshka_dims: [full, 288, 144, 64]`` (576 is the hidden size). Both
encoders are scored at 576, 288, 144 and 64 dimensions (``adapt bench --dims``: encoded once, cut and
re-normalized) on the `standard` suite's dev split, and the report says which fraction of its full-size
average each keeps at each size; the target is >= 95% at 1/4 of the full size (144):

    python -m benchmarks.studies.matryoshka_study                          # ~1 h 30 on 2 idle CPU cores
    python -m benchmarks.studies.matryoshka_study --suite standard         # the test split, for the report
    python -m benchmarks.studies.matryoshka_study --set simcse.train.max_steps=80

Writes benchmarks/results/matryoshka_study.{json,md,png} (the bench rows, models x sizes) and
matryoshka_study_runs.json (training figures, fractions kept); the runs stay under
runs/matryoshka-study/ (not committed). An interrupted study resumes; a finished run is reused.
A smoke run on a tiny model: ``--source DIR --data FILE --preset tiny-stages --dims full,16,8
--suite quick --limit 20 --out /tmp/mstudy --name /tmp/mstudy/result``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, publish, relative  # no machine paths in results

TARGET = 0.95  # the fraction of the full-size average to keep at 1/4 of the full size


def convert(out: Path, source, **kwargs) -> dict:
    """``run_stages`` into ``out`` unless it finished before (then its summary); resumes a broken run."""
    from adapt.pipeline.chain import run_stages

    if not (out / "run" / "summary.json").exists():
        run_stages(source, out, resume=(out / "run" / "stages").is_dir(), show_progress=True, **kwargs)
    return json.loads((out / "run" / "summary.json").read_text())


def kept_fractions(report, names: list[str], dims: list) -> dict:
    """{model: {size: average at that size / average at the first (full) size}} from the bench's average rows."""
    average = {row["model"]: row["value"] for row in report.rows if row.get("kind") == "average"}
    out = {}
    for name in names:
        full = average.get(f"{name}@dim={dims[0]}")
        out[name] = {str(d): (average[f"{name}@dim={d}"] / full if full and f"{name}@dim={d}" in average else None)
                     for d in dims}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="demo-simcse", help="an MLM stage then a contrastive one")
    ap.add_argument("--source", help="the decoder (default: the preset's)")
    ap.add_argument("--data", action="append", help="training text (default: the preset's)")
    ap.add_argument("--dims", default="full,288,144,64", help="sizes trained and scored, the full size first")
    ap.add_argument("--suite", default="standard-dev")
    ap.add_argument("--limit", type=int, help="examples per bench task (quicker, noisier)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "matryoshka-study"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="--set for both conversions (KIND.section.key=value for one stage)")
    ap.add_argument("--name", default=str(RESULTS / "matryoshka_study"), help="results path stem")
    args = ap.parse_args()

    from adapt.bench.dims import parse_dims
    from adapt.bench.runner import run_bench
    from adapt.config.settings import load_preset

    dims = parse_dims(args.dims)
    kinds = [s["kind"] if isinstance(s, dict) else s for s in load_preset(args.preset).get("stages") or []]
    if len(kinds) != 2 or kinds[1] not in ("simcse", "crops", "contrastive"):
        raise SystemExit(f"--preset {args.preset}: expected two stages, masked then contrastive, not {kinds}")
    out, t0 = Path(args.out), time.perf_counter()
    common = {"preset": args.preset, "data": args.data}
    # 1. the demo recipe as it is: MLM, then the contrastive stage
    plain = convert(out / "plain", args.source, overrides=args.overrides, **common)
    mlm = out / "plain" / "stages" / plain["stages"][0]
    # 2. the same contrastive stage with Matryoshka sizes, from the same MLM encoder
    sizes = "[" + ",".join(map(str, dims)) + "]"
    matryoshka = convert(out / "matryoshka", str(mlm), stages=[kinds[1]],
                         overrides=args.overrides + [f"contrastive.matryoshka_dims={sizes}"], **common)
    convert_s = round(time.perf_counter() - t0, 1)

    names = [f"{kinds[1]}", f"{kinds[1]}+matryoshka"]
    models = [f"{out / 'plain'}@label={names[0]}", f"{out / 'matryoshka'}@label={names[1]}"]
    t1 = time.perf_counter()
    report = run_bench(models, suite=args.suite, out_dir=out / f"bench-{args.suite}", limit=args.limit, dims=dims)
    kept = kept_fractions(report, names, dims)
    from transformers import AutoConfig

    hidden = AutoConfig.from_pretrained(str(out / "plain")).get_text_config().hidden_size
    quarter = next((d for d in dims if d != "full" and d * 4 == hidden), None)
    lines = ["", f"Fraction of the full-size average ({hidden} dimensions) kept at each size:", "",
             "| model | " + " | ".join(map(str, dims)) + " |", "|---|" + "---:|" * len(dims)]
    lines += [f"| {n} | " + " | ".join("-" if v is None else f"{v:.1%}" for v in kept[n].values()) + " |"
              for n in names]
    got = kept[names[1]].get(str(quarter)) if quarter else None
    if got is None:
        lines += ["", f"Target (>= {TARGET:.0%} at 1/4 of the full size): not measured; --dims lacks {hidden // 4}."]
    else:
        lines += ["", f"Target: >= {TARGET:.0%} of the full-size average at 1/4 size ({quarter}) with Matryoshka: "
                      f"{'met' if got >= TARGET else 'not met'} ({got:.1%}; without: "
                      f"{kept[names[0]][str(quarter)]:.1%})."]
    markdown = report.markdown + "\n".join(lines) + "\n"

    stem = Path(args.name)
    stem.parent.mkdir(parents=True, exist_ok=True)
    for path in report.paths.values():
        publish(path, stem.with_suffix(Path(path).suffix))
    stem.with_suffix(".md").write_text(relative(markdown), encoding="utf-8")
    per_stage = {f"{run}/{name}": {k: s.get(k) for k in ("steps", "tokens", "train_seconds", "final_eval",
                                                          "matryoshka_dims") if k in s}
                 for run, summary in (("plain", plain), ("matryoshka", matryoshka))
                 for name, s in summary["per_stage"].items()}
    Path(f"{stem}_runs.json").write_text(json.dumps(
        {"preset": args.preset, "source": args.source, "overrides": args.overrides, "dims": dims, "suite": args.suite,
         "limit": args.limit, "hidden_size": hidden, "kept": kept, "target_at_quarter": TARGET, "per_stage": per_stage,
         "convert_seconds_this_call": convert_s, "bench_seconds": round(time.perf_counter() - t1, 1)},
        indent=2) + "\n", encoding="utf-8")
    print(markdown)


if __name__ == "__main__":
    main()
