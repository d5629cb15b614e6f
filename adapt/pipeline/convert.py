"""``adapt convert``: any causal decoder becomes a verified bidirectional encoder.

One call for one stage or a chain of them: with ``stages`` (``"mlm,simcse"``), ``pairs`` or a preset
that lists ``stages``, :mod:`adapt.pipeline.chain` plans and runs the chain; otherwise the configuration
(preset, then the explicit arguments, then ``--set`` overrides) runs as one stage through
:func:`adapt.pipeline.stage.run_stage`. See :mod:`adapt.config.run_folder` for what ``OUT`` holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from adapt.model.quantization import hide_bitsandbytes, quantizes
from adapt.config.settings import DEFAULT_KIND, DEFAULT_PRESET, RunConfig, build_config, load_preset
from adapt.errors import ConfigError
from adapt.model.loading import resolve_source
from adapt.objectives import registry, with_forced_settings
from adapt.pipeline.stage import run_stage
from adapt.pipeline.chain import run_stages, uses_stages


@dataclass
class ConvertResult:
    out: Path
    config: RunConfig  # the run's configuration (a chain: its last stage's)
    summary: dict  # empty on processes other than the main one
    stages: list = field(default_factory=list)  # a chain's planned stages (adapt.pipeline.chain.Stage)


def convert(source: str | None, out: str | Path, *, preset: str | None = None, overrides: list[str] = (),
            data: list[str] | None = None, objective: str | None = None, tuning: str | None = None,
            max_steps: int | None = None, stages=None, pairs=None, resume: bool = False, overwrite: bool = False,
            show_progress: bool = True, accelerator=None, hide_bnb: bool = False) -> ConvertResult:
    """Convert ``source`` into a bidirectional encoder at ``out`` (see the module docstring). With no
    ``preset``, the ``default`` preset's recipe runs (``adapt presets default``).

    ``hide_bnb`` (the CLI's choice): once the configuration is resolved, keep bitsandbytes out of the
    process when no stage quantizes (:func:`adapt.model.quantization.hide_bitsandbytes`)."""
    preset = preset or DEFAULT_PRESET
    stages = masked_first(preset, stages=stages, pairs=pairs, objective=objective)
    if uses_stages(stages=stages, pairs=pairs, preset=preset):
        if accelerator is not None:
            raise ConfigError("a chain of stages builds one Accelerator per stage: do not pass accelerator=")
        chain = run_stages(source, out, stages=stages, pairs=pairs, preset=preset, overrides=overrides, data=data,
                           objective=objective, tuning=tuning, max_steps=max_steps, resume=resume,
                           overwrite=overwrite, show_progress=show_progress, hide_bnb=hide_bnb)
        return ConvertResult(chain.out, chain.stages[-1].config, chain.summary, chain.stages)
    cfg = build_config(preset, list(overrides), model__source=source, data__sources=list(data) if data else None,
                       objective__schedule=objective, tuning__method=tuning, train__max_steps=max_steps)
    cfg = with_forced_settings(cfg)  # a preset of one `kind` (crops, mntp, ...) trains what that kind is
    resolve_source(cfg.model.source, cfg.model.gguf_file)  # a missing model: said before the data is read
    if hide_bnb and not quantizes(cfg.tuning):
        hide_bitsandbytes()
    result = run_stage(cfg, out, resume=resume, overwrite=overwrite, show_progress=show_progress,
                       accelerator=accelerator)
    return ConvertResult(result.out, result.config, result.summary)


def masked_first(preset: str, *, stages=None, pairs=None, objective: str | None = None):
    """``--objective`` names a masked objective: with a one-kind preset whose kind trains no LM head (the
    default's crops), it asks for a masked stage first, so the run becomes ``mlm,KIND`` (the masked stage
    takes ``objective``). Anything else keeps ``stages`` as given."""
    if not objective or stages or pairs:
        return stages
    raw = load_preset(preset)
    kind = raw.get("kind") or DEFAULT_KIND
    if raw.get("stages") or kind not in registry() or registry()[kind][0].uses_lm_head:
        return stages
    return f"mlm,{kind}"
