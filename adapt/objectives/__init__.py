"""Training objectives: what a stage trains, plugged into the one loop (:mod:`adapt.training.loop`).

The stage runner (:mod:`adapt.pipeline.stage`) owns setup and teardown; the loop owns optimizer, schedule,
accumulation, clipping, checkpoints, logging and evaluation timing; an objective owns its data, the
module the loop trains, the forward and backward of one micro-batch, and its evaluation. The loop
does not know which objective it trains, as sentence-transformers' losses are independent of its
trainer.

An objective is one module of this package that declares the stage kinds it trains and its class::

    KINDS = {"mlm": {}, "mntp": {"objective": {"schedule": "mntp"}}}   # kind -> settings the kind forces
    OBJECTIVE = MaskedLM                                                  # built as OBJECTIVE(run_config)

Adding an objective is adding such a module: ``adapt convert --stages KIND`` and presets find it here.
Modules without ``KINDS`` (``masking``, ``infonce``) are the objectives' shared parts.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from adapt.errors import ConfigError


@dataclass
class StepOutput:
    loss: torch.Tensor  # the micro-batch's loss, detached (checked for NaN by the loop)
    tokens: int  # tokens this micro-batch trained on, over all processes
    label: str  # what trained (the objective of a mixture's step, the contrastive loss): logged
    parts: dict[str, float] = field(default_factory=dict)  # the loss's terms when it has several (they sum to it)


@dataclass
class StageContext:
    """What :meth:`Objective.prepare` may use: the loaded (untuned) model and where the run lives."""
    model: torch.nn.Module
    tokenizer: object
    run_dir: Path
    accelerator: object
    show_progress: bool = True


@runtime_checkable
class Objective(Protocol):
    kind: str
    loss_name: str  # what the training loss is ("cross-entropy", "InfoNCE + keep_source", ...): the loss plot's label
    micro_batches: int  # micro-batches accumulated into one optimizer step
    uses_lm_head: bool  # False: an untied LM head is frozen (encoder objectives never run it)
    export_kind: str  # "dense": a sentence-transformers encoder; "sparse": a SPLADE SparseEncoder (adapt.export.sparse)

    def read_data(self) -> dict | None:
        """Read and check what can be read before anything is written; a fingerprint to check on resume."""

    def check_launch(self, accelerator) -> None:
        """Refuse a launch this objective cannot train under (precision, DeepSpeed, ...)."""

    def configure_model(self, model, tokenizer) -> list[int]:
        """Adjust the freshly loaded model (also the unquantized base a QLoRA adapter merges into, and a
        model rebuilt from a checkpoint) the same way every time; returns token ids added to it."""

    def prepare(self, ctx: StageContext) -> None:
        """Build the training data (token stores, example lists) once the model and tokenizer are loaded."""

    def module(self, model) -> torch.nn.Module:
        """The module the loop trains and Accelerate wraps; its ``.model`` is ``model``."""

    def start(self, step: int, accelerator) -> None:
        """Position the data at optimizer step ``step`` (0, or a resumed run's step)."""

    def step(self, module, accelerator, step: int) -> StepOutput:
        """Forward and backward (``accelerator.backward``) of the next micro-batch of optimizer step ``step``."""

    def evaluate(self, module, accelerator) -> dict:
        """Held-out metrics (``eval/...``), sharded over processes and gathered: the same on every process."""

    def summary(self) -> dict:
        """Figures of this objective for ``run/summary.json`` and the model card."""

    def export_prompts(self) -> dict:
        """Prompts the exported encoder should carry because of how it was trained."""

    def matryoshka_dims(self) -> list[int]:
        """Sizes the encoder was trained to be truncated to (Matryoshka), largest first; [] for none."""


class ObjectiveBase:
    """No-op defaults for the optional parts of :class:`Objective`."""

    uses_lm_head = False
    export_kind = "dense"
    loss_name = "loss"
    # "section.key" -> why that setting does not apply to this kind: a stage planned from a preset or a
    # --set meant for every stage drops it (and says so); one set for this very stage is refused
    inapplicable: dict[str, str] = {}

    def read_data(self) -> dict | None:
        return None

    def check_launch(self, accelerator) -> None:
        return None

    def configure_model(self, model, tokenizer) -> list[int]:
        return []

    def summary(self) -> dict:
        return {}

    def export_prompts(self) -> dict:
        return {}

    def matryoshka_dims(self) -> list[int]:
        return []


@functools.lru_cache(maxsize=None)
def registry() -> dict[str, tuple[object, dict]]:
    """Stage kind -> (objective class, settings the kind forces), from this package's modules."""
    found: dict[str, tuple[object, dict]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for kind, forced in getattr(module, "KINDS", {}).items():
            if kind in found:
                raise RuntimeError(f"objective kind {kind!r} is declared by two modules")
            found[kind] = (module.OBJECTIVE, forced)
    return found


def kinds() -> list[str]:
    return list(registry())


def check_kind(kind: str, where: str = "") -> str:
    if kind not in registry():
        raise ConfigError(f"{where}unknown kind {kind!r}: kinds are {', '.join(kinds())}")
    return kind


def inapplicable_settings(kind: str) -> dict[str, str]:
    """``"section.key" -> why`` for the settings a stage of ``kind`` cannot take (see ``ObjectiveBase``)."""
    return dict(getattr(registry()[check_kind(kind)][0], "inapplicable", {}))


def forced_settings(kind: str) -> dict:
    """The sections a stage of ``kind`` forces (e.g. mntp forces ``objective.schedule: mntp``)."""
    return registry()[check_kind(kind)][1]


def with_forced_settings(cfg):
    """``cfg`` (a RunConfig) with the settings its ``kind`` forces applied, as every stage of a chain gets them:
    a single-stage run of ``kind: crops`` trains crops (``contrastive.loss: crops``), ``kind: mntp`` MNTP."""
    forced = forced_settings(cfg.kind)
    if not forced:
        return cfg
    raw = cfg.to_dict()
    for section, values in forced.items():
        raw[section] = {**(raw.get(section) or {}), **values}
    raw["kind"] = cfg.kind
    return type(cfg).from_dict(raw)


def build_objective(cfg) -> Objective:
    """The objective that trains run config ``cfg`` (its ``kind``)."""
    cls, _ = registry()[check_kind(cfg.kind, "run config: ")]
    return cls(cfg)
