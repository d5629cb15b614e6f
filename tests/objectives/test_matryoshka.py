"""Matryoshka embeddings: the loss over re-normalized prefixes (against a hand computation, with gradient
caching), its checks, every tiny family, a stage that records its sizes in the export, truncated vectors
in sentence-transformers, `adapt embed --dim`, `adapt export` and `adapt bench --dims`."""
import json
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from adapt.bench import ClassificationTask, RetrievalTask, SimilarityTask, run_bench
from adapt.bench.dims import pairs_at, parse_dims, truncate
from adapt.cli import main
from adapt.config.settings import RunConfig, apply_overrides
from adapt.model.embedding import Embedder, tokenize
from adapt.errors import ConfigError
from adapt.objectives.contrastive import Contrastive
from adapt.objectives.infonce import contrastive_backward, matryoshka_info_nce, matryoshka_sizes
from tests.bench.test_bench_fakes import HashEncoder
from tests.objectives.test_contrastive import TOPICS, toy_pairs, toy_sentences
from tests.tiny import TINY_CONFIGS, tiny_config, tiny_decoder

SIZES = ["full", 16, 8]  # tiny decoders have 32 hidden dimensions


# ---- the loss -------------------------------------------------------------------------------------

def _by_hand(q, d, targets, n, temperature):
    a, b = q[:, :n] / q[:, :n].norm(dim=1, keepdim=True), d[:, :n] / d[:, :n].norm(dim=1, keepdim=True)
    return -(a @ b.T / temperature).log_softmax(dim=1)[torch.arange(len(targets)), targets].mean()


def test_the_loss_is_the_weighted_sum_over_renormalized_prefixes():
    g = torch.Generator().manual_seed(0)
    q, d = torch.randn(4, 12, generator=g), torch.randn(7, 12, generator=g)
    targets = torch.tensor([0, 2, 1, 3])
    loss, per_size = matryoshka_info_nce(q, d, targets, 0.1, None, [(12, 1.0), (6, 0.5), (3, 2.0)])
    parts = {n: _by_hand(q, d, targets, n, 0.1) for n in (12, 6, 3)}
    torch.testing.assert_close(loss, parts[12] + 0.5 * parts[6] + 2.0 * parts[3])
    assert set(per_size) == {12, 6, 3}
    for n, (part, correct) in per_size.items():
        torch.testing.assert_close(part, parts[n])
        logits = F.normalize(q[:, :n], dim=1) @ F.normalize(d[:, :n], dim=1).T
        assert int(correct) == int((logits.argmax(1) == targets).sum())
    assert len({round(float(p), 5) for p in parts.values()}) == 3  # a prefix is a task of its own


def test_sizes_resolve_full_and_sort_with_their_weights():
    config = tiny_config("gpt2")  # n_embd: the hidden size under another name
    assert matryoshka_sizes([8, "full", 16], [0.25, 1, 0.5], config) == [(32, 1.0), (16, 0.5), (8, 0.25)]
    assert matryoshka_sizes([16, 8], [], config) == [(16, 1.0), (8, 1.0)]
    assert matryoshka_sizes([], [], config) == []
    with pytest.raises(ConfigError, match=r"contrastive.matryoshka_dims: 64 is larger than the gpt2 model's hidden "
                                          r"size 32"):
        matryoshka_sizes(["full", 64], [], config)
    with pytest.raises(ConfigError, match=r"lists 32 twice \('full' is the llama model's hidden size\)"):
        matryoshka_sizes(["full", 32], [], tiny_config("llama"))


@pytest.mark.parametrize("contrastive, match", [
    ({"matryoshka_dims": [0]}, r"contrastive.matryoshka_dims: 0 is neither a positive number .* nor 'full'"),
    ({"matryoshka_dims": ["half"]}, r"contrastive.matryoshka_dims: 'half' is neither"),
    ({"matryoshka_dims": [True]}, r"contrastive.matryoshka_dims: True is neither"),
    ({"matryoshka_dims": [64, 64]}, r"contrastive.matryoshka_dims lists a size twice"),
    ({"matryoshka_dims": "full"}, r"contrastive.matryoshka_dims takes a list"),
    ({"matryoshka_dims": ["full", 8], "matryoshka_weights": [1]}, r"one weight per size .* \(2\)"),
    ({"matryoshka_dims": ["full", 8], "matryoshka_weights": [1, -1]}, r"matryoshka_weights must be positive"),
])
def test_bad_sizes_are_errors_naming_the_key(contrastive, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig.from_dict({"kind": "simcse", "contrastive": contrastive})


def test_set_reads_a_list_of_sizes():
    raw = apply_overrides({}, ["contrastive.matryoshka_dims=[full, 16, 8]", "contrastive.matryoshka_weights=[1,1,2]"])
    c = RunConfig.from_dict({**raw, "kind": "simcse"}).contrastive
    assert c.matryoshka_dims == ["full", 16, 8] and c.matryoshka_weights == [1, 1, 2]
    assert RunConfig.from_dict({"kind": "simcse", "contrastive": {"matryoshka_dims": c.matryoshka_dims}}).to_dict()[
        "contrastive"]["matryoshka_dims"] == ["full", 16, 8]


def test_grad_cached_matryoshka_gradient_equals_the_full_batch_gradient(tokenizer):
    pairs = toy_pairs(6)
    texts = [p.query for p in pairs] + [p.positive for p in pairs] + [p.negatives[0] for p in pairs]
    sizes = [(32, 1.0), (16, 0.5), (8, 0.5)]

    def grads(chunk, cache, sizes=sizes):
        model = tiny_decoder("llama", vocab_size=len(tokenizer), seed=2)
        embed = Embedder(model, "mean").train()
        chunks = [tokenize(tokenizer, texts[i:i + chunk], 32) for i in range(0, len(texts), chunk)]
        loss, _ = contrastive_backward(embed, chunks, lambda e: matryoshka_info_nce(
            e[:6], e[6:], torch.arange(6), 0.05, None, sizes), cache=cache)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, float(loss)

    (full, full_loss), (cached, cached_loss) = grads(len(texts), False), grads(4, True)
    assert cached_loss == pytest.approx(full_loss, rel=1e-5)
    for name in full:
        torch.testing.assert_close(cached[name], full[name], rtol=1e-4, atol=1e-6, msg=name)
    alone, _ = grads(len(texts), False, sizes=[(32, 1.0)])
    assert any(not torch.allclose(full[n], alone[n]) for n in full)  # the prefixes add their own gradient


# ---- every family -----------------------------------------------------------------------------------

def _accelerator():
    """What an objective's step uses of Accelerate's Accelerator, for one CPU process."""
    import contextlib

    return SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0,
                           no_sync=lambda module: contextlib.nullcontext(), backward=lambda loss: loss.backward())


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_every_family_trains_its_sizes_with_gradient_caching(family, tokenizer):
    cfg = RunConfig.from_dict({"kind": "simcse", "contrastive": {"matryoshka_dims": [8, "full", 16], "mini_batch": 3},
                               "train": {"batch_size": 4}, "export": {"pooling": "mean"}})
    objective = Contrastive(cfg)
    model = tiny_decoder(family, vocab_size=len(tokenizer))
    objective.configure_model(model, tokenizer)
    assert objective.matryoshka_dims() == [32, 16, 8]
    objective.train_set, acc = toy_sentences(8), _accelerator()
    objective.start(0, acc)
    module = objective.module(model).train()
    out = objective.step(module, acc, 0)
    assert torch.isfinite(out.loss) and float(out.loss) > 0
    grads = [p.grad for n, p in model.named_parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(float(g.abs().max()) > 0 for g in grads)
    objective.counts, objective.eval_set = {}, []
    assert objective.summary()["matryoshka_dims"] == [32, 16, 8]


# ---- a stage, its export, and truncated vectors --------------------------------------------------

def _stage_cfg(model_dir, corpus, **contrastive):
    return RunConfig.from_dict({
        "kind": "simcse", "model": {"source": str(model_dir)}, "data": {"sources": [str(corpus)], "eval_fraction": 0.2},
        "train": {"max_steps": 2, "batch_size": 4, "lr": 1e-3, "warmup_ratio": 0.0, "eval_every": 0,
                  "eval_batches": 2, "save_every": 2, "log_every": 1},
        "export": {"pooling": "mean", "max_seq_length": 64},
        "contrastive": {"matryoshka_dims": SIZES, "mini_batch": 3, **contrastive}})


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("\n".join(toy_sentences(40)) + "\n", encoding="utf-8")
    return path


def test_a_stage_records_its_sizes_and_every_loader_truncates(tiny_model_dir, corpus, tmp_path):
    from sentence_transformers import SentenceTransformer

    from adapt.inference.embed import embed
    from adapt.inference.encoder import load_encoder
    from adapt.pipeline.reexport import export_from_path
    from adapt.pipeline.stage import run_stage

    out = tmp_path / "out"
    summary = run_stage(_stage_cfg(tiny_model_dir, corpus), out, show_progress=False).summary
    assert summary["matryoshka_dims"] == [32, 16, 8]
    assert {"eval/simcse_acc", "eval/simcse_loss@16", "eval/simcse_acc@16", "eval/simcse_loss@8"} <= set(
        summary["final_eval"])
    assert json.loads((out / "config_sentence_transformers.json").read_text())["matryoshka_dims"] == [32, 16, 8]
    assert json.loads((out / "adapt_export.json").read_text())["matryoshka_dims"] == [32, 16, 8]
    card = (out / "README.md").read_text()
    assert 'truncate_dim=16)' in card and "| Matryoshka sizes (`truncate_dim`) | 32, 16, 8 |" in card

    texts = ["The quick fox meets the river.", "An engine near town.", "A violin."]
    st_full = SentenceTransformer(str(out), device="cpu")
    assert st_full.get_embedding_dimension() == 32  # the recorded sizes do not truncate a plain load
    st = SentenceTransformer(str(out), device="cpu", truncate_dim=16)
    assert st.get_embedding_dimension() == 16
    full, cut = st_full.encode(texts), st.encode(texts)
    np.testing.assert_allclose(cut, full[:, :16], atol=1e-6)
    ours = load_encoder(out, truncate_dim=16)
    assert ours.dim == 16 and ours.fingerprint != load_encoder(out).fingerprint
    np.testing.assert_allclose(ours.encode(texts), cut, atol=1e-5)

    vectors = tmp_path / "v.npy"
    embed(str(out), texts=texts, output_path=vectors, dim=8, show_progress=False)  # re-normalized
    got = np.load(vectors)
    assert got.shape == (3, 8)
    np.testing.assert_allclose(got, full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True), atol=1e-5)
    with pytest.warns(UserWarning, match=r"trained for truncation to 32, 16, 8 dimensions, not 12"):
        assert load_encoder(out, truncate_dim=12).dim == 12
    with pytest.raises(ConfigError, match=r"cannot truncate out's vectors to 64 dimensions: it has 32; choose 1 to "
                                          r"32 \(trained sizes: 32, 16, 8\)"):
        load_encoder(out, truncate_dim=64)

    # re-exports keep the sizes: from the folder, and from a checkpoint rebuilt from the run's config
    for source in (out, out / "run/checkpoints"):
        again = export_from_path(source, tmp_path / f"again-{source.name}")
        assert json.loads((again / "config_sentence_transformers.json").read_text())["matryoshka_dims"] == [32, 16, 8]


def test_cli_converts_embeds_and_benches_at_each_size(corpus, tokenizer, tmp_path):
    model_dir = tmp_path / "tiny-gpt2"  # GPT-2 names its hidden size n_embd
    tiny_decoder("gpt2", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "enc"
    args = ["convert", str(model_dir), "-o", str(out), "--preset", "tiny", "--data", str(corpus), "--stages",
            "simcse", "--quiet", "--set", "train.eval_every=0", "--set", "train.max_steps=2", "--set", "train.save_every=0"]
    bad = CliRunner().invoke(main, args + ["--set", "contrastive.matryoshka_dims=[full, 64]"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "contrastive.matryoshka_dims: 64 is larger than the gpt2 model's hidden size 32" in bad.output
    assert not out.exists() or not any(out.iterdir())  # refused before anything was written
    result = CliRunner().invoke(main, args + ["--set", "contrastive.matryoshka_dims=[full, 16, 8]"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config_sentence_transformers.json").read_text())["matryoshka_dims"] == [32, 16, 8]

    embedded = CliRunner().invoke(main, ["embed", str(out), "a fox", "a river", "--dim", "16", "--quiet"])
    assert embedded.exit_code == 0, embedded.output
    rows = [json.loads(line) for line in embedded.output.splitlines() if line.startswith("{")]
    assert [len(r["embedding"]) for r in rows] == [16, 16]
    assert all(abs(np.linalg.norm(r["embedding"]) - 1) < 1e-5 for r in rows)
    too_big = CliRunner().invoke(main, ["embed", str(out), "a fox", "--dim", "64", "--quiet"])
    assert too_big.exit_code == 2 and "it has 32; choose 1 to 32" in too_big.output

    task = tmp_path / "sim"
    task.mkdir()
    (task / "pairs.jsonl").write_text("".join(json.dumps({"text1": a, "text2": b, "score": s}) + "\n" for a, b, s in [
        ("a quick fox", "a fox", 4.5), ("a fox", "an engine", 1.0), ("a river", "the river bank", 4.0),
        ("a violin", "a planet", 0.5), ("the market", "a market town", 4.2)]))
    bench = CliRunner().invoke(main, ["bench", str(out), "--task", str(task), "--dims", "full,8", "-o",
                                      str(tmp_path / "bench"), "--quiet"])
    assert bench.exit_code == 0, bench.output
    assert "| enc@dim=full | enc@dim=8 |" in bench.output
    rows = json.loads((tmp_path / "bench/results.json").read_text())
    assert {r["model"] for r in rows} == {"enc@dim=full", "enc@dim=8"}
    assert "| sim @dim=8 | similarity | spearman | " in (out / "README.md").read_text()  # the card holds each size's score
    with_baselines = run_bench([str(out)], tasks=[str(task)], dims="full,8", baselines=True, references=False,
                               out_dir=tmp_path / "bench2", show_progress=False, update_cards=False)
    assert [line.split(" vs ")[0] for line in with_baselines.verdicts] == ["verdict: enc@dim=full", "verdict: enc@dim=8"]
    assert "tiny-gpt2 (causal, " in with_baselines.verdicts[1] and "@dim=8: average" in with_baselines.verdicts[1]
    bad_dims = CliRunner().invoke(main, ["bench", str(out), "--task", str(task), "--dims", "full,0"])
    assert bad_dims.exit_code == 2 and "--dims: '0' is not a number of dimensions" in bad_dims.output


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_every_family_converts_with_sizes_and_loads_truncated(family, corpus, tokenizer, tmp_path):
    """The whole path for each family: convert from the CLI, then sentence-transformers with truncate_dim."""
    from sentence_transformers import SentenceTransformer

    model_dir = tmp_path / family
    tiny_decoder(family, vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(model_dir), "-o", str(out), "--preset", "tiny", "--data",
                                       str(corpus), "--stages", "simcse", "--quiet", "--set", "train.max_steps=1",
                                       "--set", "train.eval_every=0", "--set", "contrastive.matryoshka_dims=[full,16,8]"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config_sentence_transformers.json").read_text())["matryoshka_dims"] == [32, 16, 8]
    vectors = SentenceTransformer(str(out), device="cpu", truncate_dim=8).encode(["a fox", "a river"])
    assert vectors.shape == (2, 8) and np.isfinite(vectors).all()


# ---- bench at several sizes -------------------------------------------------------------------------

def _tasks():
    docs = [f"the {t} is a {t} with a {TOPICS[(i + 3) % 16]} nearby" for i, t in enumerate(TOPICS)]
    retrieval = RetrievalTask(name="toy-retrieval", query_ids=[f"q{i}" for i in range(16)],
                              queries=[f"where is the {t}" for t in TOPICS], corpus_ids=[f"d{i}" for i in range(16)],
                              corpus=docs, qrels={f"q{i}": {f"d{i}": 1.0} for i in range(16)})
    classification = ClassificationTask(
        name="toy-classification", train_texts=[f"{t} {t} thing {i}" for i in range(4) for t in TOPICS[:8]],
        train_labels=[str(j % 2) for _ in range(4) for j in range(8)],
        test_texts=[f"a {t} again" for t in TOPICS[:8]], test_labels=[str(j % 2) for j in range(8)])
    similarity = SimilarityTask.from_pairs("toy-similarity", [(f"a {a}", f"the {a} and {b}") for a, b in
                                                              zip(TOPICS, TOPICS[5:] + TOPICS[:5])],
                                           [float(i % 5) for i in range(16)])
    return [retrieval, classification, similarity]


class Cut(HashEncoder):
    """HashEncoder's vectors turned dense (a fixed random rotation: no tied scores), cut to their first ``keep``
    dimensions (and L2-normalized if ``unit``)."""

    ROTATION = np.linalg.qr(np.random.default_rng(0).standard_normal((64, 64)))[0].astype(np.float32)

    def __init__(self, name, keep=None, unit=False):
        super().__init__(name, dim=64)
        self.keep, self.unit = keep, unit

    @property
    def fingerprint(self):
        return f"cut:{self.name}"

    def encode(self, texts, **kwargs):
        vectors = (super().encode(texts, **kwargs) @ self.ROTATION)[:, :self.keep]
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True) if self.unit else vectors


def _values(report, model):
    return {(r["task"], r["metric"]): r["value"] for r in report.rows if r["model"] == model and r["kind"] != "average"}


@pytest.mark.parametrize("unit", [False, True])
def test_bench_scores_each_size_from_one_encoding(tmp_path, unit):
    whole = Cut("a", unit=unit)
    report = run_bench([whole], tasks=_tasks(), dims="full,16", out_dir=tmp_path / "dims", use_cache=False,
                       show_progress=False, update_cards=False)
    plain = Cut("a", unit=unit)
    full = run_bench([plain], tasks=_tasks(), out_dir=tmp_path / "plain", use_cache=False, show_progress=False)
    assert whole.calls == plain.calls  # encoded once per text group, whatever the number of sizes
    assert [r["model"] for r in report.rows if r["kind"] == "average"] == ["a@dim=full", "a@dim=16"]
    assert "| task | metric | a@dim=full | a@dim=16 |" in report.markdown
    # a size's scores are those of an encoder giving the cut vectors (re-normalized when they came unit-length)
    cut = run_bench([Cut("a", keep=16, unit=unit)], tasks=_tasks(), out_dir=tmp_path / "cut", show_progress=False)
    assert _values(report, "a@dim=16") == pytest.approx(_values(cut, "a"))
    assert _values(report, "a@dim=full") == pytest.approx(_values(full, "a"))
    assert _values(report, "a@dim=16") != pytest.approx(_values(full, "a"))
    assert {r["reference"] for r in report.rows if r.get("reference")} == {"a@dim=full"}


def test_bench_sizes_a_model_lacks(tmp_path):
    with pytest.raises(ConfigError, match=r"a: --dims 128: the model has only 64 dimensions"):
        run_bench([Cut("a")], tasks=_tasks(), dims=[128], out_dir=tmp_path / "x", show_progress=False)
    # baselines of another size are skipped at that size, not an error; verdicts pair equal sizes
    small = {"src (causal, mean)": 16, "src (causal, last)": 16, "src (causal, mean, sink)": 16,
             "src (bidirectional, mean, untrained)": 16}
    report = run_bench([Cut("a")], tasks=_tasks(), dims=[64, 16], out_dir=tmp_path / "b", baselines=True,
                       references=False, source="src", show_progress=False, update_cards=False,
                       loader=lambda spec, _: Cut(spec.label, keep=small[spec.label]))
    models = {r["model"] for r in report.rows}
    assert {"a@dim=64", "a@dim=16", "src (causal, mean)@dim=16"} <= models
    assert "src (causal, mean)@dim=64" not in models
    # a model is compared with its baselines size by size, where both were scored
    assert pairs_at({"a": ["src (causal, mean)", "src (causal, last)"]}, models, [64, 16]) == {
        "a@dim=16": ["src (causal, mean)@dim=16", "src (causal, last)@dim=16"]}
    assert pairs_at({"a": ["b"]}, {"a", "b"}, []) == {"a": ["b"]}


def test_parse_and_truncate():
    assert parse_dims("full, 256,64") == ["full", 256, 64] and parse_dims([8, "FULL"]) == [8, "full"]
    assert parse_dims(None) == []
    for bad in ("0", "1.5", "x", "8,8"):
        with pytest.raises(ConfigError, match="--dims"):
            parse_dims(bad)
    v = np.array([[3.0, 4.0, 12.0]], dtype=np.float32)
    np.testing.assert_allclose(truncate(v, 2), [[3.0, 4.0]])  # not unit-length: cut only
    unit = v / 13.0
    np.testing.assert_allclose(truncate(unit, 2), [[0.6, 0.8]], rtol=1e-6)  # unit-length: cut and re-normalized
    assert truncate(v, "full") is v and truncate(v, None) is v
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        truncate(np.zeros((0, 3), dtype=np.float32), 2)
