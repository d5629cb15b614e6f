"""Contrastive stages: InfoNCE against a hand computation, SimCSE and pairs learning on toy data, gradient
caching equal to the full batch, 2-process gathering, dropout, pairs-file errors, a whole stage and its resume."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from adapt.config.settings import RunConfig
from adapt.pipeline.reexport import export_from_path
from adapt.model.embedding import Embedder, set_dropout, tokenize
from adapt.objectives import infonce
from adapt.objectives.infonce import contrastive_backward, false_negative_mask, info_nce
from adapt.data.pairs import Pair, load_pairs, load_sentences
from adapt.pipeline.stage import run_stage as train_contrastive  # a contrastive stage is a run of its kind
from adapt.training.loop import Trainer
from adapt.errors import ConfigError, DataError
from tests.tiny import tiny_decoder
from tests.procs import failure

TOPICS = ["fox", "river", "engine", "violin", "garden", "planet", "market", "winter", "castle", "doctor",
          "island", "bridge", "pencil", "tiger", "rocket", "coffee"]


def toy_sentences(n=40):
    adjectives = ["quick", "lazy", "green", "old", "tiny", "loud", "calm", "bright"]
    return [f"The {adjectives[i % 8]} {TOPICS[i % 16]} meets the {TOPICS[(i * 5 + 3) % 16]} near town {i}."
            for i in range(n)]


def toy_pairs(n=16):
    return [Pair(f"where is the {t}?", f"the {t} is right here, the {t}", (f"a {TOPICS[(i + 5) % 16]} far away",))
            for i, t in enumerate(TOPICS[:n])]


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ---- the loss -------------------------------------------------------------------------------------

def test_info_nce_with_hard_negatives_matches_hand_computation():
    q = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    d = torch.tensor([[2.0, 0.1], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.2]])  # positives, then hard negatives
    targets, tau = torch.tensor([0, 1]), 0.5
    loss, correct = info_nce(q, d, targets, tau)
    qn = q.numpy() / np.linalg.norm(q.numpy(), axis=1, keepdims=True)
    dn = d.numpy() / np.linalg.norm(d.numpy(), axis=1, keepdims=True)

    def nll(i, keep):  # -log softmax of the positive over the kept candidates
        s = qn[i] @ dn[keep].T / tau
        return -(qn[i] @ dn[i] / tau - math.log(np.exp(s).sum()))

    everything = [0, 1, 2, 3]
    assert float(loss) == pytest.approx((nll(0, everything) + nll(1, everything)) / 2, rel=1e-5)
    assert int(correct) == 1  # q1's hard negative (1, 1) is closer to it than its positive
    mask = torch.tensor([[False, False, True, False], [False, False, False, False]])  # drops one candidate of q0
    assert float(info_nce(q, d, targets, tau, mask)[0]) == pytest.approx((nll(0, [0, 1, 3]) + nll(1, everything)) / 2,
                                                                         rel=1e-5)


def test_false_negatives_are_masked_but_not_the_positive():
    keys = torch.tensor([7, 8, 7, 9])  # document 2 is the same text as document 0
    mask = false_negative_mask(torch.tensor([7, 8]), keys, torch.tensor([0, 1]))
    assert mask.tolist() == [[False, False, True, False], [False, False, False, False]]


# ---- learning on toy data --------------------------------------------------------------------------

def test_simcse_loss_falls_on_a_fixed_batch(tokenizer):
    torch.manual_seed(0)
    model = tiny_decoder("llama", vocab_size=len(tokenizer))
    assert set_dropout(model, 0.1) > 0
    embed = Embedder(model, "mean").train()
    batch = tokenize(tokenizer, toy_sentences(8), 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        z1, z2 = embed(**batch), embed(**batch)  # two dropout views
        loss, _ = info_nce(z1, z2, torch.arange(8), 0.05)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert np.mean(losses[-3:]) < 0.5 * np.mean(losses[:3]), losses


def _margin(embed, tokenizer, pairs):
    """Mean over queries of cos(query, own positive) - max cos(query, other positives); top-1 accuracy."""
    with torch.no_grad():
        q = torch.nn.functional.normalize(embed(**tokenize(tokenizer, [p.query for p in pairs], 32)), dim=-1)
        d = torch.nn.functional.normalize(embed(**tokenize(tokenizer, [p.positive for p in pairs], 32)), dim=-1)
    sim = q @ d.T
    own = sim.diag()
    others = sim.masked_fill(torch.eye(len(pairs), dtype=torch.bool), -2).max(dim=1).values
    return float((own - others).mean()), float((sim.argmax(1) == torch.arange(len(pairs))).float().mean())


def test_pairs_training_brings_positives_closer_than_negatives(tokenizer):
    torch.manual_seed(0)
    model = tiny_decoder("llama", vocab_size=len(tokenizer))
    embed = Embedder(model, "mean")
    pairs = toy_pairs(8)
    before, _ = _margin(embed.eval(), tokenizer, pairs)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    embed.train()
    for _ in range(12):
        q = embed(**tokenize(tokenizer, [p.query for p in pairs], 32))
        d = embed(**tokenize(tokenizer, [p.positive for p in pairs] + [p.negatives[0] for p in pairs], 32))
        loss, _ = info_nce(q, d, torch.arange(8), 0.05)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after, accuracy = _margin(embed.eval(), tokenizer, pairs)
    assert after > before + 0.05 and after > 0, (before, after)
    assert accuracy == 1.0


# ---- gradient caching ------------------------------------------------------------------------------

def _step(tokenizer, texts, n_queries, *, dropout, chunk, cache, seed=1):
    """Param grads and loss of one contrastive step over ``texts`` embedded in chunks of ``chunk``."""
    model = tiny_decoder("llama", vocab_size=len(tokenizer), seed=2)
    set_dropout(model, dropout)
    embed = Embedder(model, "mean").train()
    chunks = [tokenize(tokenizer, texts[i:i + chunk], 32) for i in range(0, len(texts), chunk)]

    def loss_fn(e):
        return info_nce(e[:n_queries], e[n_queries:], torch.arange(n_queries), 0.05)

    torch.manual_seed(seed)
    loss, _ = contrastive_backward(embed, chunks, loss_fn, cache=cache)
    return _grads(model), float(loss)


def _assert_grads_close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)


def test_grad_cached_gradient_equals_full_batch_gradient(tokenizer):
    pairs = toy_pairs(6)
    texts = [p.query for p in pairs] + [p.positive for p in pairs] + [p.negatives[0] for p in pairs]
    full, full_loss = _step(tokenizer, texts, 6, dropout=0.0, chunk=len(texts), cache=False)
    cached, cached_loss = _step(tokenizer, texts, 6, dropout=0.0, chunk=4, cache=True)
    assert cached_loss == pytest.approx(full_loss, rel=1e-5)
    _assert_grads_close(cached, full)


def test_grad_cache_replays_the_dropout_masks(tokenizer, monkeypatch):
    """With dropout, the cached step equals the same chunks embedded with grad (same RNG draws)."""
    texts = toy_sentences(6) * 2  # SimCSE: two views
    plain, plain_loss = _step(tokenizer, texts, 6, dropout=0.2, chunk=4, cache=False)
    cached, cached_loss = _step(tokenizer, texts, 6, dropout=0.2, chunk=4, cache=True)
    assert cached_loss == pytest.approx(plain_loss, rel=1e-5)
    _assert_grads_close(cached, plain)
    import contextlib

    monkeypatch.setattr(infonce.RngState, "replay", lambda self: contextlib.nullcontext())
    unreplayed, _ = _step(tokenizer, texts, 6, dropout=0.2, chunk=4, cache=True)
    assert any(not torch.allclose(unreplayed[k], plain[k], rtol=1e-3, atol=1e-5) for k in plain)


def test_two_processes_gather_negatives_and_gradients(tmp_path, free_port):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(Path.cwd())}
    script = Path(__file__).with_name("ddp_contrastive_check.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port,
           str(script), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure(proc.stderr)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["gather_ok"]
    for prefix in ("", "matryoshka_", "keep_"):  # plain InfoNCE, weighted Matryoshka prefixes, keep_source
        assert result[f"{prefix}grad_max_abs_diff"] <= 1e-4 * result[f"{prefix}grad_max_abs"] + 1e-6
        assert result[f"{prefix}loss"] == pytest.approx(result[f"{prefix}ref_loss"], abs=1e-4)
    assert result["matryoshka_loss"] > result["loss"]  # the same batch, with the two smaller sizes added
    assert result["keep_loss"] > result["loss"] + 0.01  # and with the term (another model's vectors: CKA < 1)


# ---- dropout ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "phi3", "gemma2"])
def test_set_dropout_makes_two_views_differ(family, tokenizer):
    model = tiny_decoder(family, vocab_size=len(tokenizer))
    embed = Embedder(model, "mean").train()
    batch = tokenize(tokenizer, toy_sentences(3), 16)
    set_dropout(model, 0.0)
    assert torch.equal(embed(**batch), embed(**batch))
    set_dropout(model, 0.3)
    assert not torch.allclose(embed(**batch), embed(**batch))


def test_4bit_layers_keep_their_gradient_after_an_eval_forward(tokenizer, tmp_path):
    """bitsandbytes' CPU inference repacking (triggered by the probe) must not cut the backward pass."""
    from adapt.config.settings import ModelConfig, TuningConfig
    from adapt.model.loading import load_decoder
    from adapt.model.tuning import apply_tuning

    path = tmp_path / "model"
    tiny_decoder("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128).save_pretrained(path)
    tokenizer.save_pretrained(path)
    tuning = TuningConfig(method="qlora", lora_r=4, lora_alpha=8, lora_dropout=0.0)
    model, _ = load_decoder(ModelConfig(source=str(path)), tuning)  # must guard the 4-bit layers itself
    embed = Embedder(apply_tuning(model, tuning), "mean")
    batch = tokenize(tokenizer, toy_sentences(2), 16)
    with torch.no_grad():
        embed.eval()(**batch)  # what the bidirectionality probe does
    embed.train()(**batch).pow(2).sum().backward()
    first = next(p for n, p in model.named_parameters() if "layers.0.self_attn.q_proj.lora_B" in n)
    assert first.grad is not None and float(first.grad.abs().max()) > 0


# ---- data ------------------------------------------------------------------------------------------

def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("line, match", [
    ('{"query": "a", "positive": ', "not valid JSON"),
    ('["a", "b"]', "expected a JSON object"),
    ('{"question": "a", "positive": "b"}', "no 'query' field .*'question'"),
    ('{"query": "a"}', "no 'positive' field"),
    ('{"query": 3, "positive": "b"}', "'query' holds int"),
    ('{"query": "a", "positive": "b", "negatives": [1]}', "'negatives' must be a list of texts"),
])
def test_bad_pairs_lines_are_errors_naming_the_line(tmp_path, line, match):
    path = _write(tmp_path / "pairs.jsonl", ['{"query": "q", "positive": "p"}', "", line])
    with pytest.raises(DataError, match=rf"pairs.jsonl:3: {match}"):
        load_pairs(path)


def test_pairs_skips_are_counted(tmp_path):
    path = _write(tmp_path / "pairs.jsonl", [
        '{"query": "q1", "positive": "p1", "negatives": ["n1", "p1", "", "q1"]}',
        '{"query": "  ", "positive": "p2"}',
        '{"query": "q3", "positive": null}',
        '{"query": "q1", "positive": "p1"}',
        '{"query": "q4", "positive": "p4", "negatives": "n4", "extra": 1}',
    ])
    pairs, counts = load_pairs(path)
    assert pairs == [Pair("q1", "p1", ("n1",)), Pair("q4", "p4", ("n4",))]
    assert counts == {"empty": 2, "duplicate": 1, "bad_negatives": 3}
    with pytest.raises(DataError, match="no usable pairs"):
        load_pairs(_write(tmp_path / "empty.jsonl", ['{"query": "", "positive": "x"}']))
    with pytest.raises(DataError, match="does not exist"):
        load_pairs(tmp_path / "missing.jsonl")


def test_sentences_are_split_filtered_and_deduplicated(tmp_path):
    path = _write(tmp_path / "c.txt", ["One two three four. Too short! One two three four.",
                                       "Is this a question here? Yes it is, indeed."])
    sentences, counts = load_sentences([str(path)], min_words=4)
    assert sentences == ["One two three four.", "Is this a question here?", "Yes it is, indeed."]
    assert counts == {"short": 1, "duplicate": 1}


# ---- a whole stage ---------------------------------------------------------------------------------

def _cfg(model_dir, **sections):
    raw = {"model": {"source": str(model_dir)}, "data": {"eval_fraction": 0.2},
           "train": {"max_steps": 4, "batch_size": 4, "lr": 1e-3, "warmup_ratio": 0.0, "eval_every": 2,
                     "eval_batches": 2, "save_every": 2, "log_every": 1},
           "export": {"pooling": "mean", "max_seq_length": 64}}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    raw["kind"] = "contrastive" if raw.get("contrastive", {}).get("loss") == "pairs" else "simcse"
    return RunConfig.from_dict(raw)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_pairs_stage_exports_an_encoder_with_prompts(tokenizer, tmp_path, method):
    from sentence_transformers import SentenceTransformer

    # bitsandbytes' CPU 4-bit inference packs weights in blocks of 64 inputs: a tiny model must be that wide
    tiny_model_dir = tmp_path / "model"
    tiny_decoder("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128).save_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(tiny_model_dir)

    pairs = tmp_path / "pairs.jsonl"
    _write(pairs, [json.dumps({"query": p.query, "positive": p.positive, "negatives": list(p.negatives)})
                   for p in toy_pairs(16) * 2] + [json.dumps({"query": "x", "positive": ""})] * 4)
    cfg = _cfg(tiny_model_dir, contrastive={"loss": "pairs", "pairs": str(pairs), "query_prompt": "query: ",
                                            "mini_batch": 3, "dropout": 0.0},
               tuning={"method": method, "lora_r": 4, "lora_alpha": 8}, data={"eval_fraction": 0.25},
               train={"grad_accum": 2, "batch_size": 2})
    out = tmp_path / "out"
    result = train_contrastive(cfg, out, show_progress=False)
    s = result.summary
    assert s["data"] == {"examples": 16, "empty": 4, "duplicate": 16, "bad_negatives": 0}
    assert s["batch_per_process"] == 4 and s["mini_batch"] == 3 and s["steps"] == 4
    assert {"eval/pairs_loss", "eval/pairs_acc"} <= set(s["final_eval"])
    assert s["probe_after"]["bidirectional"]
    st = SentenceTransformer(str(out), device="cpu")
    assert st.prompts["query"] == "query: " and st.prompts["document"] == ""
    vectors = st.encode(["where is the fox?"], prompt_name="query")
    assert vectors.shape == (1, 64) and np.isfinite(vectors).all()
    assert (out / "run/adapter/adapter_model.safetensors").exists()
    if method == "lora":  # a checkpoint's re-export carries the stage's query prompt, as the run's export does
        ckpt = sorted((out / "run/checkpoints").iterdir())[-1]
        again = SentenceTransformer(str(export_from_path(ckpt, tmp_path / "from-ckpt")), device="cpu")
        assert again.prompts["query"] == "query: "
        np.testing.assert_allclose(again.encode(["where is the fox?"], prompt_name="query"), vectors, atol=1e-4)


def test_simcse_stage_resumes_exactly_after_a_crash(tiny_model_dir, tmp_path, monkeypatch):
    corpus = _write(tmp_path / "c.txt", toy_sentences(40))
    cfg = _cfg(tiny_model_dir, data={"sources": [str(corpus)]}, contrastive={"dropout": 0.1},
               train={"max_steps": 6, "save_every": 2})
    straight = tmp_path / "straight"
    train_contrastive(cfg, straight, show_progress=False)

    original, calls = Trainer.train_step, {"n": 0}

    def dying(self):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated kill")
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", dying)
    crashed = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated kill"):
        train_contrastive(cfg, crashed, show_progress=False)
    monkeypatch.setattr(Trainer, "train_step", original)
    _write(corpus, toy_sentences(41))
    with pytest.raises(DataError, match="training data differ"):
        train_contrastive(cfg, crashed, resume=True, show_progress=False)
    _write(corpus, toy_sentences(40))
    train_contrastive(cfg, crashed, resume=True, show_progress=False)
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(crashed / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
    records = [json.loads(x) for x in (crashed / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    summary = json.loads((crashed / "run/summary.json").read_text())
    assert summary["dropout"] == 0.1 and summary["data"]["examples"] == 40 and summary["eval_examples"] == 8


def test_resume_before_the_first_checkpoint_restarts_with_a_clean_log(tiny_model_dir, tmp_path, monkeypatch):
    corpus = _write(tmp_path / "c.txt", toy_sentences(40))
    cfg = _cfg(tiny_model_dir, data={"sources": [str(corpus)]}, train={"save_every": 0, "eval_every": 0})
    original = Trainer.train_step

    def dying(self):
        if self.step == 2:
            raise RuntimeError("simulated kill")
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", dying)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated kill"):
        train_contrastive(cfg, out, show_progress=False)
    monkeypatch.setattr(Trainer, "train_step", original)
    train_contrastive(cfg, out, resume=True, show_progress=False)
    records = [json.loads(x) for x in (out / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]


def test_too_little_data_is_a_clear_error(tiny_model_dir, tmp_path):
    corpus = _write(tmp_path / "c.txt", toy_sentences(3))
    with pytest.raises(DataError, match="only 3 training sentences"):
        train_contrastive(_cfg(tiny_model_dir, data={"sources": [str(corpus)]}), tmp_path / "o", show_progress=False)
    assert not (tmp_path / "o").exists()


# ---- crops (Contriever's independent cropping) -----------------------------------------------------

def test_crops_are_contiguous_spans_of_the_asked_length():
    from adapt.data.pairs import crop

    words = [f"w{i}" for i in range(100)]
    rng = np.random.default_rng(0)
    lengths = set()
    for _ in range(200):
        span = crop(words, rng, (0.1, 0.5), 8, 30).split()
        start = words.index(span[0])
        assert span == words[start:start + len(span)]
        assert 10 <= len(span) <= 30  # 0.1 x 100 at least; capped at max_words
        lengths.add(len(span))
    assert len(lengths) > 5  # drawn, not fixed
    assert crop(words[:5], rng, (0.1, 0.5), 8, 30).split() == words[:5]  # a short document is taken whole


def test_query_words_cuts_short_queries_against_ordinary_document_spans():
    from adapt.config.settings import ContrastiveConfig
    from adapt.objectives.crops import Crops

    crops = object.__new__(Crops)
    crops.c, crops._rng = ContrastiveConfig(loss="crops", query_words=[1, 4], max_length=30), np.random.default_rng(0)
    docs = [" ".join(f"d{d}w{i}" for i in range(100)) for d in range(50)]
    texts, n, keys, _ = crops.texts(docs)
    queries, positives = texts[:n], texts[n:]
    assert n == 50 and keys[0] != keys[1]
    assert {len(q.split()) for q in queries} == {1, 2, 3, 4}  # drawn, each length in the bounds
    assert all(10 <= len(p.split()) <= 30 for p in positives)  # documents still cut by crop_ratio
    for doc, q in zip(docs, queries):  # a contiguous span of its own document
        assert f" {q} " in f" {doc} "
    crops.c = ContrastiveConfig(loss="crops", max_length=30)
    texts, n, _, _ = crops.texts(docs)
    assert all(10 <= len(q.split()) <= 30 for q in texts[:n])  # unset: queries are cut like documents
    for bad in ([0, 4], [5, 2], [1], [1.5, 3], "1,4"):
        with pytest.raises(ConfigError, match="query_words"):
            ContrastiveConfig(loss="crops", query_words=bad)


def test_query_in_document_cuts_that_share_of_queries_from_their_document_span():
    from adapt.config.settings import ContrastiveConfig
    from adapt.objectives.crops import Crops
    from adapt.data.pairs import crop_words

    crops = object.__new__(Crops)
    docs = [" ".join(f"d{d}w{i}" for i in range(200)) for d in range(400)]

    def inside(share):
        crops.c = ContrastiveConfig(loss="crops", query_words=[1, 4], query_in_document=share, max_length=30)
        crops._rng = np.random.default_rng(0)
        texts, n, _, _ = crops.texts(docs)
        return [f" {q} " in f" {p} " for q, p in zip(texts[:n], texts[n:])], texts

    assert all(inside(1.0)[0])
    half = np.mean(inside(0.5)[0])
    assert 0.4 < half < 0.65, half  # 0.5 inside by construction, plus the few independent ones that overlap
    none, texts = inside(0.0)
    assert np.mean(none) < 0.15
    rng = np.random.default_rng(0)  # share 0 draws exactly what the crops drew before the option existed
    from adapt.data.pairs import crop
    expected = [(crop_words(d.split(), rng, 1, 4), crop(d.split(), rng, (0.1, 0.5), 8, 30)) for d in docs]
    assert texts == [q for q, _ in expected] + [p for _, p in expected]
    with pytest.raises(ConfigError, match="query_in_document"):
        ContrastiveConfig(loss="crops", query_in_document=1.5)


@pytest.mark.parametrize("loss,setting", [("simcse", {"query_words": [1, 8]}),
                                          ("simcse", {"crop_ratio": [0.2, 0.4], "query_in_document": 0.1}),
                                          ("pairs", {"query_in_document": 0.5})])
def test_crops_settings_on_a_stage_that_cuts_no_crops_are_an_error(tiny_model_dir, tmp_path, loss, setting):
    """They were silently ignored: a SimCSE or pairs stage reads no crop settings."""
    corpus = _write(tmp_path / "c.txt", toy_sentences(40))
    pairs = tmp_path / "p.jsonl"
    pairs.write_text("".join(json.dumps({"query": x.query, "positive": x.positive}) + "\n" for x in toy_pairs()))
    cfg = _cfg(tiny_model_dir, data={"sources": [str(corpus)]},
               contrastive={"loss": loss, **({"pairs": str(pairs)} if loss == "pairs" else {}), **setting})
    with pytest.raises(ConfigError, match="only shape crops") as err:
        train_contrastive(cfg, tmp_path / "o", show_progress=False)
    assert all(f"contrastive.{k}" in str(err.value) for k in setting)
    assert not (tmp_path / "o").exists()
    # the same settings on a crops stage are read, not refused
    from adapt.objectives.crops import Crops

    assert Crops(_cfg(tiny_model_dir, contrastive={"loss": "crops", **setting})).c.query_in_document == \
        setting.get("query_in_document", 0.0)


def _documents(n=24):
    return "\n\n".join(" ".join(toy_sentences(40)[i:i + 5]) for i in range(n)) + "\n"


def test_crops_stage_resumes_exactly_after_a_crash(tiny_model_dir, tmp_path, monkeypatch):
    corpus = tmp_path / "docs.txt"
    corpus.write_text(_documents(), encoding="utf-8")
    cfg = _cfg(tiny_model_dir, data={"sources": [str(corpus)]}, contrastive={"loss": "crops", "dropout": 0.0},
               train={"max_steps": 6, "save_every": 2})
    cfg = RunConfig.from_dict({**cfg.to_dict(), "kind": "crops"})
    straight = train_contrastive(cfg, tmp_path / "straight", show_progress=False)
    assert straight.summary["loss"] == "crops" and straight.summary["data"]["examples"] == 24
    assert {"eval/crops_loss", "eval/crops_acc"} <= set(straight.summary["final_eval"])
    original, calls = Trainer.train_step, {"n": 0}

    def dying(self):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated kill")
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", dying)
    with pytest.raises(RuntimeError, match="simulated kill"):
        train_contrastive(cfg, tmp_path / "crashed", show_progress=False)
    monkeypatch.setattr(Trainer, "train_step", original)
    train_contrastive(cfg, tmp_path / "crashed", resume=True, show_progress=False)
    a, b = load_file(str(tmp_path / "straight/model.safetensors")), load_file(str(tmp_path / "crashed/model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("kind, loss", [("crops", "crops"), ("simcse", "simcse")])
def test_a_preset_of_one_contrastive_kind_trains_that_kind(tiny_model_dir, tmp_path, kind, loss):
    """`kind: crops` at a preset's top level (no `stages:`) gets the settings the kind forces, as a stage of a
    chain does: before, such a preset kept contrastive.loss=simcse and trained SimCSE under the name crops."""
    from adapt.pipeline.convert import convert

    corpus = tmp_path / "docs.txt"
    corpus.write_text(_documents(), encoding="utf-8")
    preset = tmp_path / "one-kind.yaml"
    preset.write_text(yaml.safe_dump({
        "description": f"one {kind} stage", "kind": kind, "data": {"sources": [str(corpus)], "eval_fraction": 0.25},
        "tuning": {"method": "lora"}, "contrastive": {"dropout": 0.1, "max_length": 32},
        "train": {"max_steps": 2, "batch_size": 4, "eval_every": 0, "eval_batches": 1, "save_every": 0}}))
    result = convert(str(tiny_model_dir), tmp_path / "out", preset=str(preset), show_progress=False)
    assert result.config.kind == kind and result.config.contrastive.loss == loss
    assert result.summary["loss"] == loss and {f"eval/{loss}_loss", f"eval/{loss}_acc"} <= set(result.summary["final_eval"])
    saved = yaml.safe_load((tmp_path / "out/run/config.yaml").read_text())
    assert saved["kind"] == kind and saved["contrastive"]["loss"] == loss
