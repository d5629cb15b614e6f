"""Every preset parses into a valid RunConfig; overrides and bad keys behave."""
import pytest
import yaml

from adapt.config.settings import RunConfig, build_config, list_presets, load_preset, preset_path
from adapt.errors import ConfigError
from adapt.export.sparse import sparse_supported

REQUIRED = {"llm2vec-mntp", "mlm-40", "clm-then-mlm", "mix-50-50", "qlora", "tiny", "demo"}


def test_required_presets_exist():
    assert REQUIRED <= set(list_presets())


@pytest.mark.parametrize("name", sorted(list_presets()))
def test_preset_is_valid_and_round_trips(name):
    cfg = RunConfig.from_dict(load_preset(name))
    assert cfg.description, f"preset {name} needs a description line"
    again = RunConfig.from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def test_preset_specifics():
    assert build_config("llm2vec-mntp").objective.schedule == "mntp"
    assert build_config("llm2vec-mntp").model.mask_token == "underscore"
    assert build_config("mlm-40").objective.mask_ratio == 0.4
    phases = build_config("clm-then-mlm").objective.schedule
    assert [p["objective"] for p in phases] == ["clm", "mlm"]
    assert build_config("qlora").tuning.method == "qlora"
    # the recipe study's eighth screening: the demo and the no-preset recipe put a sink prompt before every text
    assert build_config("demo").export.sink_prompt == build_config("default").export.sink_prompt == "\n"
    assert build_config("demo-mlm").export.sink_prompt == ""
    # the tenth: the demo and the no-preset recipe keep the source (1 - linear CKA, weight 4); demo-retrieval is the
    # demo without it, given the steps the source's forward took
    assert build_config("demo").contrastive.keep_source == build_config("default").contrastive.keep_source == 4.0
    demo, retrieval = build_config("demo").to_dict(), build_config("demo-retrieval").to_dict()
    assert (demo["contrastive"].pop("keep_source"), retrieval["contrastive"].pop("keep_source")) == (4.0, 0.0)
    assert (demo["train"].pop("max_steps"), retrieval["train"].pop("max_steps")) == (116, 204)
    demo.pop("description"), retrieval.pop("description")
    assert demo == retrieval


def test_the_matryoshka_demo_is_the_retrieval_demo_trained_at_every_size_and_ordered():
    demo, mrl = build_config("demo-retrieval").to_dict(), build_config("demo-matryoshka").to_dict()
    assert mrl["contrastive"].pop("matryoshka_dims") == ["full", 288, 144, 64]
    assert demo["contrastive"].pop("matryoshka_dims") == []
    assert (mrl["export"].pop("order_dims"), demo["export"].pop("order_dims")) == ("pca", "none")
    for cfg in (demo, mrl):
        cfg.pop("description")
    assert mrl == demo  # the same recipe otherwise: a change to the demo must be made to both


def test_overrides_and_explicit_arguments():
    cfg = build_config("tiny", ["train.lr=0.5", "objective.schedule={mlm: 0.75, clm: 0.25}"], train__max_steps=9)
    assert cfg.train.lr == 0.5 and cfg.train.max_steps == 9
    assert cfg.objective.schedule == {"mlm": 0.75, "clm": 0.25}
    assert build_config("tiny", ["train.max_steps=3"], train__max_steps=9).train.max_steps == 3


@pytest.mark.parametrize("bad, match", [
    (["train.nope=1"], "unknown key"),
    (["nosection.x=1"], "unknown section"),
    (["train.lr"], "section.key=value"),
    (["objective.mask_ratio=1.5"], "mask_ratio"),
    (["objective.schedule=mlmx"], "objective.schedule"),
    (["tuning.method=ia3"], "tuning.method"),
])
def test_bad_settings_are_clear_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        build_config("tiny", bad)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="available"):
        load_preset("does-not-exist")


def test_preset_path_names_recipes_and_accelerate_configs():
    assert preset_path("tiny") == preset_path("tiny.yaml") == list_presets()["tiny"]
    assert preset_path("accelerate/ddp").is_file() and preset_path("accelerate/ddp").parent.name == "accelerate"
    with pytest.raises(ConfigError, match="accelerate/fsdp"):
        preset_path("accelerate/nope")


@pytest.mark.skipif(not sparse_supported(), reason="a splade stage needs sentence-transformers >= 6.2")
def test_the_splade_demo_is_demo_mlm_then_the_chosen_splade_stage(tmp_path):
    """demo-splade holds the sparse study's chosen chain (benchmarks/studies/sparse_study.py runs it): demo-mlm's MLM
    stage as it is, then the SPLADE stage chosen on dev (IDF queries, the own-token floor, no FLOPS, LoRA, top 256)."""
    from adapt.pipeline.chain import plan_stages

    def configs(**kw):
        return [(s.kind, {k: v for k, v in s.config.to_dict().items() if k != "description"})
                for s in plan_stages(None, tmp_path, **kw)]

    demo = configs(preset="demo-splade")
    assert [kind for kind, _ in demo] == ["mlm", "splade"]
    assert demo[0] == configs(preset="demo-mlm", stages="mlm")[0]
    splade = demo[1][1]
    assert splade["splade"]["queries"] == "idf" and splade["splade"]["top_k"] == 256
    assert splade["splade"]["own_terms"] == 1.0 and splade["splade"]["lambda_d"] == 0.0
    assert splade["tuning"]["method"] == "lora" and splade["tuning"]["lora_r"] == 16
    assert (splade["train"]["lr"], splade["train"]["max_steps"], splade["train"]["batch_size"]) == (1e-3, 120, 16)
