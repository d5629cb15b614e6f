"""Correctness of the training-speed levers measured by benchmarks/train_throughput.py.

Each optimised path must give what the unoptimised one gives: the LM head only at labelled
positions (LabeledPositionsLM) against transformers' full-logits causal-LM loss (loss and
gradients), under fp32 and bf16 autocast; AdamW(fused=True) against the default AdamW; and the
benchmark's FLOP accounting.
"""
from __future__ import annotations

import copy
import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from adapt.bidirectional import make_bidirectional
from adapt.objectives.masking import IGNORE_INDEX, LabeledPositionsLM, mask_batch
from tests.tiny import tiny_decoder

VOCAB = 320
MASK_ID = 5


@functools.lru_cache(maxsize=None)
def _bench():
    """benchmarks/train_throughput.py as a module (benchmarks/ is not a package)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "train_throughput.py"
    spec = importlib.util.spec_from_file_location("train_throughput", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _model(family="llama", seed=0):
    model = make_bidirectional(tiny_decoder(family, vocab_size=VOCAB, seed=seed))
    return model.train()


def _batch(objective, seed=0, shape=(3, 24)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, VOCAB, shape, generator=g)
    return mask_batch(ids, objective, mask_token_id=MASK_ID, vocab_size=VOCAB, special_ids=[0, 1, 2], ratio=0.3,
                      generator=g)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _shifted(labels):
    """transformers' causal-LM loss shifts labels left by one: give it labels one position to the right."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, 1:] = labels[:, :-1]
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_mntp_loss_and_grads_equal_the_transformers_full_logits_route(family):
    """adapt's head-at-labels MNTP loss == model(input_ids, labels=...).loss, the usual route."""
    inputs, labels = _batch("mntp")
    assert labels[:, -1].eq(IGNORE_INDEX).all()  # MNTP never labels the last position
    fast = _model(family)
    slow = copy.deepcopy(fast)
    loss_fast = LabeledPositionsLM(fast)(input_ids=inputs, labels=labels)["loss"]
    loss_slow = slow(input_ids=inputs, labels=_shifted(labels), use_cache=False).loss
    torch.testing.assert_close(loss_fast, loss_slow, rtol=1e-5, atol=1e-6)
    loss_fast.backward()
    loss_slow.backward()
    g_fast, g_slow = _grads(fast), _grads(slow)
    assert g_fast.keys() == g_slow.keys() and g_fast
    for name in g_fast:
        torch.testing.assert_close(g_fast[name], g_slow[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("objective", ["mlm", "mntp"])
def test_loss_and_grads_equal_full_logits_cross_entropy(objective):
    inputs, labels = _batch(objective, seed=1)
    fast = _model()
    slow = copy.deepcopy(fast)
    loss_fast = LabeledPositionsLM(fast)(input_ids=inputs, labels=labels)["loss"]
    logits = slow(input_ids=inputs, use_cache=False).logits  # (B, T, V): every position
    loss_slow = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss_fast, loss_slow, rtol=1e-5, atol=1e-6)
    loss_fast.backward()
    loss_slow.backward()
    for name, grad in _grads(fast).items():
        torch.testing.assert_close(grad, _grads(slow)[name], rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_autocast_loss_is_close_to_the_fp32_full_logits_loss():
    inputs, labels = _batch("mntp", seed=2)
    model = _model()
    with torch.no_grad():
        reference = model(input_ids=inputs, labels=_shifted(labels), use_cache=False).loss
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fast = LabeledPositionsLM(model)(input_ids=inputs, labels=labels)["loss"]
            slow = model(input_ids=inputs, labels=_shifted(labels), use_cache=False).loss
    assert fast.dtype == torch.float32  # the loss is taken in fp32 even under autocast
    torch.testing.assert_close(fast, slow, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fast, reference, rtol=3e-2, atol=3e-2)


def test_fused_adamw_matches_the_default_adamw():
    """AdamW(fused=True) (benchmarked as adapt-full-*+fused) trains to the same weights as adapt's AdamW."""
    bench = _bench()
    models = [_model(seed=3), None]
    models[1] = copy.deepcopy(models[0])
    optimizers = [bench.adamw([p for p in m.parameters() if p.requires_grad], 1e-3, fused=fused)
                  for m, fused in zip(models, (False, True))]
    assert optimizers[1].defaults.get("fused") is True
    for step in range(3):
        inputs, labels = _batch("mlm", seed=10 + step)
        for model, opt in zip(models, optimizers):
            loss = LabeledPositionsLM(model)(input_ids=inputs, labels=labels)["loss"]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert any(g["weight_decay"] > 0 for g in optimizers[1].param_groups)


def test_flop_count_of_the_benchmark():
    bench = _bench()
    model = tiny_decoder("llama", vocab_size=VOCAB)
    shape = bench.Shape.of(model)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * head_dim
    per_layer = cfg.hidden_size * (2 * cfg.hidden_size + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size
    assert shape.body_linear == cfg.num_hidden_layers * per_layer
    assert shape.vocab == VOCAB and shape.hidden == cfg.hidden_size
    tokens, seq = 64, 16
    full = bench.step_flops(shape, tokens=tokens, seq_len=seq, head_rows=tokens, train_base=True)
    labels = bench.step_flops(shape, tokens=tokens, seq_len=seq, head_rows=19, train_base=True)
    assert full - labels == pytest.approx(6 * shape.hidden * VOCAB * (tokens - 19))
    assert full == pytest.approx(6 * shape.body_linear * tokens + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq * tokens
                                 + 6 * shape.hidden * VOCAB * tokens)
    lora = bench.step_flops(shape, tokens=tokens, seq_len=seq, head_rows=tokens, train_base=False, lora_params=100)
    assert lora < full


def test_benchmark_adapt_runner_takes_a_step_on_a_tiny_model():
    """The benchmark's step is adapt's: it runs, counts the labels mask_batch makes, and trains."""
    bench = _bench()
    import numpy as np

    model = _model(seed=4)
    before = model.get_input_embeddings().weight.detach().clone()
    blocks = np.random.default_rng(0).integers(6, VOCAB, size=(8, 32)).astype(np.uint32)
    runner = bench.AdaptRunner("t", model, bench.adamw(list(model.parameters()), 1e-3, fused=True), blocks, 2,
                               mask_token_id=MASK_ID, special_ids=[0, 1, 2], vocab_size=VOCAB, objective="mntp",
                               ratio=0.25, amp=False, device="cpu", shape=bench.Shape.of(model), train_base=True)
    seconds = runner.run(2)  # (wall, cpu) seconds per step
    assert len(seconds) == 2 and all(wall > 0 and cpu > 0 for wall, cpu in seconds)
    assert runner.labels_per_step == [2 * round(0.25 * 31)] * 2
    assert not torch.equal(before, model.get_input_embeddings().weight)


def test_benchmark_packs_a_given_text_file(tmp_path, tokenizer):
    """--text (gpu_check.sh carries the text, gensim is not there): the file's tokens, packed into blocks."""
    bench = _bench()
    text = tmp_path / "corpus.txt"
    lines = [f"document number {i} talks about encoders made from decoders." for i in range(40)]
    text.write_text("\n".join(lines) + "\n")
    blocks = bench.packed_blocks(tokenizer, 16, tmp_path / "cache", str(text))
    assert blocks.ndim == 2 and blocks.shape[1] == 16 and blocks.shape[0] >= 10
    decoded = tokenizer.decode(blocks.reshape(-1).tolist())
    assert "document number 7 talks about encoders" in decoded and "document number 39" in decoded
