"""The sink prompt (``export.sink_prompt``): a text before every text, left out of pooling, the same in training,
in the export sentence-transformers loads, in adapt's encoder and in the benchmark's raw-decoder baselines."""
import json

import numpy as np
import pytest
import torch

from adapt.bench.models import ModelSpec, default_loader
from adapt.config.settings import RunConfig
from adapt.model.embedding import Embedder, tokenize
from adapt.inference.encoder import load_encoder
from adapt.errors import ConfigError
from adapt.model.pooling import DEFAULT_SINK, check_sink, pool, prompt_token_count, sink_prompts
from adapt.pipeline.reexport import export_from_path
from adapt.pipeline.stage import run_stage
from tests.objectives.test_contrastive import _cfg, _documents, toy_pairs
from tests.tiny import tiny_decoder

TEXTS = ["The quick brown fox jumps over the lazy dog.", "An encoder reads the whole sentence at once.", "fox"]


def test_pool_leaves_out_each_rows_own_prompt_length():
    torch.manual_seed(0)
    hidden, mask = torch.randn(3, 6, 4), torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0]])
    skips = torch.tensor([1, 3, 0])
    for pooling in ("mean", "weightedmean", "last", "cls"):
        rows = pool(hidden, mask, pooling, skips)
        for i, skip in enumerate(skips.tolist()):
            assert torch.allclose(rows[i], pool(hidden[i:i + 1], mask[i:i + 1], pooling, skip)[0]), (pooling, i)
    # mean over the kept tokens only: row 1 keeps positions 3 (its 4th token) alone
    assert torch.allclose(pool(hidden, mask, "mean", skips)[1], hidden[1, 3])


def test_sink_prompts_and_their_checks(tokenizer):
    assert sink_prompts({"query": "q: "}, "") == ({"query": "q: "}, None, True)
    assert sink_prompts({"query": "q: "}, "\n") == ({"query": "\nq: ", "document": "\n", "default": "\n"}, "default",
                                                    False)
    with pytest.raises(ConfigError, match="named 'default'"):
        sink_prompts({"default": "x"}, "\n")
    assert prompt_token_count(tokenizer, "\n") == len(tokenizer("\n")["input_ids"]) >= 1
    check_sink(tokenizer, "\n")
    with pytest.raises(ConfigError, match="tokenizes to no token"):  # a special token alone is not counted
        check_sink(tokenizer, tokenizer.eos_token)


def test_a_prompt_that_would_take_the_texts_first_token_is_named(tokenizer, caplog):
    """"query: " alone ends with a lone space token; before a word the space joins the word's token, so the
    prompt's count (as sentence-transformers makes it) would leave the word out of pooling too."""
    caplog.set_level("WARNING", logger="adapt.model.pooling")
    check_sink(tokenizer, "\n", prompts={"query": "query:", "document": ""})
    assert not caplog.records
    check_sink(tokenizer, "\n", prompts={"query": "query: "})
    assert len(caplog.records) == 1 and "'query'" in caplog.text and "'query:'" in caplog.text
    caplog.clear()
    check_sink(tokenizer, "", prompts={"query": "query: "})  # no sink: prompts are pooled, nothing to warn of
    assert not caplog.records


def _sink_run(model_dir, tmp_path, **extra):
    corpus = tmp_path / "docs.txt"
    corpus.write_text(_documents(), encoding="utf-8")
    cfg = _cfg(model_dir, data={"sources": [str(corpus)]}, contrastive={"loss": "crops", "dropout": 0.0, "max_length": 24},
               export={"pooling": "mean", "max_seq_length": 64, "sink_prompt": DEFAULT_SINK},
               train={"max_steps": 2, "eval_every": 2, "save_every": 2}, **extra)
    cfg = RunConfig.from_dict({**cfg.to_dict(), "kind": "crops"})
    out = tmp_path / "out"
    return cfg, out, run_stage(cfg, out, show_progress=False)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_crops_stage_with_a_sink_exports_what_it_trained(tokenizer, tmp_path, family):
    from sentence_transformers import SentenceTransformer

    model_dir = tmp_path / "model"
    tiny_decoder(family, vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cfg, out, _ = _sink_run(model_dir, tmp_path, tuning={"method": "lora", "lora_r": 4, "lora_alpha": 8})
    st = SentenceTransformer(str(out), device="cpu")
    assert st.prompts == {"default": "\n", "query": "\n", "document": "\n"} and st.default_prompt_name == "default"
    assert st[1].include_prompt is False
    manifest = json.loads((out / "adapt_export.json").read_text())
    assert manifest["sink_prompt"] == "\n" and manifest["prompts"] == {}
    assert "sink prompt" in (out / "README.md").read_text()
    expected = st.encode(TEXTS, convert_to_numpy=True)
    if hasattr(st, "encode_query"):  # sentence-transformers 5: by prompt name, the sink still in front
        np.testing.assert_allclose(st.encode_query(TEXTS), expected, atol=1e-5)
        np.testing.assert_allclose(st.encode_document(TEXTS), expected, atol=1e-5)
    # training pools as the export: the sink in front, left out of the mean
    from transformers import AutoModel

    trained = Embedder(AutoModel.from_pretrained(str(out)).eval(), "mean")
    batch = tokenize(tokenizer, ["\n" + t for t in TEXTS], 64)
    with torch.no_grad():
        ours = trained(**batch, prompt_length=torch.ones(len(TEXTS), dtype=torch.long)).numpy()
        unsunk = trained(**tokenize(tokenizer, TEXTS, 64)).numpy()
    np.testing.assert_allclose(ours, expected, atol=1e-4)
    assert np.abs(unsunk - expected).max() > 1e-3  # the sink changes the vectors: the check above is not vacuous
    np.testing.assert_allclose(load_encoder(out).encode(TEXTS), expected, atol=1e-4)
    # an empty text is the sink alone, left out of pooling: a zero vector in both, and the warning says so
    with pytest.warns(UserWarning, match="zero vector"):
        empty = load_encoder(out).encode([""])
    assert np.abs(empty).max() == 0 and np.abs(st.encode([""])).max() == 0
    # re-exports (the folder, the LoRA checkpoint) keep the sink
    for again in (export_from_path(out, tmp_path / "again"),
                  export_from_path(sorted((out / "run/checkpoints").iterdir())[-1], tmp_path / "from-ckpt")):
        st2 = SentenceTransformer(str(again), device="cpu")
        assert st2.default_prompt_name == "default" and st2[1].include_prompt is False
        np.testing.assert_allclose(st2.encode(TEXTS), expected, atol=1e-4)


def test_pairs_with_a_sink_leave_sink_and_prompt_out_of_pooling(tiny_model_dir, tmp_path, tokenizer):
    from adapt.objectives.contrastive import Contrastive

    pairs = tmp_path / "p.jsonl"
    pairs.write_text("".join(json.dumps({"query": x.query, "positive": x.positive}) + "\n" for x in toy_pairs()))
    cfg = _cfg(tiny_model_dir, contrastive={"loss": "pairs", "pairs": str(pairs), "query_prompt": "query: "},
               export={"sink_prompt": "\n"})
    objective = Contrastive(cfg)
    objective.tokenizer = tokenizer
    texts, skips = objective.sunk(["query: where", "the fox"], 1)
    assert texts == ["\nquery: where", "\nthe fox"]
    assert skips == [len(tokenizer("\nquery: ")["input_ids"]), len(tokenizer("\n")["input_ids"])]
    assert skips[0] > skips[1] >= 1
    chunks, inverse = objective.chunks(texts, "cpu", skips)
    assert sorted(chunks[0]["prompt_length"].tolist()) == sorted(skips)
    cfg = _cfg(tiny_model_dir, contrastive={"loss": "pairs", "pairs": str(pairs)})
    plain = Contrastive(cfg)
    plain.tokenizer = tokenizer
    assert plain.sunk(["a", "b"], 1) == (["a", "b"], None)


def test_a_sparse_stage_refuses_a_sink(tiny_model_dir, tmp_path):
    corpus = tmp_path / "docs.txt"
    corpus.write_text(_documents(), encoding="utf-8")
    raw = _cfg(tiny_model_dir, data={"sources": [str(corpus)]}, export={"sink_prompt": "\n"}).to_dict()
    cfg = RunConfig.from_dict({**raw, "kind": "splade", "contrastive": {"loss": "crops"}})
    with pytest.raises(ConfigError, match="export.sink_prompt does not apply to a SPLADE stage"):
        run_stage(cfg, tmp_path / "o", show_progress=False)
    assert not (tmp_path / "o").exists()


def test_a_raw_decoder_with_a_sink_pools_the_text_after_it(tiny_model_dir, tokenizer):
    from transformers import AutoModel

    encoder = load_encoder(str(tiny_model_dir), bidirectional=False, sink_prompt="\n")
    model = AutoModel.from_pretrained(str(tiny_model_dir)).eval()
    with torch.no_grad():
        expected = []
        for text in TEXTS:
            ids = tokenizer("\n" + text, return_tensors="pt")["input_ids"]
            expected.append(model(input_ids=ids).last_hidden_state[0, 1:].mean(0).numpy())
    np.testing.assert_allclose(encoder.encode(TEXTS), np.stack(expected), atol=1e-4)
    plain = load_encoder(str(tiny_model_dir), bidirectional=False)
    assert plain.fingerprint != encoder.fingerprint  # the embedding cache tells them apart
    assert np.abs(plain.encode(TEXTS) - np.stack(expected)).max() > 1e-3
    spec = ModelSpec.parse(f"{tiny_model_dir}@sink=true,bidirectional=false")
    assert spec.sink and "sink=true" in spec.canonical()
    np.testing.assert_allclose(default_loader(spec, None, "cpu").encode(TEXTS), expected, atol=1e-4)
    with pytest.raises(ConfigError, match="sink must be true or false"):
        ModelSpec.parse(f"{tiny_model_dir}@sink=maybe")


def test_an_exported_encoder_refuses_a_second_sink(tmp_path, tokenizer):
    from adapt.export.dense import export_encoder

    model = tiny_decoder("llama", vocab_size=len(tokenizer))
    from adapt.model.bidirectional import make_bidirectional, prepare_config

    prepare_config(model.config)
    make_bidirectional(model)
    out = export_encoder(model, tokenizer, tmp_path / "enc", sink_prompt="\n")
    with pytest.raises(ConfigError, match="raw decoder only"):
        load_encoder(out, sink_prompt="\n")
