"""Values of config fields, typed by the field: from ``--set`` text and from YAML presets alike.

``--set train.mixed_precision=no`` must stay the string "no" (YAML would read a boolean false), and
``--set train.lr=abc`` must say which key wants what, not fail later inside a comparison. Each field's
annotation (``str``, ``int``, ``float``, ``bool``, ``X | None``, ``list[str]``, ``list``, ``dict``,
``Any``) decides how its value is read and checked.
"""
from __future__ import annotations

import re

import yaml

from adapt.errors import ConfigError

_NULLS = {"null", "none", "~", ""}
_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def describe(annotation: str) -> str:
    """What a field of this annotation accepts, in words."""
    base, optional = _split(annotation)
    words = {"str": "text", "int": "an integer", "float": "a number", "bool": "true or false",
             "list[str]": "a list of texts like [a, b] (or one text)", "list": "a list like [0.1, 0.5]",
             "dict": "a mapping like {name: value}", "Any": "a YAML value"}.get(base, base)
    return words + (" or null" if optional else "")


def _split(annotation: str) -> tuple[str, bool]:
    parts = [p.strip() for p in str(annotation).split("|")]
    optional = "None" in parts
    rest = [p for p in parts if p != "None"]
    return (rest[0] if rest else "Any"), optional


def coerce(key: str, annotation: str, value, *, from_text: bool):
    """``value`` as the field ``key`` (``section.name``) of type ``annotation`` holds it; ConfigError if it
    cannot be. ``from_text``: ``value`` is the text of ``--set key=value``, not a YAML value."""
    base, optional = _split(annotation)

    def bad(reason: str = ""):
        return ConfigError(f"{key}={value!r}: {key} takes {describe(annotation)}{reason}")

    if from_text and optional and str(value).strip().lower() in _NULLS:
        return None
    if value is None:
        if optional or base == "Any":
            return None
        raise bad(", not null")
    if base == "str":
        if from_text or isinstance(value, str):
            return str(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # a YAML number where text is meant (revision: 1234)
        raise bad(f", not {type(value).__name__}")
    if base == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise bad()
    if base == "int":
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            return value
        text = str(value).strip()
        if re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        if _FLOAT.fullmatch(text) and float(text).is_integer():
            return int(float(text))  # 1e3
        raise bad()
    if base == "float":
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)):
            return float(value)
        text = str(value).strip()
        if _FLOAT.fullmatch(text):
            return float(text)
        raise bad()
    parsed = _yaml(key, annotation, value) if from_text else value
    if base == "list[str]":
        if isinstance(parsed, str):
            return [parsed]
        if isinstance(parsed, (list, tuple)) and all(isinstance(v, str) for v in parsed):
            return list(parsed)
        raise bad()
    if base == "list":
        if isinstance(parsed, (list, tuple)):
            return list(parsed)
        raise bad()
    if base == "dict":
        if isinstance(parsed, dict):
            return parsed
        raise bad()
    return parsed  # Any: checked by the field's own validation


def _yaml(key: str, annotation: str, text):
    try:
        return yaml.safe_load(text) if str(text) != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}={text!r}: not a YAML value ({e}); {key} takes {describe(annotation)}") from None
