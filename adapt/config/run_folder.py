"""The run folder: every name in it, preparing it, and reading a run back from it.

A converted run folder ``OUT`` is at once the encoder (transformers + sentence-transformers files at
its root, written by :mod:`adapt.export.dense`) and the record of the run that made it::

    OUT/run/config.yaml        the resolved configuration that ran (a staged run: the chain as a preset)
    OUT/run/metrics.jsonl      training and eval log;  OUT/run/loss.png  its plot
    OUT/run/summary.json       probes, figures; written last, so it marks a finished run
    OUT/run/checkpoints/step-N resume points (Accelerate state + trainer_state.json, written last; under
                               LoRA/QLoRA the model state is the trained weights only: adapt.training.loop)
    OUT/run/adapter/           the LoRA adapter;  OUT/run/data/  the packed token store
    OUT/run/lm_head.safetensors  the trained model's LM head when it is not tied to the input embeddings
                               (the encoder at OUT keeps only the backbone; a later stage or a sparse
                               export of OUT needs the head: :mod:`adapt.model.lm_head`)
    OUT/run/data.json          what a contrastive run trained on (checked on --resume)
    OUT/run/stages/K-KIND.yaml a staged run's per-stage configs;  OUT/stages/K-KIND/  each stage's OUT

Nothing here loads a model: this module sits at the bottom with the config and the file helpers.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from adapt.config.settings import RunConfig
from adapt.errors import ConfigError, ModelLoadError, OutputExistsError
from adapt.files import atomic_write_text

RUN = "run"
CONFIG = "config.yaml"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
LOSS_PLOT = "loss.png"
CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.json"  # in a checkpoint, written last: marks it complete
ADAPTER = "adapter"
TOKEN_STORE = "data"
DATA_FINGERPRINT = "data.json"
STAGES = "stages"
LM_HEAD = "lm_head.safetensors"


def last_stage_dir(out) -> Path | None:
    """``OUT/stages/K-KIND`` of a staged run with the highest K (the stage OUT's encoder comes from), or None."""
    found = [p for p in (Path(out) / STAGES).glob("*-*") if p.is_dir() and p.name.split("-")[0].isdigit()]
    return max(found, key=lambda p: int(p.name.split("-")[0])) if found else None


def run_dir(out) -> Path:
    return Path(out) / RUN


def checkpoint_dirs(run_folder) -> list[Path]:
    """Complete checkpoints of ``run_folder`` (``OUT/run``), oldest first."""
    root = Path(run_folder) / CHECKPOINTS
    found = [p for p in root.glob("step-*") if re.fullmatch(r"step-\d+", p.name) and (p / STATE_FILE).exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def find_checkpoint(path) -> Path | None:
    """``path`` itself if it is a checkpoint, the newest complete one if it is a ``checkpoints`` folder or a
    run folder (``OUT`` or ``OUT/run``); else None."""
    path = Path(path)
    if (path / STATE_FILE).is_file() and path.parent.name == CHECKPOINTS:
        return path
    for folder in (path.parent if path.name == CHECKPOINTS else None, path, path / RUN):
        if folder is not None and (folder / CHECKPOINTS).is_dir():
            found = checkpoint_dirs(folder)
            if found:
                return found[-1]
    return None


def read_run_config(run_folder) -> RunConfig:
    """The RunConfig a run wrote to ``run_folder/config.yaml`` (``run_folder`` is ``OUT/run``)."""
    path = Path(run_folder) / CONFIG
    if not path.is_file():
        raise ModelLoadError(f"{Path(run_folder).parent} is not an adapt run: no {path}")
    try:
        return RunConfig.from_dict(yaml.safe_load(path.read_text(encoding="utf-8")))
    except yaml.YAMLError as e:
        raise ModelLoadError(f"{path}: not valid YAML ({e})") from None


def config_diff(old: dict, new: dict, *, ignore=(("train", "max_steps"),)) -> list[str]:
    """``section.key`` names whose values differ between two ``RunConfig.to_dict()`` dicts."""
    skip = set(ignore)
    keys = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section), new.get(section)
        if isinstance(a, dict) or isinstance(b, dict):
            a, b = a or {}, b or {}
            keys += [f"{section}.{k}" for k in sorted(set(a) | set(b)) if (section, k) not in skip and a.get(k) != b.get(k)]
        elif a != b:
            keys.append(section)
    return keys


def prepare_out(out: Path, configs: dict[str, RunConfig], *, resume: bool, overwrite: bool) -> None:
    """Make ``out`` ready for a run, or refuse with what to do.

    ``configs``: the configuration(s) about to run, by name: ``{"": cfg}`` for one run (checked against
    ``OUT/run/config.yaml``), ``{"K-KIND": cfg, ...}`` for a staged run (checked against
    ``OUT/run/stages/K-KIND.yaml``). An empty ``out`` is used as it is; ``overwrite`` empties a used one;
    ``resume`` continues a run whose settings are the same, except ``train.max_steps``.
    """
    staged = set(configs) != {""}
    saved = {name: (run_dir(out) / STAGES / f"{name}.yaml" if staged else run_dir(out) / CONFIG) for name in configs}
    marker = run_dir(out) / STAGES if staged else run_dir(out) / CONFIG
    if out.exists() and any(out.iterdir()):
        if overwrite:
            shutil.rmtree(out)
        elif resume and marker.exists():
            if staged:
                names = sorted(p.stem for p in marker.glob("*.yaml"))
                if names != sorted(configs):
                    raise ConfigError(f"--resume: {out} holds stages {names}, not {sorted(configs)}; resume with the "
                                      "same --stages, or use --overwrite")
            for name, cfg in configs.items():
                old = RunConfig.from_dict(yaml.safe_load(saved[name].read_text(encoding="utf-8")))
                diff = config_diff(old.to_dict(), cfg.to_dict())
                if diff:
                    what = f"stage {name}'s settings" if staged else "the settings"
                    raise ConfigError(f"--resume: {what} differ from the run in {out} ({', '.join(diff)}); resume "
                                      "with the same command (only train.max_steps may change), or use --overwrite")
        elif resume:
            raise OutputExistsError(f"{out} is not empty and holds no {'staged ' if staged else ''}adapt run to "
                                    "resume; choose another -o")
        else:
            what = "another adapt run" if run_dir(out).exists() else "files"
            raise OutputExistsError(f"{out} already holds {what}: pass --resume to continue it, --overwrite to "
                                    "replace it, or choose another -o")
    for name, cfg in configs.items():
        atomic_write_text(saved[name], cfg.to_yaml())
