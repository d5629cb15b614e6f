"""Dimensions in principal order (``export.order_dims: pca``, adapt.export.dim_order): the axes, a stage that ships them
as a Dense layer every loader applies, full-size similarities unchanged, prefixes that keep more, re-exports,
every tiny family, and the errors."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from adapt.cli import main
from adapt.config.settings import RunConfig
from adapt.export.dim_order import fit_order, fitting_texts, principal_axes, stage_texts
from adapt.errors import ConfigError, ModelLoadError
from tests.objectives.test_contrastive import toy_pairs, toy_sentences
from tests.tiny import TINY_CONFIGS, tiny_decoder

TEXTS = ["The quick fox meets the river.", "An engine near town.", "A violin in the hall.", "Planets and stars.",
         "The market opens at dawn.", "A river bank in spring."]


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_the_axes_are_orthogonal_ordered_and_repeatable():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 12)) * np.array([0.2, 3, 0.5, 1, 0.1, 2, 0.3, 0.05, 1.5, 0.7, 0.4, 0.9]) + 0.5
    q = principal_axes(x)
    np.testing.assert_allclose(q @ q.T, np.eye(12), atol=1e-10)
    energy = ((_unit(x) @ q.T) ** 2).mean(axis=0)
    assert np.all(np.diff(energy) <= 1e-12)  # largest first
    # the first 3 axes hold more of the vectors than any 3 of the original coordinates
    best_original = np.sort((_unit(x) ** 2).mean(axis=0))[::-1][:3].sum()
    assert energy[:3].sum() > best_original + 0.05
    np.testing.assert_array_equal(principal_axes(x), q)
    assert np.all(q[np.arange(12), np.abs(q).argmax(axis=1)] > 0)  # signs fixed
    np.testing.assert_allclose(principal_axes(x * 7.0), q, atol=1e-8)  # lengths do not matter: unit vectors
    with pytest.raises(ConfigError, match="at least 2 vectors"):
        principal_axes(x[:1])


def _cfg(model_dir, corpus, order="pca", **extra):
    return RunConfig.from_dict({
        "kind": "simcse", "model": {"source": str(model_dir)}, "data": {"sources": [str(corpus)], "eval_fraction": 0.2},
        "train": {"max_steps": 2, "batch_size": 4, "lr": 1e-3, "warmup_ratio": 0.0, "eval_every": 0,
                  "eval_batches": 2, "save_every": 2, "log_every": 1, "seed": 3},
        "export": {"pooling": "mean", "max_seq_length": 64, "order_dims": order}, **extra})


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("\n\n".join(toy_sentences(40)) + "\n", encoding="utf-8")  # a paragraph each
    return path


def test_a_stage_ships_the_rotation_and_every_loader_applies_it(tiny_model_dir, corpus, tmp_path):
    from sentence_transformers import SentenceTransformer

    from adapt.inference.encoder import load_encoder
    from adapt.pipeline.reexport import export_from_path
    from adapt.pipeline.stage import run_stage

    out = tmp_path / "out"
    run_stage(_cfg(tiny_model_dir, corpus), out, show_progress=False)
    modules = json.loads((out / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling", "Dense"]
    manifest = json.loads((out / "adapt_export.json").read_text())
    assert manifest["order_dims"]["method"] == "pca" and manifest["order_dims"]["texts"] >= 40
    assert "in principal order" in (out / "README.md").read_text()

    st = SentenceTransformer(str(out), device="cpu")  # plain sentence-transformers, no custom code
    rotated = st.encode(TEXTS)
    ours = load_encoder(out)
    np.testing.assert_allclose(ours.encode(TEXTS), rotated, atol=1e-5)  # adapt's fast encoder applies it too
    pooled = replace(ours, projections=[]).encode(TEXTS)  # the same backbone without the rotation
    assert not np.allclose(pooled, rotated, atol=1e-3)
    np.testing.assert_allclose(_unit(rotated) @ _unit(rotated).T, _unit(pooled) @ _unit(pooled).T, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=1), np.linalg.norm(pooled, axis=1), rtol=1e-5)

    # on the training text, a prefix of the ordered vector keeps more than the same prefix of the pooled one
    fit = stage_texts(_cfg(tiny_model_dir, corpus))
    a, b = _unit(ours.encode(fit)), _unit(replace(ours, projections=[]).encode(fit))
    assert (a[:, :8] ** 2).sum(axis=1).mean() > (b[:, :8] ** 2).sum(axis=1).mean() + 0.05

    # re-exports keep it: from the folder (the same weights) and from a checkpoint (fitted again, the same axes)
    weight = torch.tensor(st[2].linear.weight.detach().numpy())
    again = export_from_path(out, tmp_path / "again")
    np.testing.assert_allclose(SentenceTransformer(str(again), device="cpu").encode(TEXTS), rotated, atol=1e-5)
    # the Dense weights are part of the fingerprint the embedding cache keys on
    from safetensors.torch import save_file

    before = load_encoder(again).fingerprint
    dense = next(again.glob("*_Dense"))
    save_file({"linear.weight": -weight}, str(dense / "model.safetensors"))
    flipped = load_encoder(again)
    assert flipped.fingerprint != before
    np.testing.assert_allclose(flipped.encode(TEXTS), -rotated, atol=1e-5)
    from_ckpt = export_from_path(out / "run/checkpoints", tmp_path / "from-ckpt")
    st_ckpt = SentenceTransformer(str(from_ckpt), device="cpu")
    torch.testing.assert_close(st_ckpt[2].linear.weight.detach(), weight, atol=1e-4, rtol=0)
    other = export_from_path(out, tmp_path / "last", pooling="lasttoken")  # fitted to mean pooling: dropped
    assert [m["type"].rsplit(".", 1)[-1] for m in json.loads((other / "modules.json").read_text())] == [
        "Transformer", "Pooling"]
    assert json.loads((other / "adapt_export.json").read_text())["order_dims"] is None
    refit = export_from_path(out / "run/checkpoints", tmp_path / "ckpt-last", pooling="lasttoken")  # the run's text
    assert json.loads((refit / "adapt_export.json").read_text())["order_dims"]["method"] == "pca"
    plain = export_from_path(out, tmp_path / "plain", order_dims="none")
    np.testing.assert_allclose(SentenceTransformer(str(plain), device="cpu").encode(TEXTS), pooled, atol=1e-5)


def test_matryoshka_sizes_and_the_order_go_together_with_normalize_last(tiny_model_dir, corpus, tmp_path):
    from sentence_transformers import SentenceTransformer

    from adapt.inference.encoder import load_encoder
    from adapt.pipeline.stage import run_stage

    cfg = _cfg(tiny_model_dir, corpus, contrastive={"matryoshka_dims": ["full", 16, 8]})
    cfg = replace(cfg, export=replace(cfg.export, normalize=True))
    out = tmp_path / "out"
    run_stage(cfg, out, show_progress=False)
    kinds = [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())]
    assert kinds == ["Transformer", "Pooling", "Dense", "Normalize"]
    cut = SentenceTransformer(str(out), device="cpu", truncate_dim=8).encode(TEXTS)
    ours = load_encoder(out, truncate_dim=8)
    assert ours.dim == 8
    np.testing.assert_allclose(ours.encode(TEXTS), _unit(cut), atol=1e-5)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_every_family_fits_an_orthogonal_order(family, corpus, tokenizer):
    texts = stage_texts(_cfg("unused", corpus))
    model = tiny_decoder(family, vocab_size=len(tokenizer))
    rotation, record = fit_order(model, tokenizer, texts, pooling="mean", max_length=64)
    hidden = int(model.config.get_text_config().hidden_size)
    assert rotation.shape == (hidden, hidden) and record["texts"] >= 40
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(hidden), atol=1e-4, rtol=0)
    assert 0.25 < record["quarter_share"] <= 1.0  # at least its fair share: the largest axes come first
    for training in (False, True):  # the caller's mode is restored
        model.train(training)
        fit_order(model, tokenizer, texts[:8], pooling="lasttoken", max_length=16)
        assert model.training is training


def test_with_a_sink_the_order_is_fitted_on_the_vectors_as_exported(corpus, tokenizer):
    from adapt.inference.encoder import Encoder

    texts = stage_texts(_cfg("unused", corpus))
    model = tiny_decoder("qwen2", vocab_size=len(tokenizer)).eval()
    rotation, _ = fit_order(model, tokenizer, texts, pooling="mean", max_length=64, sink_prompt="\n")
    from adapt.export.dense import backbone_of

    encoder = Encoder(backbone_of(model), tokenizer, name="x", pooling="mean", normalize=False, max_length=64,
                      include_prompt=False)
    sunk = principal_axes(encoder.encode(texts, prompt="\n"))  # "\n" before each text, left out of the mean
    plain = principal_axes(encoder.encode(texts))
    assert np.abs(np.abs(rotation[:4].numpy() * sunk[:4]).sum(1) - 1).max() < 1e-3  # the same leading axes
    assert np.abs(np.abs(rotation[:4].numpy() * plain[:4]).sum(1) - 1).max() > 1e-2  # not the sinkless ones


def test_fitting_texts_come_from_documents_or_pairs_and_are_capped(corpus, tmp_path):
    texts = stage_texts(_cfg("m", corpus))
    assert texts[:3] == toy_sentences(40)[:3]  # short documents: one span each
    long = tmp_path / "long.txt"
    long.write_text(" ".join(f"w{i}" for i in range(100)) + "\n", encoding="utf-8")
    spans = fitting_texts([str(long)])
    assert [len(s.split()) for s in spans] == [32, 32, 32, 4]
    capped = fitting_texts([str(corpus)], limit=10, seed=1)
    assert len(capped) == 10 and capped == fitting_texts([str(corpus)], limit=10, seed=1)  # seeded
    assert capped != fitting_texts([str(corpus)], limit=10, seed=2)
    pairs = tmp_path / "p.jsonl"
    pairs.write_text("".join(json.dumps({"query": p.query, "positive": p.positive}) + "\n" for p in toy_pairs(5)))
    cfg = RunConfig.from_dict({"kind": "contrastive", "contrastive": {"pairs": str(pairs)},
                               "export": {"order_dims": "pca"}})
    got = stage_texts(cfg)
    assert got[:2] == [toy_pairs(5)[0].query, toy_pairs(5)[0].positive] and len(got) == 10
    with pytest.raises(ConfigError, match=r"no text to fit on: give the stage data.sources \(--data\) or contrastive.pairs \(--pairs\), or set "
                                          r"export.order_dims: none"):
        stage_texts(RunConfig.from_dict({"kind": "simcse", "export": {"order_dims": "pca"}}))


@pytest.mark.parametrize("export, match", [
    ({"order_dims": "svd"}, r"export.order_dims must be none or pca, not 'svd'"),
    ({"order_texts": 1}, r"export.order_texts must be a whole number of texts, 2 or more"),
])
def test_bad_settings_are_errors_naming_the_key(export, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_dict({"kind": "simcse", "export": export})


def test_a_rotation_that_is_not_orthogonal_or_not_the_models_size_is_refused(tiny_model_dir, tmp_path, tokenizer):
    from adapt.export.dense import export_encoder
    from adapt.model.bidirectional import make_bidirectional

    model = make_bidirectional(tiny_decoder("llama", vocab_size=len(tokenizer)))
    with pytest.raises(ConfigError, match="not orthogonal"):
        export_encoder(model, tokenizer, tmp_path / "a", rotation=torch.eye(32) * 2)
    with pytest.raises(ConfigError, match=r"is \(16, 16\), not \(32, 32\)"):
        export_encoder(model, tokenizer, tmp_path / "b", rotation=torch.eye(16))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_dense_layer_with_an_activation_is_named_when_adapt_cannot_run_it(tiny_model_dir, tmp_path, tokenizer):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense

    from adapt.inference.encoder import load_encoder
    from adapt.export.dense import export_encoder
    from adapt.model.bidirectional import make_bidirectional

    out = export_encoder(make_bidirectional(tiny_decoder("llama", vocab_size=len(tokenizer))), tokenizer,
                         tmp_path / "enc", max_seq_length=64)
    st = SentenceTransformer(str(out), device="cpu")
    st.append(Dense(32, 8, activation_function=torch.nn.Tanh()))
    st.save(str(tmp_path / "tanh"))
    with pytest.raises(ModelLoadError, match=r"module Dense \(with an activation, or after Normalize\).*load it with "
                                             r"SentenceTransformer"):
        load_encoder(tmp_path / "tanh")


def test_cli_convert_with_the_order_then_embed_at_a_size(corpus, tokenizer, tmp_path):
    model_dir = tmp_path / "tiny-qwen2"
    tiny_decoder("qwen2", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "enc"
    result = CliRunner().invoke(main, ["convert", str(model_dir), "-o", str(out), "--preset", "tiny", "--data",
                                       str(corpus), "--stages", "simcse", "--quiet", "--set", "train.max_steps=1",
                                       "--set", "train.eval_every=0", "--set", "export.order_dims=pca"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "adapt_export.json").read_text())["order_dims"]["method"] == "pca"
    embedded = CliRunner().invoke(main, ["embed", str(out), "a fox", "a river", "--dim", "8", "--quiet"])
    assert embedded.exit_code == 0, embedded.output
    rows = [json.loads(line) for line in embedded.output.splitlines() if line.startswith("{")]
    assert [len(r["embedding"]) for r in rows] == [8, 8]


def test_cli_export_orders_an_encoder_on_given_text_and_refuses_without_it(tiny_model_dir, corpus, tmp_path):
    from sentence_transformers import SentenceTransformer

    from adapt.pipeline.stage import run_stage

    out = tmp_path / "out"
    run_stage(_cfg(tiny_model_dir, corpus, order="none"), out, show_progress=False)
    pooled = SentenceTransformer(str(out), device="cpu").encode(TEXTS)
    no_data = CliRunner().invoke(main, ["export", str(out), "-o", str(tmp_path / "x"), "--order-dims", "pca"])
    assert no_data.exit_code == 2 and "pass --data PATH" in no_data.output and "Traceback" not in no_data.output
    assert not (tmp_path / "x").exists()
    lone = CliRunner().invoke(main, ["export", str(out), "-o", str(tmp_path / "x"), "--data", str(corpus)])
    assert lone.exit_code == 2 and "add --order-dims pca" in lone.output
    sparse = CliRunner().invoke(main, ["export", str(out), "-o", str(tmp_path / "x"), "--order-dims", "pca",
                                       "--top-k", "8"])
    assert sparse.exit_code == 2 and "a sparse vector's are vocabulary terms" in sparse.output
    done = CliRunner().invoke(main, ["export", str(out), "-o", str(tmp_path / "ordered"), "--order-dims", "pca",
                                     "--data", str(corpus)])
    assert done.exit_code == 0, done.output
    manifest = json.loads((tmp_path / "ordered/adapt_export.json").read_text())
    assert manifest["order_dims"]["texts"] == 40
    rotated = SentenceTransformer(str(tmp_path / "ordered"), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(_unit(rotated) @ _unit(rotated).T, _unit(pooled) @ _unit(pooled).T, atol=1e-5)
    assert not np.allclose(rotated, pooled, atol=1e-3)
    # a checkpoint needs no --data: it fits on its run's own training text
    from_ckpt = CliRunner().invoke(main, ["export", str(out / "run/checkpoints"), "-o", str(tmp_path / "ckpt"),
                                          "--order-dims", "pca"])
    assert from_ckpt.exit_code == 0, from_ckpt.output
    assert json.loads((tmp_path / "ckpt/adapt_export.json").read_text())["order_dims"]["texts"] == 40


def test_a_bf16_export_carries_the_rotation_in_the_backbones_dtype(tmp_path, tokenizer):
    from sentence_transformers import SentenceTransformer

    from adapt.model.bidirectional import make_bidirectional
    from adapt.inference.encoder import load_encoder
    from adapt.export.dense import export_encoder

    model = make_bidirectional(tiny_decoder("llama", vocab_size=len(tokenizer)))
    rotation = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(0)))[0]
    out = export_encoder(model, tokenizer, tmp_path / "bf16", dtype="bfloat16", rotation=rotation, max_seq_length=64)
    st = SentenceTransformer(str(out), device="cpu")
    assert st[0].auto_model.dtype == torch.bfloat16 and st[2].linear.weight.dtype == torch.bfloat16
    theirs = st.encode(TEXTS)  # no dtype clash between the bf16 pooled vector and the Dense layer
    ours = load_encoder(out, dtype="bfloat16").encode(TEXTS)
    assert (np.sum(_unit(theirs) * _unit(ours), axis=1) > 0.99).all()
