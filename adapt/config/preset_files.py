"""Where the presets live and how one is read: ``presets/NAME.yaml`` (run configs) and
``presets/accelerate/NAME.yaml`` (Accelerate launch configs); :mod:`adapt.config.settings` checks what they hold."""
from __future__ import annotations

from pathlib import Path

import yaml

from adapt.errors import ConfigError


def _presets_dir() -> Path:
    """adapt/presets/ in an installed wheel (package data); the checkout's top-level presets/ when run
    from a source tree or an editable install."""
    package = Path(__file__).resolve().parent.parent  # adapt/
    return package / "presets" if (package / "presets").is_dir() else package.parent / "presets"


PRESETS_DIR = _presets_dir()


def list_presets() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PRESETS_DIR.glob("*.yaml"))}


def accelerate_configs() -> dict[str, Path]:
    """The Accelerate configs shipped with the presets, by name ``accelerate/NAME`` (for
    ``accelerate launch --config_file "$(adapt presets --path accelerate/ddp)" -m adapt convert ...``)."""
    return {f"accelerate/{p.stem}": p for p in sorted((PRESETS_DIR / "accelerate").glob("*.yaml"))}


def preset_path(name: str) -> Path:
    """The file of preset NAME or of Accelerate config ``accelerate/NAME`` (``.yaml`` optional)."""
    found = {**list_presets(), **accelerate_configs()}
    name = name.removesuffix(".yaml")
    if name not in found:
        raise ConfigError(f"no preset {name!r}; available: {', '.join(found)}")
    return found[name]


def load_preset(name_or_path: str) -> dict:
    """A preset by name (``presets/NAME.yaml``) or a path to a YAML file, as a raw dict."""
    path = Path(name_or_path)
    if not path.is_file():
        presets = list_presets()
        if name_or_path not in presets:
            raise ConfigError(f"no preset {name_or_path!r}; available: {', '.join(presets)} "
                              "(or give a path to a YAML file)")
        path = presets[name_or_path]
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a preset must be a mapping of sections")
    return raw
