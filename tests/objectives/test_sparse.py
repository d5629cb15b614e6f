"""SPLADE sparse encoders: the pooling and loss against sentence-transformers and hand computations, the sparse
export of every tiny family loaded by plain SparseEncoder (bidirectional, same vectors as in memory), the LM head
carried from MLM to later stages, the mlm,splade chain from Python and the CLI, sparse rows from `adapt embed`,
and sparse encoders in `adapt bench`."""
import json

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from adapt.bench import RetrievalTask, run_bench
from adapt.bench.tasks import ClassificationTask
from adapt.model.bidirectional import make_bidirectional, probe
from adapt.config.settings import ModelConfig, build_config
from adapt.model.embedding import tokenize
from adapt.errors import ConfigError, ModelLoadError, NotBidirectionalError
from adapt.model.lm_head import find_lm_head, save_lm_head
from adapt.config.run_folder import LM_HEAD, find_checkpoint
from adapt.model.loading import load_decoder
from adapt.pipeline.reexport import export_from_path, load_checkpoint_model
from adapt.model.splade import (SparseLM, calibrate_term_bias, flops, keep_top_k, max_logits, ranking_loss, regularizer_scale,
                          splade_pool)
from adapt.export.sparse import export_sparse, is_sparse_folder, sparse_supported, trained_term_bias
from adapt.pipeline.chain import plan_stages, run_stages
from tests.objectives.test_contrastive import TOPICS, toy_pairs, toy_sentences
from tests.tiny import CORPUS, TINY_CONFIGS, tiny_decoder

TEXTS = ["The quick brown fox jumps over the lazy dog.", "An encoder reads the whole sentence at once.", "fox"]

needs_st = pytest.mark.skipif(not sparse_supported(), reason="sparse encoders need sentence-transformers >= 6.2 "
                              "(tests/objectives/test_sparse_gate.py checks the refusal)")


def _sparse_encoder(path):
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(path), device="cpu")  # as a user loads it: no custom code, no trust_remote_code


def _dense(encoder, texts):
    return encoder.encode(texts, convert_to_tensor=True, convert_to_sparse_tensor=False).float()


# ---- the math --------------------------------------------------------------------------------------

def test_splade_pool_equals_sentence_transformers_splade_pooling():
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50) * 3
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [0] * 2 + [1] * 5])
    theirs = SpladePooling("max", "relu").eval()({"token_embeddings": logits.clone(), "attention_mask": mask})
    torch.testing.assert_close(splade_pool(logits, mask), theirs["sentence_embedding"])
    # padding never contributes, even where its logits are the largest
    padded = logits.clone()
    padded[1, 4:] = 100.0
    torch.testing.assert_close(splade_pool(padded, mask), splade_pool(logits, mask))


def test_flops_warmup_ranking_loss_and_top_k_by_hand():
    w = torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]])
    assert float(flops(w)) == pytest.approx(2.0 ** 2 + 0 + 1.0 ** 2)  # squared mean weight of each term
    assert [regularizer_scale(s, 10) for s in (0, 5, 10, 20)] == [0.0, 0.25, 1.0, 1.0]
    assert regularizer_scale(3, 0) == 1.0
    q, d = torch.tensor([[1.0, 0.0, 1.0]]), torch.tensor([[1.0, 0.0, 2.0], [0.0, 5.0, 0.0]])
    loss, correct = ranking_loss(q, d, torch.tensor([0]))
    assert float(loss) == pytest.approx(-np.log(np.exp(3) / (np.exp(3) + np.exp(0)))) and int(correct) == 1
    masked, _ = ranking_loss(q, d, torch.tensor([0]), torch.tensor([[False, True]]))
    assert float(masked) == pytest.approx(0.0, abs=1e-6)
    assert keep_top_k(torch.tensor([[0.5, 3.0, 1.0, 2.0]]), 2).tolist() == [[0.0, 3.0, 0.0, 2.0]]


def test_the_calibrated_term_bias_leaves_the_asked_active_terms_and_drops_terms_every_text_has():
    torch.manual_seed(0)
    pooled = torch.randn(10, 500) * 2 + 3  # mostly positive, as a decoder head's logits are
    pooled[:, 0] = 50.0  # a term every text raises the same: no information
    pooled[3, 7] = 40.0  # a term one text raises far above its usual level
    assert int((splade_pool(pooled.unsqueeze(1), torch.ones(10, 1)) > 0).sum()) > 0.9 * pooled.numel()
    bias = calibrate_term_bias(pooled, 20)
    weights = splade_pool(pooled.unsqueeze(1), torch.ones(10, 1), bias)
    assert int((weights > 0).sum()) == 20 * 10  # 20 active terms per text on average
    assert (weights[:, 0] == 0).all() and weights[3, 7] == weights.max()
    torch.testing.assert_close(max_logits(pooled.unsqueeze(1), torch.ones(10, 1)), pooled)


def test_flops_training_makes_vectors_sparser(tokenizer):
    torch.manual_seed(0)
    model = make_bidirectional(tiny_decoder("qwen2", vocab_size=len(tokenizer)))
    module = SparseLM(model).train()
    batch = tokenize(tokenizer, toy_sentences(8), 32)
    before = int((module(**batch) > 0).sum())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(15):
        optimizer.zero_grad()
        (10.0 * flops(module(**batch))).backward()
        optimizer.step()
    with torch.no_grad():
        after = int((module(**batch) > 0).sum())
    assert after < 0.5 * before, (before, after)


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_a_splade_step_trains_the_head_of_every_family(family, tokenizer):
    model = make_bidirectional(tiny_decoder(family, vocab_size=len(tokenizer)))
    weights = SparseLM(model.train())(**tokenize(tokenizer, [p.query for p in toy_pairs(4)] +
                                                 [p.positive for p in toy_pairs(4)], 32))
    assert weights.shape == (8, model.get_output_embeddings().weight.shape[0]) and (weights >= 0).all()
    loss, _ = ranking_loss(weights[:4], weights[4:], torch.arange(4))
    (loss + 1e-3 * flops(weights)).backward()
    grad = model.get_output_embeddings().weight.grad
    assert grad is not None and grad.abs().sum() > 0


# ---- the export: plain SparseEncoder, every family ---------------------------------------------------

@needs_st
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_sparse_export_of_every_family_loads_in_plain_sparse_encoder(family, tokenizer, tmp_path):
    model = make_bidirectional(tiny_decoder(family, vocab_size=len(tokenizer)))
    out = export_sparse(model, tokenizer, tmp_path / "sparse")
    assert is_sparse_folder(out)
    assert json.loads((out / "config.json").read_text())["is_causal"] is False
    manifest = json.loads((out / "adapt_export.json").read_text())
    assert manifest["kind"] == "sparse" and manifest["probe"]["bidirectional"]
    assert manifest["layout"] == ("backbone+dense" if family == "gpt2" else "causal-lm")
    encoder = _sparse_encoder(out)
    assert encoder.similarity_fn_name == "dot"
    report = probe(encoder[0].model)  # the loaded SparseEncoder's own model: a late token moves early positions
    assert report.bidirectional, report
    with torch.no_grad():
        expected = SparseLM(model)(**tokenize(tokenizer, TEXTS, 512))
    torch.testing.assert_close(_dense(encoder, TEXTS), expected, rtol=1e-4, atol=1e-5)
    assert "SparseEncoder" in (out / "README.md").read_text()


@needs_st
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_a_term_bias_goes_into_the_export_of_every_family_and_comes_back(family, tokenizer, tmp_path):
    overrides = {"logits_scaling": 4.0} if family == "granite" else {}  # folded into the Dense head's weights
    model = make_bidirectional(tiny_decoder(family, vocab_size=len(tokenizer), **overrides))
    bias = torch.randn(model.get_output_embeddings().weight.shape[0], generator=torch.Generator().manual_seed(0)) - 0.5
    if family == "gemma2":  # soft-capped logits: no linear head computes them
        with pytest.raises(ConfigError, match="soft-caps its logits"):
            export_sparse(model, tokenizer, tmp_path / "sparse", term_bias=bias)
        return
    out = export_sparse(model, tokenizer, tmp_path / "sparse", term_bias=bias)
    manifest = json.loads((out / "adapt_export.json").read_text())
    assert manifest["layout"] == "backbone+dense" and manifest["term_bias"] and manifest["probe"]["bidirectional"]
    with torch.no_grad():
        expected = SparseLM(model, bias)(**tokenize(tokenizer, TEXTS, 512))
        without = SparseLM(model)(**tokenize(tokenizer, TEXTS, 512))
    assert not torch.allclose(expected, without)
    torch.testing.assert_close(_dense(_sparse_encoder(out), TEXTS), expected, rtol=1e-4, atol=1e-5)
    lm, _ = load_decoder(ModelConfig(source=str(out), dtype="float32"), require_head=True)
    torch.testing.assert_close(trained_term_bias(out, lm), bias, rtol=1e-5, atol=1e-5)
    again = export_from_path(out, tmp_path / "again")  # a re-export keeps the bias
    torch.testing.assert_close(_dense(_sparse_encoder(again), TEXTS), expected, rtol=1e-4, atol=1e-5)


@needs_st
def test_top_k_keeps_the_largest_terms_and_a_causal_model_is_refused(tokenizer, tmp_path):
    model = make_bidirectional(tiny_decoder("llama", vocab_size=len(tokenizer)))
    full = _dense(_sparse_encoder(export_sparse(model, tokenizer, tmp_path / "all")), TEXTS)
    pruned = _dense(_sparse_encoder(export_sparse(model, tokenizer, tmp_path / "top5", top_k=5)), TEXTS)
    assert ((pruned > 0).sum(1) == 5).all() and (full > 0).sum(1).min() > 5
    torch.testing.assert_close(pruned, keep_top_k(full, 5))
    with pytest.raises(NotBidirectionalError, match="'llama' model is causal"):
        export_sparse(tiny_decoder("llama", vocab_size=len(tokenizer)), tokenizer, tmp_path / "causal")
    with pytest.raises(ConfigError, match="top_k"):
        export_sparse(model, tokenizer, tmp_path / "bad", top_k=0)


# ---- the LM head an encoder export leaves out --------------------------------------------------------

def test_the_trained_lm_head_comes_back_with_the_backbone(tokenizer, tmp_path):
    model = make_bidirectional(tiny_decoder("phi", vocab_size=len(tokenizer)))  # untied, with a bias
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0).add_(0.5)
        model.lm_head.bias.fill_(0.25)
    folder = tmp_path / "encoder"
    model.base_model.save_pretrained(folder)  # what an encoder export holds: no head
    tokenizer.save_pretrained(folder)
    assert find_lm_head(folder) is None
    with pytest.raises(ModelLoadError, match="holds no trained LM head"):
        load_decoder(ModelConfig(source=str(folder)), require_head=True)

    save_lm_head(model, folder / "run")
    loaded, _ = load_decoder(ModelConfig(source=str(folder)), require_head=True)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)
    torch.testing.assert_close(loaded.lm_head.bias, model.lm_head.bias)

    # a run made before heads were saved: the head in its newest checkpoint (LoRA keys included)
    (folder / "run" / LM_HEAD).unlink()
    ckpt = folder / "run/checkpoints/step-000004"
    ckpt.mkdir(parents=True)
    save_file({"model.base_model.model.lm_head.weight": model.lm_head.weight.detach().clone() * 2,
               "model.base_model.model.lm_head.bias": model.lm_head.bias.detach().clone()},
              str(ckpt / "model.safetensors"))
    (ckpt / "trainer_state.json").write_text('{"step": 4}')
    loaded, _ = load_decoder(ModelConfig(source=str(folder)))
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight * 2)


# ---- the chain, from Python and from the CLI ---------------------------------------------------------

@pytest.fixture
def documents(tmp_path):
    path = tmp_path / "docs.txt"
    docs = [" ".join(toy_sentences(40)[i:i + 5]) for i in range(24)]
    path.write_text("\n\n".join([CORPUS] * 4 + docs) + "\n", encoding="utf-8")
    return path


SPLADE_SET = ["splade.train.batch_size=4", "splade.train.eval_batches=2", "splade.contrastive.max_length=32"]


@needs_st
def test_mlm_then_splade_from_python_gives_a_sparse_encoder(tiny_model_dir, documents, tmp_path):
    out = tmp_path / "out"
    result = run_stages(str(tiny_model_dir), out, stages="mlm,splade", preset="tiny", data=[str(documents)],
                        overrides=SPLADE_SET + ["splade.splade.top_k=40", "splade.splade.init_active_terms=20"],
                        show_progress=False)
    stage = result.summary["per_stage"]["2-splade"]
    assert stage["pairs_from"] == "crops" and stage["top_k"] == 40 and stage["steps"] == 4 and stage["term_bias"]
    assert {"eval/splade_loss", "eval/active_terms_query", "eval/active_terms_doc"} <= set(stage["final_eval"])
    # the term bias started near 20 active terms (of about 320) and trained: it is in each checkpoint, moved
    # between them, and the export carries the last one
    assert 0 < stage["final_eval"]["eval/active_terms_doc"] < 100
    ckpts = sorted((out / "stages/2-splade/run/checkpoints").iterdir())
    biases = [load_file(str(c / "model.safetensors"))["term_bias"] for c in ckpts]
    assert len(biases) == 2 and not torch.allclose(biases[0], biases[1])
    lm, _ = load_decoder(ModelConfig(source=str(out), dtype="float32"), require_head=True)
    torch.testing.assert_close(trained_term_bias(out, lm), biases[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(load_checkpoint_model(ckpts[-1]).term_bias, biases[-1])
    # MLM's head (llama's is untied) was kept for the splade stage, which saved the one it trained
    assert (out / "stages/1-mlm/run" / LM_HEAD).is_file() and (out / "stages/2-splade/run" / LM_HEAD).is_file()
    assert result.summary["probe_after"]["bidirectional"]
    encoder = _sparse_encoder(out)
    assert encoder.max_active_dims == 40
    vectors = _dense(encoder, TEXTS)
    assert ((vectors > 0).sum(1) <= 40).all() and (vectors > 0).sum(1).min() > 0
    torch.testing.assert_close(vectors, _dense(_sparse_encoder(out / "stages/2-splade"), TEXTS))
    config = yaml.safe_load((out / "run/config.yaml").read_text())
    assert config["stages"][1]["kind"] == "splade" and config["stages"][1]["splade"]["top_k"] == 40


@needs_st
def test_mlm_then_splade_on_pairs_and_export_from_the_cli(tmp_path, tokenizer):
    from adapt.cli import main

    model_dir = tmp_path / "gpt2"  # learned absolute positions: the backbone + Dense layout
    tiny_decoder("gpt2", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join([CORPUS] * 4 + toy_sentences(40)), encoding="utf-8")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"query": p.query, "positive": p.positive, "negatives": list(p.negatives)})
                             + "\n" for p in toy_pairs(16)), encoding="utf-8")
    out, runner = tmp_path / "out", CliRunner()
    args = ["convert", str(model_dir), "-o", str(out), "--preset", "tiny", "--data", str(corpus), "--stages",
            "mlm,splade", "--pairs", str(pairs), "--quiet", *sum((["--set", s] for s in SPLADE_SET), [])]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "2-splade: 4 steps" in result.output and "eval/active_terms_query" in result.output
    summary = json.loads((out / "stages/2-splade/run/summary.json").read_text())
    assert summary["pairs_from"] == "pairs" and summary["data"]["examples"] == 16

    pruned = tmp_path / "pruned"
    result = runner.invoke(main, ["export", str(out), "-o", str(pruned), "--top-k", "6"])
    assert result.exit_code == 0, result.output
    vectors = _dense(_sparse_encoder(pruned), TEXTS)
    assert ((vectors > 0).sum(1) == 6).all()
    torch.testing.assert_close(vectors, keep_top_k(_dense(_sparse_encoder(out), TEXTS), 6))
    bad = runner.invoke(main, ["export", str(out), "-o", str(tmp_path / "x"), "--kind", "sparse", "--backend", "onnx"])
    assert bad.exit_code == 2 and "dense encoders only" in bad.output
    dense = runner.invoke(main, ["export", str(out), "-o", str(tmp_path / "dense"), "--kind", "dense"])
    assert dense.exit_code == 0, dense.output
    assert json.loads((tmp_path / "dense/adapt_export.json").read_text())["pooling"] == "mean"


@needs_st
def test_an_mlm_run_exports_sparse_with_its_trained_head(tiny_model_dir, documents, tmp_path):
    from adapt.cli import main

    out, runner = tmp_path / "mlm", CliRunner()
    assert runner.invoke(main, ["convert", str(tiny_model_dir), "-o", str(out), "--preset", "tiny", "--data",
                                str(documents), "--quiet"]).exit_code == 0
    dense_copy = tmp_path / "dense"  # an encoder export alone keeps no head: refused, saying where one is
    assert runner.invoke(main, ["export", str(out), "-o", str(dense_copy)]).exit_code == 0
    refused = runner.invoke(main, ["export", str(dense_copy), "-o", str(tmp_path / "no"), "--kind", "sparse"])
    assert refused.exit_code == 2 and "no trained LM head" in refused.output
    sparse = tmp_path / "sparse"
    result = runner.invoke(main, ["export", str(out), "-o", str(sparse), "--kind", "sparse"])
    assert result.exit_code == 0, result.output
    trained, _ = load_decoder(ModelConfig(source=str(out)), require_head=True)
    source, _ = load_decoder(ModelConfig(source=str(tiny_model_dir)))
    in_checkpoint = load_file(str(find_checkpoint(out) / "model.safetensors"))["model.lm_head.weight"]
    torch.testing.assert_close(trained.lm_head.weight, in_checkpoint)  # the head MLM trained, not the source's
    rows = min(len(trained.lm_head.weight), len(source.lm_head.weight))  # (+ a mask token when MLM added one)
    assert not torch.allclose(trained.lm_head.weight[:rows], source.lm_head.weight[:rows])
    with torch.no_grad():
        expected = SparseLM(trained)(**tokenize(trained_tok(sparse), TEXTS, 512))
    torch.testing.assert_close(_dense(_sparse_encoder(sparse), TEXTS), expected, rtol=1e-4, atol=1e-5)

    # adapt embed: rows of term ids, weights and tokens, heaviest first, in .jsonl and .parquet; no .npy
    jsonl, parquet = tmp_path / "v.jsonl", tmp_path / "v.parquet"
    for path in (jsonl, parquet):
        result = runner.invoke(main, ["embed", str(sparse), *TEXTS, "", "-o", str(path), "--quiet"])
        assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    import pyarrow.parquet as pq
    assert pq.read_table(parquet).to_pylist() == [{**r, "values": pytest.approx(r["values"])} for r in rows]
    encoder, tok = _sparse_encoder(sparse), trained_tok(sparse)
    dense = _dense(encoder, TEXTS)
    assert [r["id"] for r in rows] == [0, 1, 2, 3] and rows[3]["indices"]  # the empty text: a lone EOS token
    for row, vector in zip(rows, dense):
        assert set(row) == {"id", "indices", "values", "tokens"}
        assert row["values"] == sorted(row["values"], reverse=True)
        np.testing.assert_allclose(row["values"], vector[row["indices"]].numpy(), rtol=1e-5)
        assert len(row["indices"]) == int((vector > 0).sum())
        assert row["tokens"] == [tok.convert_ids_to_tokens(i) if "\ufffd" in tok.decode([i]) else tok.decode([i])
                                 for i in row["indices"]]
    npy = runner.invoke(main, ["embed", str(sparse), "text", "-o", str(tmp_path / "v.npy")])
    assert npy.exit_code == 2 and "write .jsonl or .parquet" in npy.output


def trained_tok(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@needs_st
def test_splade_plans_need_text_or_pairs(tmp_path):
    plan = plan_stages("m", tmp_path / "o", stages="mlm,splade", data=["c.txt"], pairs="p.jsonl")
    assert plan[1].config.contrastive.pairs == "p.jsonl" and plan[1].config.kind == "splade"
    only_pairs = plan_stages("m", tmp_path / "o", stages="splade", pairs="p.jsonl")
    assert only_pairs[0].config.data.sources == []
    with pytest.raises(ConfigError, match=r"stage 1 \(splade\) needs training text"):
        plan_stages("m", tmp_path / "o", stages="splade")
    cfg = build_config(None, ["splade.lambda_q=1e-3", "splade.top_k=64", "splade.top_k=null"])
    assert cfg.splade.lambda_q == 1e-3 and cfg.splade.top_k is None
    with pytest.raises(ConfigError, match="lambda_warmup"):
        build_config(None, ["splade.lambda_warmup=2"])


# ---- the bench ----------------------------------------------------------------------------------------

@needs_st
def test_bench_scores_a_sparse_encoder_on_retrieval_only(tokenizer, tmp_path):
    model = make_bidirectional(tiny_decoder("qwen3", vocab_size=len(tokenizer)))
    folder = export_sparse(model, tokenizer, tmp_path / "splade")
    topics = TOPICS[:8]
    retrieval = RetrievalTask(name="toy-retrieval", query_ids=[f"q{i}" for i in range(8)],
                              queries=[f"where is the {t}?" for t in topics],
                              corpus_ids=[f"d{i}" for i in range(8)], corpus=[f"the {t} is here" for t in topics],
                              qrels={f"q{i}": {f"d{i}": 1.0} for i in range(8)})
    classification = ClassificationTask(name="toy-classes", train_texts=["good", "bad"], train_labels=["p", "n"],
                                        test_texts=["fine"], test_labels=["p"])
    report = run_bench([str(folder)], tasks=[retrieval, classification], out_dir=tmp_path / "bench",
                       show_progress=False, use_cache=False)
    rows = {(r["task"], r["metric"]): r["value"] for r in report.rows if r["model"] == "splade"}
    assert ("toy-classes", "accuracy") not in rows  # not a retrieval task: not scored
    encoder = _sparse_encoder(folder)
    queries, corpus = _dense(encoder, retrieval.queries).numpy(), _dense(encoder, retrieval.corpus).numpy()
    scores = queries @ corpus.T
    top = np.where(np.take_along_axis(scores, np.argsort(-scores, 1, kind="stable"), 1) > 0,
                   np.argsort(-scores, 1, kind="stable"), -1)
    expected, _ = retrieval.evaluate_ranking(top)
    assert rows[("toy-retrieval", "ndcg@10")] == pytest.approx(expected["ndcg@10"], abs=1e-6)
    assert rows[("toy-retrieval", "active_terms_query")] == pytest.approx(float((queries > 0).sum(1).mean()))
    assert rows[("toy-retrieval", "active_terms_doc")] == pytest.approx(float((corpus > 0).sum(1).mean()))
    assert "### Sparse encoders" in report.markdown and "| splade | toy-retrieval |" in report.markdown
