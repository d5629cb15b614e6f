"""Exported encoders: the sentence-transformers layout, round trips through sentence-transformers and plain
transformers (same vectors as adapt's encoder, still bidirectional after every reload), the run folder left
alone, and exports that are or come back causal refused."""
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from sentence_transformers import SentenceTransformer
from transformers import AutoModel, AutoTokenizer

import adapt.export.dense as export_mod
from adapt.model.families import facts_for
from adapt.model.bidirectional import make_bidirectional, probe
from adapt.inference.encoder import load_encoder
from adapt.errors import ModelLoadError, NotBidirectionalError
from adapt.export.dense import export_encoder
from adapt.pipeline.reexport import export_from_path
from tests.tiny import tiny_decoder

TEXTS = ["The quick brown fox jumps over the lazy dog.", "An encoder reads the whole sentence at once.",
         "Retrieval", "Masked language modeling hides some tokens and asks the model to predict them. " * 2]
PROMPTS = {"query": "query: ", "document": ""}


def cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture
def bidir(tokenizer):
    return make_bidirectional(tiny_decoder("llama", vocab_size=len(tokenizer)))


def test_layout_and_round_trips(bidir, tokenizer, tmp_path):
    out = tmp_path / "enc"
    export_encoder(bidir, tokenizer, out, prompts=PROMPTS, max_seq_length=64, source="tiny/llama",
                   card={"objective": "mlm", "steps": 7, "final_eval": {"loss": 3.25}, "bench": {"lee_sts": 0.42}})
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modules.json", "sentence_bert_config.json", "tokenizer.json",
            "config_sentence_transformers.json", "1_Pooling", "README.md"} <= names
    assert "2_Normalize" not in names and not any(n.endswith((".bin", ".pt")) for n in names)
    config = json.loads((out / "config.json").read_text())
    assert config["is_causal"] is False and config["architectures"] == ["LlamaModel"]
    st_config = json.loads((out / "config_sentence_transformers.json").read_text())
    assert st_config["prompts"] == PROMPTS and st_config["similarity_fn_name"] == "cosine"
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "mean"
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.padding_side == "right" and tok.pad_token is not None and tok.model_max_length == 64
    card = (out / "README.md").read_text()
    for expected in ("tiny/llama", "| objective | mlm |", "| steps | 7 |", "| loss | 3.25 |", "## Benchmark",
                     "| lee_sts | 0.42 |", "| pooling | mean |"):
        assert expected in card

    backbone = AutoModel.from_pretrained(out)  # plain transformers, no custom code
    assert probe(backbone).bidirectional
    st = SentenceTransformer(str(out), device="cpu")
    assert probe(st[0].auto_model).bidirectional
    encoder = load_encoder(out)
    for prompt_name in (None, "query"):
        expected = st.encode(TEXTS, prompt_name=prompt_name)
        assert cosines(expected, encoder.encode(TEXTS, prompt_name=prompt_name)).min() > 0.9999
    # the prompt changes the vectors, so the check above is not vacuous
    assert cosines(encoder.encode(TEXTS), encoder.encode(TEXTS, prompt_name="query")).min() < 0.9999
    # the backbone's mean-pooled hidden states are the encoder's vectors
    ids = tok(TEXTS[0], return_tensors="pt")
    with torch.no_grad():
        manual = backbone(**ids).last_hidden_state[0].mean(0).numpy()[None]
    assert cosines(manual, encoder.encode(TEXTS[:1])).min() > 0.9999


def test_run_folder_untouched_and_stale_files_removed(bidir, tokenizer, tmp_path):
    out = tmp_path / "enc"
    (out / "run" / "checkpoints").mkdir(parents=True)
    (out / "run" / "config.yaml").write_text("keep: me\n")
    export_encoder(bidir, tokenizer, out, normalize=True)
    assert (out / "2_Normalize").is_dir()
    export_encoder(bidir, tokenizer, out, pooling="last", normalize=False)
    assert not (out / "2_Normalize").exists()
    assert (out / "run" / "config.yaml").read_text() == "keep: me\n" and (out / "run" / "checkpoints").is_dir()
    assert json.loads((out / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "lasttoken"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch folder left behind


def test_normalize_module(bidir, tokenizer, tmp_path):
    export_encoder(bidir, tokenizer, tmp_path / "enc", normalize=True)
    vectors = SentenceTransformer(str(tmp_path / "enc"), device="cpu").encode(TEXTS)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert np.allclose(load_encoder(tmp_path / "enc").encode(TEXTS), vectors, atol=1e-5)


def test_causal_model_is_refused(tokenizer, tmp_path):
    causal = tiny_decoder("llama", vocab_size=len(tokenizer))
    with pytest.raises(NotBidirectionalError, match="causal"):
        export_encoder(causal, tokenizer, tmp_path / "enc")
    assert not (tmp_path / "enc" / "modules.json").exists()


def test_export_that_comes_back_causal_is_refused(bidir, tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "enc"
    export_encoder(bidir, tokenizer, out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    real_build = export_mod._build

    def build_then_break(stage, built, **kw):  # as if transformers dropped is_causal on save
        real_build(stage, built, **kw)
        config = json.loads((built / "config.json").read_text())
        config["is_causal"] = True
        (built / "config.json").write_text(json.dumps(config))

    monkeypatch.setattr(export_mod, "_build", build_then_break)
    with pytest.raises(NotBidirectionalError, match="still causal"):
        export_encoder(bidir, tokenizer, out, pooling="last")
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # the good export is untouched
    assert json.loads((out / "config.json").read_text())["is_causal"] is False


@pytest.mark.parametrize("family", ["stablelm", "gemma2", "gpt2", "qwen2"])
def test_families_round_trip(family, tokenizer, tmp_path):
    model = make_bidirectional(tiny_decoder(family, vocab_size=len(tokenizer),
                                            attn_implementation=facts_for(family).attn_implementations[0]))
    out = tmp_path / family
    export_encoder(model, tokenizer, out)
    st_config = json.loads((out / "sentence_bert_config.json").read_text())
    preferred = facts_for(family).attn_implementations[0]
    assert st_config.get("model_kwargs", {}).get("attn_implementation", "sdpa") == preferred
    st = SentenceTransformer(str(out), device="cpu")
    assert st[0].auto_model.config._attn_implementation == preferred
    assert probe(st[0].auto_model).bidirectional
    assert cosines(st.encode(TEXTS, batch_size=2), load_encoder(out).encode(TEXTS)).min() > 0.9999
    plain = AutoModel.from_pretrained(out)  # no arguments: config.json pins the attention where it matters
    assert plain.config._attn_implementation == preferred and probe(plain).bidirectional


def test_dtype_and_missing_pad_token(bidir, tokenizer, tmp_path):
    tok = AutoTokenizer.from_pretrained(_saved(tokenizer, tmp_path / "tok"))
    tok.pad_token, tok.padding_side = None, "left"  # as many decoders ship
    export_encoder(bidir, tok, tmp_path / "enc", dtype="bf16")
    with safe_open(str(tmp_path / "enc" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    saved = AutoTokenizer.from_pretrained(tmp_path / "enc")
    assert saved.pad_token == saved.eos_token == "</s>" and saved.padding_side == "right"
    assert next(bidir.parameters()).dtype == torch.float32  # the caller's model is not cast


def test_peft_model_is_merged(bidir, tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(bidir, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    export_encoder(peft_model, tokenizer, tmp_path / "enc")
    assert not (tmp_path / "enc" / "adapter_config.json").exists()
    assert probe(AutoModel.from_pretrained(tmp_path / "enc")).bidirectional


def test_export_from_path(bidir, tokenizer, tmp_path):
    first = tmp_path / "enc"
    export_encoder(bidir, tokenizer, first, prompts=PROMPTS, card={"objective": "mlm"})
    again = export_from_path(first, tmp_path / "enc-last", pooling="last", dtype="fp16")
    st = SentenceTransformer(str(again), device="cpu")
    assert json.loads((again / "1_Pooling" / "config.json").read_text())["pooling_mode"] == "lasttoken"
    assert st.prompts == PROMPTS and st[0].auto_model.dtype == torch.float16
    assert "| objective | mlm |" in (again / "README.md").read_text()
    # a transformers folder with the tokenizer higher up (OUT/model/ next to OUT's tokenizer)
    bidir.save_pretrained(tmp_path / "out" / "model")
    tokenizer.save_pretrained(tmp_path / "out")
    exported = export_from_path(tmp_path / "out", tmp_path / "from-sub")
    assert probe(SentenceTransformer(str(exported), device="cpu")[0].auto_model).bidirectional


SENTENCES = ["the cat sat on the mat", "a decoder became an encoder today", "stock markets fell sharply"]


def _same_vectors(a, b):
    ea = SentenceTransformer(str(a), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    eb = SentenceTransformer(str(b), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    return float(torch.nn.functional.cosine_similarity(ea, eb).min())


@pytest.mark.parametrize("tuning", ["full", "lora", "qlora"])
def test_export_from_a_training_checkpoint(tiny_model_dir, tmp_path, tuning):
    """A checkpoint of the last step exports the same encoder as the run's own export; an earlier one differs."""
    from adapt.pipeline.convert import convert
    from tests.tiny import CORPUS

    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS * 4)
    out = tmp_path / "run"
    convert(str(tiny_model_dir), out, preset="tiny", data=[str(corpus)], tuning=tuning, show_progress=False,
            overrides=["train.keep_checkpoints=2", "tuning.lora_r=4"])
    last, earlier = out / "run/checkpoints/step-000004", out / "run/checkpoints/step-000002"
    assert last.is_dir() and earlier.is_dir()
    exported = export_from_path(last, tmp_path / "from-last", pooling="lasttoken")
    st = SentenceTransformer(str(exported), device="cpu")
    assert probe(st[0].auto_model).bidirectional
    assert json.loads((exported / "1_Pooling/config.json").read_text())["pooling_mode"] == "lasttoken"
    card = (exported / "README.md").read_text()
    assert "step-000004 (step 4 of 4)" in card and tuning in card
    same = export_from_path(last, tmp_path / "from-last-mean")  # the run's pooling, as OUT was exported
    floor = 0.999 if tuning == "qlora" else 0.99999  # QLoRA: trained on 4-bit weights, merged into the unquantized base
    assert _same_vectors(same, out) > floor
    # the checkpoints folder means its newest checkpoint; an earlier step is another model
    newest = export_from_path(out / "run/checkpoints", tmp_path / "newest")
    assert _same_vectors(newest, same) > 0.99999
    assert _same_vectors(export_from_path(earlier, tmp_path / "from-earlier"), out) < 0.99999


def test_export_from_a_lora_checkpoint_of_the_trained_weights_or_of_the_whole_model(tiny_model_dir, tmp_path,
                                                                                     monkeypatch):
    """A LoRA checkpoint holds the trained weights only; the base is rebuilt from the run's config. One of the
    whole model (as checkpoints were written before) exports the same weights; a run config that no longer
    matches the checkpoint is refused, saying so."""
    from safetensors.torch import load_file

    from adapt.training import loop as train
    from adapt.pipeline.convert import convert
    from tests.tiny import CORPUS

    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS * 4)

    def run(out):
        convert(str(tiny_model_dir), out, preset="tiny", data=[str(corpus)], tuning="lora", show_progress=False,
                overrides=["tuning.lora_r=4"])
        return out / "run/checkpoints/step-000004"

    last = run(tmp_path / "run")
    assert not any(k.endswith("q_proj.base_layer.weight") for k in load_file(str(last / "model.safetensors")))
    exported = export_from_path(last, tmp_path / "from-last")
    assert _same_vectors(exported, tmp_path / "run") > 0.99999
    monkeypatch.setattr(train, "keeps_trained_only", lambda model: False)
    whole = run(tmp_path / "whole")
    assert any(k.endswith("q_proj.base_layer.weight") for k in load_file(str(whole / "model.safetensors")))
    a, b = (load_file(str(export_from_path(ckpt, tmp_path / name) / "model.safetensors"))
            for ckpt, name in ((last, "a"), (whole, "b")))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    config = tmp_path / "run/run/config.yaml"
    text = config.read_text()
    for changed, match in (("method: full", "do not match the model its run config describes"),
                           ("lora_r: 2", "has shape .* in the checkpoint"), ("target_modules: [q_proj]", "has no place in the model")):
        key = changed.split(":")[0]
        config.write_text("\n".join(f"  {changed}" if line.strip().startswith(key + ":") else line
                                    for line in text.splitlines()))
        with pytest.raises(ModelLoadError, match=match):
            export_from_path(last, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_export_from_a_contrastive_stage_checkpoint(tiny_model_dir, tmp_path):
    from adapt.pipeline.chain import run_stages
    from tests.tiny import CORPUS

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join([CORPUS] * 4 + [f"sentence number {i} says something new here." for i in range(40)]))
    out = tmp_path / "chain"
    run_stages(str(tiny_model_dir), out, preset="tiny-stages", data=[str(corpus)], stages="mlm,simcse",
               show_progress=False)
    ckpt = out / "stages/2-simcse/run/checkpoints/step-000004"
    exported = export_from_path(ckpt, tmp_path / "from-simcse")
    assert _same_vectors(exported, out) > 0.99999


def test_export_from_a_checkpoint_refuses_what_it_cannot_rebuild(tiny_model_dir, tmp_path):
    from adapt.pipeline.convert import convert
    from tests.tiny import CORPUS

    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS * 4)
    out = tmp_path / "run"
    convert(str(tiny_model_dir), out, preset="tiny", data=[str(corpus)], show_progress=False)
    ckpt = out / "run/checkpoints/step-000004"
    (ckpt / "model.safetensors").rename(ckpt / "elsewhere.safetensors")
    with pytest.raises(ModelLoadError, match="has no model.safetensors"):
        export_from_path(ckpt, tmp_path / "x")
    (ckpt / "elsewhere.safetensors").rename(ckpt / "model.safetensors")
    (out / "run/config.yaml").write_text((out / "run/config.yaml").read_text().replace("method: full", "method: lora"))
    with pytest.raises(ModelLoadError, match="do not match the model its run config describes"):
        export_from_path(ckpt, tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_export_from_path_refuses_bad_sources(tokenizer, tmp_path, tiny_model_dir):
    with pytest.raises(NotBidirectionalError, match="causal"):
        export_from_path(tiny_model_dir, tmp_path / "enc")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        export_from_path(tmp_path / "empty", tmp_path / "enc")
    with pytest.raises(ModelLoadError):
        export_from_path(tmp_path / "missing", tmp_path / "enc")


def _saved(tokenizer, path):
    tokenizer.save_pretrained(path)
    return path


def test_model_card_holds_no_absolute_path(tmp_path):
    from adapt.export.dense import render_card

    manifest = {"source": "/home/someone/models/my-decoder", "pooling": "mean", "normalize": False,
                "max_seq_length": 64, "dtype": "float32", "attn_implementation": "sdpa",
                "card": {"loss_plot": "/home/someone/out/run/loss.png", "steps": 3,
                         "recipe": {"model": {"source": "/home/someone/models/my-decoder"},
                                    "data": {"sources": ["/data/corpus/news.txt", "gensim:lee.cor"]}}}}
    card = render_card("enc", manifest)
    assert "/home/someone" not in card and "/data/corpus" not in card
    assert ".../models/my-decoder" in card and ".../corpus/news.txt" in card and "gensim:lee.cor" in card
    assert "base_model" not in card  # a local folder is no hub id
    assert "base_model: org/decoder" in render_card("enc", {**manifest, "source": "org/decoder"})
