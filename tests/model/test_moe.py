"""Mixture-of-experts decoders convert with full, LoRA and QLoRA: LoRA targets attention (the MoE rule in
adapt.model.families), the routers stay frozen under every method, the result is bidirectional."""
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM

from adapt.model.families import MOE_LORA_TARGETS, facts_for, num_experts
from adapt.config.settings import TuningConfig
from adapt.pipeline.convert import convert
from adapt.errors import ConfigError
from adapt.model.tuning import apply_tuning, attention_linears, router_modules
from tests.tiny import CORPUS, TINY_CONFIGS, tiny_decoder

MOE = sorted(f for f in TINY_CONFIGS if num_experts(tiny_decoder(f).config))


def test_the_moe_rule_is_keyed_on_the_config():
    assert MOE == ["gpt_oss", "granitemoe", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]
    for family in MOE:
        assert facts_for(tiny_decoder(family).config).lora_targets == MOE_LORA_TARGETS
    assert facts_for(tiny_decoder("qwen3").config).lora_targets != MOE_LORA_TARGETS  # dense stays as it was
    # an MoE family the registry does not know gets the rule too
    unknown = tiny_decoder("qwen3_moe").config
    unknown.model_type = "some_new_moe"
    assert facts_for(unknown).lora_targets == MOE_LORA_TARGETS


@pytest.mark.parametrize("family", MOE)
def test_attention_targets_and_routers_are_found(family):
    model = tiny_decoder(family)
    assert set(attention_linears(model)) == {f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    routers = router_modules(model)
    assert len(routers) == model.config.num_hidden_layers
    assert all(name.rsplit(".", 1)[-1] in ("gate", "router", "layer") for name in routers), routers


def test_a_classifier_head_with_one_label_per_expert_is_not_a_router():
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_config

    model = AutoModelForSequenceClassification.from_config(tiny_config("qwen3_moe", num_labels=4))
    assert model.score.weight.shape == (4, 32)
    assert router_modules(model) == [f"model.layers.{i}.mlp.gate" for i in range(2)]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join([CORPUS] * 6), encoding="utf-8")
    return path


def _source(tmp_path, tokenizer, family, **overrides):
    src = tmp_path / family
    tiny_decoder(family, vocab_size=len(tokenizer), **overrides).save_pretrained(src)
    tokenizer.save_pretrained(src)
    return src


def _convert(src, out, corpus, tuning, **kw):
    return convert(str(src), out, data=[str(corpus)], preset="tiny", tuning=tuning, show_progress=False, **kw)


def _changed(src, out) -> dict[str, bool]:
    """Which weights the conversion changed, named as transformers names them once loaded (files keep older
    layouts: Mixtral's router is saved as block_sparse_moe.gate); embeddings and head are left out, a new
    mask token resizes them."""
    before = {k.removeprefix("model."): v for k, v in AutoModelForCausalLM.from_pretrained(src).state_dict().items()}
    after = AutoModel.from_pretrained(out).state_dict()
    return {name: not torch.equal(tensor.float(), after[name].float()) for name, tensor in before.items()
            if "embed" not in name and "lm_head" not in name}


def _kind(name: str, routers: set[str]) -> str:
    module = name.rsplit(".", 1)[0]
    if module in routers or name in routers:
        return "router"
    if ".self_attn." in name and name.endswith("proj.weight"):
        return "attention"  # LoRA's targets (their biases stay as they are)
    return "expert" if "expert" in name or "_linear" in name else "other"


@pytest.mark.parametrize("tuning", ["full", "lora"])
@pytest.mark.parametrize("family", MOE)
def test_moe_converts(family, tuning, tmp_path, corpus, tokenizer):
    src = _source(tmp_path, tokenizer, family)
    out = tmp_path / "out"
    result = _convert(src, out, corpus, tuning)
    assert result.summary["probe_before"]["bidirectional"] and result.summary["probe_after"]["bidirectional"]
    routers = {name.removeprefix("model.") for name in router_modules(tiny_decoder(family))}
    changed = _changed(src, out)
    kinds = {}
    for name, moved in changed.items():
        kinds.setdefault(_kind(name, routers), []).append(moved)
    assert kinds["router"] and not any(kinds["router"]), "the routers trained"
    assert all(kinds["attention"]), "an attention projection did not train"
    if tuning == "full":
        assert all(kinds["expert"]), "full fine-tuning left an expert weight untouched"
    else:
        assert not any(kinds["expert"]) and not any(kinds.get("other", [])), "LoRA changed more than attention"
        assert (out / "run/adapter/adapter_model.safetensors").exists()


def test_moe_qlora_quantizes_the_linear_layers_and_merges_into_the_unquantized_base(tmp_path, corpus, tokenizer):
    from adapt.config.settings import ModelConfig
    from adapt.model.loading import load_decoder

    # bitsandbytes' CPU 4-bit path packs blocks of 64 values: hidden 64
    src = _source(tmp_path, tokenizer, "qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                  head_dim=16)
    q, _ = load_decoder(ModelConfig(source=str(src)), TuningConfig(method="qlora", lora_r=4, lora_alpha=8))
    kinds = {name: type(p).__name__ for name, p in q.named_parameters()}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "Params4bit"
    # what bitsandbytes leaves alone in an MoE: the fused experts and the router
    assert kinds["model.layers.0.mlp.experts.gate_up_proj"] == "Parameter"
    assert kinds["model.layers.0.mlp.gate.weight"] == "Parameter"

    out = tmp_path / "q"
    result = _convert(src, out, corpus, "qlora", overrides=["tuning.lora_r=4"])
    assert result.summary["probe_after"]["bidirectional"]
    routers = {name.removeprefix("model.") for name in router_modules(tiny_decoder("qwen3_moe", hidden_size=64,
                                                                                  moe_intermediate_size=64))}
    kinds = {}
    for name, moved in _changed(src, out).items():
        kinds.setdefault(_kind(name, routers), []).append(moved)
    assert all(kinds["attention"]) and not any(kinds["expert"]) and not any(kinds["router"])
    assert all(v.dtype == torch.float32 for v in load_file(str(out / "model.safetensors")).values())


def test_lora_error_gives_advice_that_works():
    """all-linear can reach fused expert weights (peft's ParamWrapper), which take no dropout: the error says
    what to set, and with it LoRA attaches (older peft never reaches them and attaches at once)."""
    for dropout in (0.05, 0.0):
        tuning = TuningConfig(method="lora", lora_r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear")
        model = tiny_decoder("qwen3_moe")
        try:
            peft_model = apply_tuning(model, tuning)
        except ConfigError as err:
            assert dropout and "tuning.lora_dropout=0" in str(err) and "target_modules=all-linear" not in str(err)
            continue
        routers = router_modules(tiny_decoder("qwen3_moe"))
        base = peft_model.get_base_model()
        assert not any(p.requires_grad for r in routers for p in base.get_submodule(r).parameters())
        assert any(p.requires_grad for p in peft_model.parameters())


def test_lora_error_without_a_known_cause_lists_the_linear_layers():
    tuning = TuningConfig(method="lora", lora_r=4, lora_alpha=8, target_modules=["no_such_proj"])
    with pytest.raises(ConfigError, match=r"its linear layers: .*q_proj"):
        apply_tuning(tiny_decoder("qwen3_moe"), tuning)
