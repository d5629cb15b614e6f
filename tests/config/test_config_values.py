"""`--set` values are typed by the field they set, and a wrong value names the key and what it takes.

Walks every field of every section with a good value written as text, and (where the field can be
wrong) a bad one.
"""
from dataclasses import MISSING, fields

import pytest
import yaml

from adapt.config.values import describe
from adapt.config.settings import SECTIONS, RunConfig, apply_overrides, build_config
from adapt.errors import ConfigError

# fields that accept any text: no bad value to try
FREE_TEXT = {"model.source", "model.gguf_file", "model.attn_implementation", "model.revision", "data.text_field",
             "contrastive.pairs", "contrastive.query_prompt", "contrastive.document_prompt", "train.best_metric",
             "tuning.target_modules"}
# fields whose text is checked against a set of choices or a range by the section itself
BAD_CHOICE = {"model.dtype": "float64", "model.sliding_window": "half", "model.mask_token": "",
              "objective.schedule": "bogus", "objective.replacement": "random", "tuning.method": "prefix",
              "tuning.quant_type": "int3", "tuning.kbit_fp32": "half", "tuning.cpu_malloc": "jemalloc",
              "train.scheduler": "step", "train.mixed_precision": "fp8", "export.pooling": "max",
              "export.dtype": "int8", "contrastive.loss": "triplet"}
BAD_BY_TYPE = {"int": "abc", "int | None": "1.5", "float": "abc", "float | None": "x", "bool": "maybe",
               "list[str]": "[1, 2]", "list": "{a: 1}", "dict": "[1]"}


def _default(field):
    return field.default_factory() if field.default is MISSING else field.default


def _text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return str(value)


CASES = [(section, f) for section, klass in SECTIONS.items() for f in fields(klass)]


@pytest.mark.parametrize("section, field", CASES, ids=[f"{s}.{f.name}" for s, f in CASES])
def test_every_field_takes_its_default_as_text_and_refuses_a_bad_value(section, field):
    key = f"{section}.{field.name}"
    default = _default(field)
    cfg = build_config(None, [f"{key}={_text(default)}"])
    assert getattr(getattr(cfg, section), field.name) == default
    bad = BAD_CHOICE.get(key, BAD_BY_TYPE.get(field.type))
    if key in FREE_TEXT or bad is None:
        assert field.type in ("str", "str | None", "Any"), f"{key} ({field.type}) needs a bad value in this test"
        return
    with pytest.raises(ConfigError) as err:
        build_config(None, [f"{key}={bad}"])
    assert key in str(err.value), str(err.value)


@pytest.mark.parametrize("item, key, value", [
    ("train.mixed_precision=no", ("train", "mixed_precision"), "no"),  # YAML would read false
    ("export.dtype=null", ("export", "dtype"), None),
    ("train.lr=1e-4", ("train", "lr"), 1e-4),  # YAML 1.1 would read a string
    ("data.max_tokens=1e6", ("data", "max_tokens"), 1_000_000),
    ("tuning.double_quant=off", ("tuning", "double_quant"), False),
    ("train.trackers=tensorboard", ("train", "trackers"), ["tensorboard"]),
    ("data.sources=[a.txt, b.jsonl]", ("data", "sources"), ["a.txt", "b.jsonl"]),
    ("model.revision=1234", ("model", "revision"), "1234"),
    ("objective.schedule={mlm: 3, clm: 1}", ("objective", "schedule"), {"mlm": 3, "clm": 1}),
    ("export.prompts={query: 'query: '}", ("export", "prompts"), {"query": "query: "}),
])
def test_values_are_read_as_their_field_says(item, key, value):
    cfg = build_config(None, [item])
    assert getattr(getattr(cfg, key[0]), key[1]) == value


def test_wrong_values_name_the_key_the_value_and_what_it_takes():
    with pytest.raises(ConfigError, match=r"train.lr='abc': train.lr takes a number"):
        build_config(None, ["train.lr=abc"])
    with pytest.raises(ConfigError, match=r"unknown key 'lrr' in section 'train'"):
        apply_overrides({}, ["train.lrr=1"])
    with pytest.raises(ConfigError, match=r"train.batch_size='eight': train.batch_size takes an integer"):
        RunConfig.from_dict({"train": {"batch_size": "eight"}})  # a preset's YAML is checked the same way
    assert describe("int | None") == "an integer or null"
