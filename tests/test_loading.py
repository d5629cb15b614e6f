"""Loading decoders: folders, bad inputs, pickle refusal, and the mask-token policy."""

import pytest
import torch
from transformers import BertConfig, BertModel

from adapt.bidirectional import is_bidirectional
from adapt.config import ModelConfig
from adapt.errors import ModelLoadError
from adapt.loading import load_decoder, resolve_source, setup_mask_token
from tests.tiny import tiny_decoder


def test_load_folder_is_bidirectional_with_pad(tiny_model_dir):
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)))
    assert is_bidirectional(model)
    assert tok.pad_token is not None
    causal, _ = load_decoder(ModelConfig(source=str(tiny_model_dir)), bidirectional=False)
    assert not is_bidirectional(causal)


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        resolve_source(str(tmp_path / "nope" / "x"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_decoder(ModelConfig(source=str(tmp_path)))


def test_bert_folder_is_not_a_decoder(tmp_path, tokenizer):
    BertModel(BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="not a causal decoder"):
        load_decoder(ModelConfig(source=str(tmp_path)))


def test_pickle_weights_refused_unless_allowed(tmp_path, tokenizer):
    model = tiny_decoder("llama")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # transformers 5 only writes safetensors: make a pickle by hand
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(ModelLoadError, match="pickle"):
        load_decoder(ModelConfig(source=str(tmp_path)))
    loaded, _ = load_decoder(ModelConfig(source=str(tmp_path), allow_pickle=True))
    assert torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight)


def test_dtype_choice(tiny_model_dir):
    model, _ = load_decoder(ModelConfig(source=str(tiny_model_dir), dtype="bfloat16"))
    assert model.dtype == torch.bfloat16


def test_mask_token_auto_adds_and_resizes(tiny_model_dir):
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)))
    n = model.get_input_embeddings().num_embeddings
    mask = setup_mask_token(model, tok, "auto")
    assert (mask.policy, mask.added, mask.token) == ("add", True, "<mask>")
    assert tok.mask_token == "<mask>" and tok.convert_tokens_to_ids("<mask>") == mask.id
    assert model.get_input_embeddings().num_embeddings == n + 1 == len(tok)


def test_mask_token_prefers_tokenizer_then_reserved(tiny_model_dir):
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)))
    tok.add_special_tokens({"additional_special_tokens": ["<|reserved_special_token_0|>"]})
    model.resize_token_embeddings(len(tok))
    mask = setup_mask_token(model, tok, "auto")
    assert mask.policy == "reserved" and mask.token == "<|reserved_special_token_0|>" and not mask.added
    tok.add_special_tokens({"mask_token": "<mask>"})
    model.resize_token_embeddings(len(tok))
    assert setup_mask_token(model, tok, "auto").policy == "tokenizer"


@pytest.mark.parametrize("policy", ["eos", "underscore"])
def test_mask_token_llm2vec_choices(tiny_model_dir, policy):
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)))
    mask = setup_mask_token(model, tok, policy)
    assert not mask.added
    expected = tok.eos_token_id if policy == "eos" else tok.encode("_", add_special_tokens=False)[0]
    assert mask.id == expected


def test_mask_token_bad_literal(tiny_model_dir):
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)))
    with pytest.raises(ModelLoadError, match="not in the vocabulary"):
        setup_mask_token(model, tok, "<nope>")
    with pytest.raises(ModelLoadError, match="no mask token"):
        setup_mask_token(model, tok, "tokenizer")


def test_hub_id_without_network_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="hub id"):
        load_decoder(ModelConfig(source="some-org/some-model-that-is-not-here"))
