"""The probe on every registry family: causal before, bidirectional after, in every padding layout,
and still bidirectional after save and reload through plain transformers."""
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from adapt.model.families import REGISTRY, facts_for
from adapt.model.bidirectional import (assert_bidirectional, causal_attention, is_bidirectional, make_bidirectional,
                                 probe, sliding_window_of)
from adapt.errors import NotBidirectionalError
from tests.tiny import TINY_CONFIGS, tiny_decoder

FAMILIES = sorted(TINY_CONFIGS)


def test_every_tiny_family_is_in_the_registry():
    assert len(FAMILIES) >= 12
    assert set(FAMILIES) <= set(REGISTRY)


@pytest.mark.parametrize("family", FAMILIES)
def test_probe_causal_then_bidirectional(family):
    model = tiny_decoder(family, attn_implementation=facts_for(family).attn_implementations[0])
    before = probe(model)
    assert not before.bidirectional
    assert max(before.unpadded, before.right_padded, before.left_padded) < 1e-5
    with pytest.raises(NotBidirectionalError, match=family):
        assert_bidirectional(model)
    make_bidirectional(model)
    after = assert_bidirectional(model)
    assert min(after.unpadded, after.right_padded, after.left_padded) > 1e-3
    with causal_attention(model):
        assert not probe(model).bidirectional
    assert probe(model).bidirectional


@pytest.mark.parametrize("family", FAMILIES)
def test_reload_through_plain_transformers_stays_bidirectional(family, tmp_path):
    attn = facts_for(family).attn_implementations[0]
    model = make_bidirectional(tiny_decoder(family, attn_implementation=attn))
    model.save_pretrained(tmp_path)
    for cls in (AutoModelForCausalLM, AutoModel):
        reloaded = cls.from_pretrained(tmp_path, attn_implementation=attn)
        assert is_bidirectional(reloaded)
        assert probe(reloaded).bidirectional, cls.__name__


@pytest.mark.parametrize("family", [f for f in FAMILIES if facts_for(f).sliding_window and TINY_CONFIGS[f].get("sliding_window")])
def test_sliding_window_full_by_default_and_kept_on_request(family):
    full = make_bidirectional(tiny_decoder(family))
    assert sliding_window_of(full.config) is None
    kept = make_bidirectional(tiny_decoder(family), sliding_window="keep")
    assert sliding_window_of(kept.config) == TINY_CONFIGS[family]["sliding_window"]
    layer_types = getattr(kept.config, "layer_types", None)
    if layer_types is None or "full_attention" not in layer_types:
        # every layer is local: with the window kept, the first token cannot see beyond it
        assert probe(kept).unpadded < 1e-5
    else:
        # local layers alternate with global ones, which still reach the far token
        assert probe(kept).bidirectional


def test_absolute_positions_need_position_ids_under_left_padding():
    model = make_bidirectional(tiny_decoder("gpt2"))
    ids = torch.randint(16, 300, (1, 6))
    mask = torch.ones(1, 6, dtype=torch.long)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    pmask = torch.cat([torch.zeros(1, 3, dtype=torch.long), mask], 1)
    from adapt.model.bidirectional import position_ids_from_mask
    with torch.no_grad():
        ref = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1][0]
        good = model(padded, attention_mask=pmask, position_ids=position_ids_from_mask(pmask),
                     output_hidden_states=True).hidden_states[-1][0, 3:]
        bad = model(padded, attention_mask=pmask, output_hidden_states=True).hidden_states[-1][0, 3:]
    assert torch.allclose(ref, good, atol=1e-4)
    assert not torch.allclose(ref, bad, atol=1e-3)
