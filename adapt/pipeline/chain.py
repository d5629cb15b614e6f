"""Chained stages: MLM/MNTP continued pretraining, then contrastive training (LLM2Vec's recipe).

    adapt convert MODEL -o OUT --stages mlm,simcse --data corpus.txt
    adapt convert MODEL -o OUT --stages mntp,contrastive --data corpus.txt --pairs pairs.jsonl
    adapt convert MODEL -o OUT --preset llm2vec            # the preset names its stages

Kinds: ``mlm`` (the objective section as configured), ``mntp`` (objective.schedule forced to mntp),
``simcse`` and ``contrastive`` (``adapt.contrastive`` with loss simcse / pairs). Each stage starts
from the merged encoder the one before exported, with its own settings: a preset's
``stages: [mntp, {kind: simcse, train: {...}, contrastive: {...}}]`` overrides sections per stage,
and ``--set KIND.section.key=value`` (or ``--set 2.section.key=value``) overrides one stage, while
``--set section.key=value`` applies to every stage. Layout::

    OUT/                        the final encoder: a sentence-transformers + transformers folder
    OUT/run/config.yaml         a preset that reruns the whole chain (stage 1 + each stage's changes)
    OUT/run/stages/K-KIND.yaml  each stage's resolved configuration;  OUT/run/summary.json
    OUT/stages/1-mlm/           stage 1: a normal `adapt convert` OUT (encoder + run/)
    OUT/stages/2-simcse/        stage 2, trained from OUT/stages/1-mlm

``--resume`` skips finished stages (their ``run/summary.json`` is written last) and resumes the
unfinished one from its last checkpoint. The final encoder's weights are stored twice (in the last
stage's folder and at OUT's root).
"""
from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from adapt.config import run_folder
from adapt.model.families import preferred_attention
from adapt.model.quantization import hide_bitsandbytes, quantizes
from adapt.config.settings import SECTIONS, RunConfig, apply_overrides, check_stages, load_preset
from adapt.data.token_store import resolve_data_sources, resolve_sources
from adapt.errors import ConfigError
from adapt.export.dense import MANIFEST, export_encoder
from adapt.export.folder import previous_rotation
from adapt.files import atomic_write_json, atomic_write_text
from adapt.model.loading import load_config, parse_dtype, resolve_source
from adapt.objectives import build_objective, forced_settings, inapplicable_settings, kinds, registry
from adapt.objectives.infonce import matryoshka_sizes
from adapt.pipeline.stage import probe_saved, run_stage
from adapt.export.sparse import SPARSE, reexport_sparse, require_sparse_support

log = logging.getLogger(__name__)

RUN, STAGES = run_folder.RUN, run_folder.STAGES
PAIR_KINDS = ("contrastive", "splade")  # stages that train on --pairs (splade: crops of --data without it)


@dataclass
class Stage:
    index: int  # 1-based
    kind: str
    config: RunConfig
    dir: Path
    dropped: list[str] = field(default_factory=list)  # settings of the preset or of every stage this kind cannot take

    @property
    def name(self) -> str:
        return f"{self.index}-{self.kind}"

    @property
    def finished(self) -> bool:
        return (self.dir / RUN / "summary.json").is_file() and (self.dir / "modules.json").is_file()


@dataclass
class StagesResult:
    out: Path
    stages: list[Stage]
    summary: dict = field(default_factory=dict)


def parse_stages(stages) -> list[str]:
    """``"mlm,simcse"`` or ``["mlm", "simcse"]`` -> checked kinds."""
    names = [s.strip() for s in stages.split(",")] if isinstance(stages, str) else list(stages or [])
    names = [k for k in names if k]
    for k in names:
        if k not in registry():
            raise ConfigError(f"unknown stage {k!r}: stages are {', '.join(kinds())} (e.g. --stages mlm,simcse)")
    return names


def uses_stages(*, stages=None, pairs=None, preset=None) -> bool:
    """Whether ``adapt convert`` should run :func:`run_stages`: --stages or --pairs given, or a preset with stages."""
    return bool(stages or pairs or (preset and load_preset(preset).get("stages")))


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = {**(out.get(key) or {}), **value} if isinstance(value, dict) else copy.deepcopy(value)
    return out


def _split_overrides(overrides, kinds: list[str]) -> tuple[list[str], dict[int, list[str]]]:
    """``section.key=v`` applies to all stages; ``KIND.section.key=v`` / ``N.section.key=v`` to some."""
    common, per_stage = [], {i: [] for i in range(1, len(kinds) + 1)}
    for item in overrides:
        parts = item.partition("=")[0].split(".")
        if len(parts) < 3 or parts[1] not in SECTIONS:
            common.append(item)
            continue
        selector, rest = parts[0], item.split(".", 1)[1]
        targets = ([int(selector)] if selector.isdigit() and 1 <= int(selector) <= len(kinds)
                   else [i for i, k in enumerate(kinds, 1) if k == selector])
        if not targets:
            raise ConfigError(f"--set {item!r}: {selector!r} names no stage of {','.join(kinds)} "
                              f"(use a stage kind or its number 1..{len(kinds)})")
        for i in targets:
            per_stage[i].append(rest)
    return common, per_stage


def plan_stages(source, out, *, stages=None, pairs=None, preset=None, overrides=(), data=None, objective=None,
                tuning=None, max_steps=None) -> list[Stage]:
    """Resolve and validate every stage's RunConfig before anything runs."""
    out = Path(out).expanduser().resolve()
    raw = load_preset(preset) if preset else {}
    preset_stages = check_stages(raw.pop("stages", None) or [])
    for i, entry in enumerate(preset_stages, 1):
        kind = entry["kind"] if isinstance(entry, dict) else entry
        if kind not in registry():
            raise ConfigError(f"stage {i}: kind must be one of {', '.join(kinds())}, not {kind!r}")
    kinds_ = parse_stages(stages) if stages else [s["kind"] if isinstance(s, dict) else s for s in preset_stages]
    if not kinds_:
        raise ConfigError("no stages: pass --stages mlm,simcse (kinds: " + ", ".join(kinds()) +
                          ") or a preset with a `stages` list")
    if pairs and not set(PAIR_KINDS) & set(kinds_):
        raise ConfigError("--pairs is used by a `contrastive` stage (or a `splade` stage): add one, e.g. --stages mlm,contrastive")
    if "splade" in kinds_:  # before any training: its export would not load right
        require_sparse_support("a `splade` stage's sparse encoders")
    unused = list(preset_stages)
    common, per_stage = _split_overrides(list(overrides), kinds_)
    description = raw.pop("description", "") or ""
    plan: list[Stage] = []
    for i, kind in enumerate(kinds_, 1):
        entry = next((s for s in unused if (s["kind"] if isinstance(s, dict) else s) == kind), None)
        if entry is not None:
            unused.remove(entry)
        own = {k: v for k, v in entry.items() if k != "kind"} if isinstance(entry, dict) else {}
        stage_raw = _merge(raw, own)
        explicit = {("model", "source"): source if i == 1 else None, ("data", "sources"): list(data) if data else None,
                    ("tuning", "method"): tuning, ("train", "max_steps"): max_steps,
                    ("objective", "schedule"): objective if registry()[kind][0].uses_lm_head else None,
                    ("contrastive", "pairs"): str(pairs) if pairs and kind in PAIR_KINDS else None}
        for (section, name), value in explicit.items():
            if value is not None:
                stage_raw[section] = {**(stage_raw.get(section) or {}), name: value}
        stage_raw = apply_overrides(stage_raw, common + per_stage[i])
        stage_raw, dropped = _drop_inapplicable(i, kind, stage_raw, own=own, targeted=per_stage[i])
        forced = _merge(forced_settings(kind), {"kind": kind})
        if i > 1:  # chained: start from the previous stage's merged encoder (a local safetensors folder)
            forced = _merge(forced, {"model": {"source": str(plan[-1].dir), "gguf_file": None, "revision": None}})
        stage_raw = _merge(stage_raw, forced)
        stage_raw["description"] = f"{description.strip()} [stage {i}/{len(kinds_)}: {kind}]".strip()
        try:
            cfg = RunConfig.from_dict(stage_raw)
        except ConfigError as e:
            raise ConfigError(f"stage {i} ({kind}): {e}") from None
        if not cfg.data.sources and not (kind in PAIR_KINDS and cfg.contrastive.pairs):
            raise ConfigError(f"stage {i} ({kind}) needs training text: pass --data PATH or name data.sources in the preset")
        if kind == "contrastive" and not cfg.contrastive.pairs:
            raise ConfigError(f"stage {i} (contrastive) needs pairs: pass --pairs FILE (JSON lines of "
                              '{"query": ..., "positive": ..., "negatives": [...]})')
        plan.append(Stage(i, kind, cfg, out / STAGES / f"{i}-{kind}", dropped))
    if not plan[0].config.model.source:
        raise ConfigError("no model: pass MODEL (a folder, hub id, .gguf file or py:PACKAGE) or a preset naming model.source")
    return plan


def _drop_inapplicable(i: int, kind: str, stage_raw: dict, *, own: dict, targeted: list[str]) -> tuple[dict, list[str]]:
    """Settings stage ``i`` of ``kind`` cannot take (``inapplicable_settings``): reset to their defaults when they
    came from the preset or a --set for every stage (returned, to be reported); refused when set for this stage."""
    defaults, dropped = RunConfig(), []
    for name, why in inapplicable_settings(kind).items():
        section, key = name.split(".")
        default = getattr(getattr(defaults, section), key)
        value = (stage_raw.get(section) or {}).get(key, default)
        if value == default:
            continue
        if key in (own.get(section) or {}) or any(item.partition("=")[0] == name for item in targeted):
            raise ConfigError(f"stage {i} ({kind}): {name} does not apply to this kind: {why}. "
                              f"Remove it from the stage's settings (its default is {default!r})")
        stage_raw = _merge(stage_raw, {section: {key: default}})
        dropped.append(name)
    return stage_raw, dropped


def chain_preset(plan: list[Stage]) -> dict:
    """A preset that reruns ``plan``: stage 1's settings plus, per stage, the sections that differ."""
    base = plan[0].config.to_dict()
    base.pop("description", None)
    base.pop("kind", None)
    entries = []
    for stage in plan:
        mine = stage.config.to_dict()
        diff = {}
        for section in SECTIONS:
            changed = {k: v for k, v in (mine.get(section) or {}).items()
                       if (base.get(section) or {}).get(k, getattr(getattr(RunConfig(), section), k)) != v}
            if section == "model" and stage.index > 1:
                changed = {k: v for k, v in changed.items() if k not in ("source", "gguf_file", "revision")}
            if changed:
                diff[section] = changed
        entries.append({"kind": stage.kind, **diff} if diff else stage.kind)
    description = plan[0].config.description.rsplit(" [stage", 1)[0]
    return {**({"description": description} if description else {}), **base, "stages": entries}


def _prepare_out(out: Path, plan: list[Stage], *, resume: bool, overwrite: bool) -> None:
    run_folder.prepare_out(out, {stage.name: stage.config for stage in plan}, resume=resume, overwrite=overwrite)
    atomic_write_text(out / RUN / "config.yaml", yaml.safe_dump(chain_preset(plan), sort_keys=False))


def _validate_data(plan: list[Stage]) -> None:
    """Read every pairs file once before stage 1, so a bad line fails now, not after hours of MLM; check
    Matryoshka sizes against the model's hidden size likewise."""
    for stage in plan:
        if stage.config.contrastive.pairs:
            build_objective(stage.config).read_data()
        elif stage.config.data.sources:  # every stage's files exist (hub datasets are read when their stage runs)
            resolve_sources(resolve_data_sources(stage.config.data.sources))
    sized = [stage for stage in plan if stage.config.contrastive.matryoshka_dims]
    if sized:
        config = load_config(plan[0].config.model)
        for stage in sized:
            try:
                matryoshka_sizes(stage.config.contrastive.matryoshka_dims,
                                 stage.config.contrastive.matryoshka_weights, config)
            except ConfigError as e:
                raise ConfigError(f"stage {stage.index} ({stage.kind}): {e}") from None


def _reset_accelerate() -> None:
    """Each stage builds its own Accelerator (precision, accumulation); the process group stays."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def run_stages(source, out, *, stages=None, pairs=None, preset=None, overrides=(), data=None, objective=None,
               tuning=None, max_steps=None, resume: bool = False, overwrite: bool = False,
               show_progress: bool = True, hide_bnb: bool = False) -> StagesResult:
    """Run the stages into ``out`` (see the module docstring); returns the plan and the chain summary.

    ``stages``: "mlm,simcse", a list of kinds, or None for the preset's ``stages``. ``pairs``: the
    JSON-lines file of a ``contrastive`` stage. ``data``, ``objective`` (masked stages), ``tuning``,
    ``max_steps`` and ``overrides`` (``--set``) apply to every stage; see :func:`plan_stages`.
    ``hide_bnb``: keep bitsandbytes out of the process when no stage quantizes (see :mod:`adapt.model.loading`).
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    t0 = time.perf_counter()
    out = Path(out).expanduser().resolve()
    plan = plan_stages(source, out, stages=stages, pairs=pairs, preset=preset, overrides=overrides, data=data,
                       objective=objective, tuning=tuning, max_steps=max_steps)
    resolve_source(plan[0].config.model.source, plan[0].config.model.gguf_file)  # a missing model: said first
    _validate_data(plan)
    if hide_bnb and not any(quantizes(stage.config.tuning) for stage in plan):
        hide_bitsandbytes()
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # as Accelerator() reads it
    if state.is_main_process:
        _prepare_out(out, plan, resume=resume, overwrite=overwrite)
    state.wait_for_everyone()
    summaries = {}
    for stage in plan:
        if stage.finished:
            log.info("stage %s is finished; skipped", stage.name)
            summaries[stage.name] = json.loads((stage.dir / RUN / "summary.json").read_text())
            continue
        started = (stage.dir / RUN / "config.yaml").is_file()
        if state.is_main_process and stage.dir.exists() and not started:
            shutil.rmtree(stage.dir)  # a stage that died before writing anything of its own
        state.wait_for_everyone()
        if show_progress and state.is_main_process:
            print(f"stage {stage.index}/{len(plan)}: {stage.kind} -> {stage.dir}", flush=True)
            if stage.dropped:
                print(f"  {', '.join(stage.dropped)} left at their defaults: they do not apply to a "
                      f"{stage.kind} stage", flush=True)
        _reset_accelerate()
        summaries[stage.name] = run_stage(stage.config, stage.dir, resume=started, show_progress=show_progress).summary
    summary = {}
    if state.is_main_process:
        summary = _publish(plan, out, summaries)
        summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
        atomic_write_json(out / RUN / "summary.json", summary)
    state.wait_for_everyone()
    return StagesResult(out, plan, summary)


def _publish(plan: list[Stage], out: Path, summaries: dict) -> dict:
    """Export the last stage's encoder at ``out``'s root (reloaded as a user would, probed again)."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    last = plan[-1].dir
    manifest = json.loads((last / MANIFEST).read_text(encoding="utf-8"))
    source = plan[0].config.model.source
    rows = [{"stage": s.name, "steps": summaries.get(s.name, {}).get("steps"),
             **{k: round(v, 4) for k, v in (summaries.get(s.name, {}).get("final_eval") or {}).items()}}
            for s in plan]
    card = {"source": source, "stages": ", ".join(s.name for s in plan), **{r["stage"]: r for r in rows},
            "recipe": chain_preset(plan)}
    if manifest.get("kind") == SPARSE:
        reexport_sparse(last, out, card=card, origin=source)
        return {"source": source, "stages": [s.name for s in plan], "per_stage": summaries,
                "final": str(plan[-1].dir), "probe_after": probe_saved(out).to_dict()}
    dtype = parse_dtype(manifest.get("dtype"))
    attn = manifest.get("attn_implementation") or preferred_attention(AutoConfig.from_pretrained(str(last)))
    model = AutoModel.from_pretrained(str(last), dtype=dtype, attn_implementation=attn)
    tokenizer = AutoTokenizer.from_pretrained(str(last))
    export_encoder(model, tokenizer, out, pooling=manifest["pooling"], normalize=manifest["normalize"],
                   max_seq_length=manifest["max_seq_length"], prompts=manifest.get("prompts") or None, dtype=dtype,
                   card=card, source=source, matryoshka_dims=manifest.get("matryoshka_dims"),
                   rotation=previous_rotation(last, manifest, None), order=manifest.get("order_dims"),
                   sink_prompt=manifest.get("sink_prompt") or "")
    return {"source": source, "stages": [s.name for s in plan], "per_stage": summaries,
            "final": str(plan[-1].dir), "probe_after": probe_saved(out).to_dict()}
