"""Inference-free SPLADE (``splade.queries: idf``): queries are the IDF of their tokens, documents go through the model;
the export is a sentence-transformers Router that plain ``SparseEncoder(DIR)`` loads."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from adapt.model.bidirectional import make_bidirectional
from adapt.config.settings import ModelConfig
from adapt.model.embedding import tokenize
from adapt.errors import ConfigError
from adapt.model.loading import load_decoder
from adapt.pipeline.reexport import export_from_path, load_checkpoint_model
from adapt.export.sparse import (document_model, export_sparse, is_sparse_folder, sparse_supported,
                                 trained_query_idf)
from adapt.model.splade import SparseLM, idf_vectors, idf_weights, query_prefix
from adapt.pipeline.chain import run_stages
from tests.tiny import TINY_CONFIGS, tiny_decoder

needs_st = pytest.mark.skipif(not sparse_supported(), reason="sparse encoders need sentence-transformers >= 6.2")

DOCS = ["the fox runs over the hill", "the dog sleeps in the sun", "a fox and a dog", "the sun sets"]
QUERIES = ["fox hill", "sleeping dog", "the sun"]


def _dense(vectors):
    return (vectors.to_dense() if vectors.is_sparse else vectors).float()


def _queries(folder):
    """QUERIES as plain ``SparseEncoder(folder).encode_query`` gives them, dense."""
    from sentence_transformers import SparseEncoder

    return _dense(SparseEncoder(str(folder), device="cpu").encode_query(QUERIES, convert_to_tensor=True))


def _documents(folder):
    """A training text of 28 documents (blank-line separated) for the tiny splade stages."""
    from tests.objectives.test_contrastive import toy_sentences
    from tests.tiny import CORPUS

    docs = folder / "docs.txt"
    docs.write_text("\n\n".join([CORPUS] * 4 + [" ".join(toy_sentences(40)[i:i + 5]) for i in range(24)]) + "\n",
                    encoding="utf-8")
    return docs


def _tiny_with_idf(family, tokenizer):
    """A bidirectional tiny ``family`` decoder and the IDF of DOCS over its LM head's vocabulary."""
    model = make_bidirectional(tiny_decoder(family, vocab_size=len(tokenizer)))
    vocab = model.get_output_embeddings().weight.shape[0]
    return model, idf_weights(tokenizer, DOCS, vocab, query_prefix(tokenizer))


def test_idf_is_bm25s_over_the_documents_and_zero_for_special_tokens(tokenizer):
    prefix = query_prefix(tokenizer)
    idf = idf_weights(tokenizer, DOCS, len(tokenizer) + 5, prefix)
    assert idf.shape == (len(tokenizer) + 5,) and (idf[len(tokenizer):] == 0).all()
    assert (idf[tokenizer.all_special_ids] == 0).all()
    n = len(DOCS)
    assert prefix == " "  # so " the" opens 3 documents' texts; without the prefix it would be in 2
    the = tokenizer(" the", add_special_tokens=False)["input_ids"]
    assert len(the) == 1 and idf[the[0]].item() == pytest.approx(math.log1p((n - 3 + 0.5) / (3 + 0.5)), rel=1e-5)
    tokenized = [set(tokenizer(prefix + d, add_special_tokens=False)["input_ids"]) for d in DOCS]
    for i in set().union(*tokenized) - set(tokenizer.all_special_ids):
        df = sum(i in ids for ids in tokenized)
        assert idf[i].item() == pytest.approx(math.log1p((n - df + 0.5) / (df + 0.5)), rel=1e-5)
    unseen = tokenizer(" zebra", add_special_tokens=False)["input_ids"]
    assert idf[unseen].max().item() == pytest.approx(math.log1p((n + 0.5) / 0.5), rel=1e-5)  # seen nowhere
    with pytest.raises(ValueError):
        idf_weights(tokenizer, [], len(tokenizer))


def test_a_byte_level_tokenizer_gets_a_leading_space_so_a_first_word_matches_its_form_inside_text(tokenizer):
    assert query_prefix(tokenizer) == " "  # the tiny tokenizer is byte-level BPE without a prefix space
    first = tokenizer(" " + "fox", add_special_tokens=False)["input_ids"]
    inside = tokenizer("a fox", add_special_tokens=False)["input_ids"]
    assert first == inside[-len(first):]


def test_idf_vectors_weight_each_present_token_once(tokenizer):
    idf = torch.arange(len(tokenizer), dtype=torch.float32) / 10
    vectors = idf_vectors(tokenizer, ["fox fox dog", "dog"], idf, " ")
    for row, text in zip(vectors, [" fox fox dog", " dog"]):
        ids = set(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert set(row.nonzero().flatten().tolist()) == {i for i in ids if idf[i] > 0}
        assert all(row[i] == idf[i] for i in ids)  # present once or twice: its IDF, once


@needs_st
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_an_idf_router_export_of_every_family_loads_in_plain_sparse_encoder(family, tokenizer, tmp_path):
    from sentence_transformers import SparseEncoder

    model, idf = _tiny_with_idf(family, tokenizer)
    out = export_sparse(model, tokenizer, tmp_path / "sparse", query_idf=idf)
    assert is_sparse_folder(out) and (out / "router_config.json").is_file()
    assert json.loads((out / "config.json").read_text())["is_causal"] is False  # the causal LM stays at the root
    manifest = json.loads((out / "adapt_export.json").read_text())
    assert manifest["queries"] == "idf" and manifest["prompts"]["query"] == " " and manifest["probe"]["bidirectional"]
    encoder = SparseEncoder(str(out), device="cpu")  # no custom code, no trust_remote_code
    queries = _dense(encoder.encode_query(QUERIES, convert_to_tensor=True))
    torch.testing.assert_close(queries, idf_vectors(tokenizer, QUERIES, idf, " "))
    docs = _dense(encoder.encode_document(DOCS, convert_to_tensor=True))
    with torch.no_grad():
        expected = SparseLM(model)(**tokenize(tokenizer, DOCS, 512))
    torch.testing.assert_close(docs, expected, rtol=1e-4, atol=1e-5)
    assert document_model(encoder).config.is_causal is False
    torch.testing.assert_close(trained_query_idf(out), idf)
    again = export_from_path(out, tmp_path / "again")  # a re-export keeps the router, its IDF and its prompt
    assert json.loads((again / "adapt_export.json").read_text())["prompts"]["query"] == " "
    torch.testing.assert_close(_queries(again), queries)


@needs_st
def test_a_term_bias_and_idf_queries_export_together(tokenizer, tmp_path):
    from sentence_transformers import SparseEncoder

    model, idf = _tiny_with_idf("llama", tokenizer)
    bias = torch.randn(idf.shape[0], generator=torch.Generator().manual_seed(0)) - 0.5
    out = export_sparse(model, tokenizer, tmp_path / "sparse", query_idf=idf, term_bias=bias, top_k=7)
    encoder = SparseEncoder(str(out), device="cpu")
    with torch.no_grad():
        expected = SparseLM(model, bias)(**tokenize(tokenizer, DOCS, 512))
    docs = _dense(encoder.encode_document(DOCS, convert_to_tensor=True))
    assert ((docs > 0).sum(1) <= 7).all()
    top = expected.topk(7, dim=1)
    torch.testing.assert_close(docs.gather(1, top.indices), top.values, rtol=1e-4, atol=1e-5)
    lm, _ = load_decoder(ModelConfig(source=str(out), dtype="float32"), require_head=True)
    from adapt.export.sparse import trained_term_bias

    torch.testing.assert_close(trained_term_bias(out, lm), bias, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="query_idf has"):
        export_sparse(model, tokenizer, tmp_path / "bad", query_idf=idf[:-1])


@needs_st
def test_mlm_then_inference_free_splade_trains_documents_only_and_exports_a_router(tiny_model_dir, tmp_path):
    from sentence_transformers import SparseEncoder

    docs = _documents(tmp_path)
    out = tmp_path / "out"
    result = run_stages(str(tiny_model_dir), out, stages="mlm,splade", preset="tiny", data=[str(docs)],
                        overrides=["splade.train.batch_size=4", "splade.train.eval_batches=2",
                                   "splade.contrastive.max_length=32", "splade.splade.queries=idf",
                                   "splade.splade.init_active_terms=20"], show_progress=False)
    stage = result.summary["per_stage"]["2-splade"]
    assert stage["queries"] == "idf" and stage["steps"] == 4
    assert {"eval/splade_loss", "eval/active_terms_query", "eval/active_terms_doc"} <= set(stage["final_eval"])
    ckpt = sorted((out / "stages/2-splade/run/checkpoints").iterdir())[-1]
    saved = load_file(str(ckpt / "model.safetensors"))
    idf_key = next(k for k in saved if k.endswith("query_idf"))
    encoder = SparseEncoder(str(out), device="cpu")
    queries = _dense(encoder.encode_query(QUERIES, convert_to_tensor=True))
    torch.testing.assert_close(queries, idf_vectors(encoder.tokenizer, QUERIES, saved[idf_key], " "))
    assert (queries > 0).any()
    rebuilt = load_checkpoint_model(ckpt)  # a checkpoint re-export keeps the router
    torch.testing.assert_close(rebuilt.query_idf, saved[idf_key])
    again = export_from_path(ckpt, tmp_path / "from-ckpt")
    torch.testing.assert_close(_queries(again), queries)


@needs_st
def test_bench_and_embed_send_queries_to_the_idf_route_and_documents_to_the_model(tokenizer, tmp_path):
    import numpy as np

    from adapt.bench import RetrievalTask, run_bench
    from adapt.inference.sparse import embed_sparse

    model, idf = _tiny_with_idf("qwen3", tokenizer)
    folder = export_sparse(model, tokenizer, tmp_path / "splade", query_idf=idf)
    retrieval = RetrievalTask(name="toy-retrieval", query_ids=[f"q{i}" for i in range(3)], queries=QUERIES,
                              corpus_ids=[f"d{i}" for i in range(4)], corpus=DOCS,
                              qrels={"q0": {"d0": 1.0}, "q1": {"d1": 1.0}, "q2": {"d3": 1.0}})
    report = run_bench([str(folder)], tasks=[retrieval], out_dir=tmp_path / "bench", show_progress=False,
                       use_cache=False)
    rows = {r["metric"]: r["value"] for r in report.rows if r["model"] == "splade" and r["task"] == "toy-retrieval"}
    queries = idf_vectors(tokenizer, QUERIES, idf, " ").numpy()
    with torch.no_grad():
        corpus = SparseLM(model)(**tokenize(tokenizer, DOCS, 512)).numpy()
    scores = queries @ corpus.T
    order = np.argsort(-scores, 1, kind="stable")
    expected, _ = retrieval.evaluate_ranking(np.where(np.take_along_axis(scores, order, 1) > 0, order, -1))
    assert rows["ndcg@10"] == pytest.approx(expected["ndcg@10"], abs=1e-6)
    assert rows["active_terms_query"] == pytest.approx(float((queries > 0).sum(1).mean()))
    assert rows["active_terms_doc"] == pytest.approx(float((corpus > 0).sum(1).mean()))
    # adapt embed: --prompt query takes the IDF route, no prompt (or document) the model
    out = tmp_path / "q.jsonl"
    embed_sparse(folder, QUERIES, out, prompt_name="query")
    first = json.loads(out.read_text().splitlines()[0])
    assert sorted(first["indices"]) == sorted(np.flatnonzero(queries[0]).tolist())
    embed_sparse(folder, DOCS, tmp_path / "d.jsonl")
    doc = json.loads((tmp_path / "d.jsonl").read_text().splitlines()[0])
    assert len(doc["indices"]) == int((corpus[0] > 0).sum())


@needs_st
def test_own_terms_with_encoder_queries_reports_own_terms_active_and_exports_no_router(tiny_model_dir, tmp_path):
    docs = _documents(tmp_path)
    out = tmp_path / "out"
    result = run_stages(str(tiny_model_dir), out, stages="splade", preset="tiny", data=[str(docs)],
                        overrides=["train.batch_size=4", "train.eval_batches=2", "contrastive.max_length=32",
                                   "splade.own_terms=1.0", "splade.init_active_terms=20"],
                        show_progress=False)
    stage = result.summary["per_stage"]["1-splade"]
    assert stage["own_terms"] == 1.0 and stage["queries"] == "encoder"
    assert 0.0 <= stage["final_eval"]["eval/own_terms_active"] <= 1.0
    assert is_sparse_folder(out) and trained_query_idf(out) is None  # the IDF trained the documents only


def test_the_own_terms_floor_reaches_a_documents_inactive_tokens_through_the_pooled_logits(tokenizer):
    from adapt.config.settings import RunConfig
    from adapt.objectives.splade import Splade
    from adapt.model.splade import ranking_loss

    gen = torch.Generator().manual_seed(1)
    pooled = torch.randn(5, 12, generator=gen).requires_grad_()  # before relu: 2 queries, then 3 documents
    own = torch.rand(3, 12, generator=gen) * (torch.rand(3, 12, generator=gen) > 0.5)
    objective = Splade(RunConfig.from_dict({"kind": "splade", "splade": {"own_terms": 2.0}}))
    objective._own = own
    loss = objective.loss_fn(2, [0, 1], [0, 1, 2], torch.arange(5), gather=False)(pooled)[0]
    weights = pooled.relu().log1p()
    base = ranking_loss(weights[:2], weights[2:], torch.arange(2))[0]
    floor = ((own * (1 - pooled[2:]).relu()).sum(1) / own.sum(1)).mean()
    torch.testing.assert_close(loss, base + 2.0 * floor)
    with pytest.raises(ConfigError, match="splade.own_terms"):
        RunConfig.from_dict({"splade": {"own_terms": -1}})
    loss.backward()
    dead = (pooled[2:] < 0) & (own > 0)  # a document's own token with weight 0: only the floor reaches it
    assert dead.any() and (pooled.grad[2:][dead] < 0).all()  # descent raises it

    model = make_bidirectional(tiny_decoder("llama", vocab_size=len(tokenizer))).eval()
    bias = torch.randn(model.get_output_embeddings().weight.shape[0], generator=gen)
    enc = tokenize(tokenizer, DOCS, 16)
    with torch.no_grad():
        before_relu = SparseLM(model, bias, pre_activation=True)(**enc)
        torch.testing.assert_close(before_relu.relu().log1p(), SparseLM(model, bias)(**enc))
    assert (before_relu < 0).any()
