"""Correctness of the training-speed levers measured by benchmarks/tools/train_throughput.py, and proof that the
benchmark times adapt's own training step.

Each optimised path of the library must give what the unoptimised one gives: the LM head only at labelled
positions (adapt.objectives.masking.LabeledPositionsLM) against transformers' full-logits causal-LM loss (loss and
gradients), under fp32 and under the Accelerator's bf16 autocast; adapt.training.loop.build_optimizer's fused AdamW against
torch's default AdamW over the same groups; and the benchmark's FLOP accounting. The benchmark's adapt runner must
run adapt.training.loop.Trainer.train_step, and train exactly as a step run directly through the Trainer.
"""
from __future__ import annotations

import copy
import functools
import importlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adapt.model.bidirectional import make_bidirectional
from adapt.config.settings import DataConfig, ObjectiveConfig, RunConfig, TrainConfig
from adapt.data.token_store import TokenStore
from adapt.model.loading import setup_mask_token
from adapt.objectives.masked import MaskedLM
from adapt.objectives.masking import IGNORE_INDEX, LabeledPositionsLM, mask_batch
from adapt.training.loop import Trainer, build_accelerator, build_optimizer
from tests.tiny import tiny_decoder, tiny_tokenizer

VOCAB = 320
MASK_ID = 5


@functools.lru_cache(maxsize=None)
def _bench():
    """benchmarks/tools/train_throughput.py, imported when a test needs it (it imports torch and the loop)."""
    return importlib.import_module("benchmarks.tools.train_throughput")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps one process-wide state; a bf16 Accelerator here must not outlive its test."""
    from accelerate.state import AcceleratorState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)


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


def test_benchmark_full_logits_lever_trains_adapts_mntp_loss():
    """The benchmark's head="full" module (transformers' loss, logits everywhere) == LabeledPositionsLM on MNTP."""
    bench = _bench()
    inputs, labels = _batch("mntp", seed=5)
    fast = _model()
    slow = copy.deepcopy(fast)
    loss_fast = LabeledPositionsLM(fast)(input_ids=inputs, labels=labels)["loss"]
    loss_slow = bench.FullLogitsLM(slow)(input_ids=inputs, labels=labels)["loss"]
    torch.testing.assert_close(loss_fast, loss_slow, rtol=1e-5, atol=1e-6)
    loss_fast.backward()
    loss_slow.backward()
    for name, grad in _grads(fast).items():
        torch.testing.assert_close(grad, _grads(slow)[name], rtol=1e-4, atol=1e-6, msg=name)
    assert isinstance(bench.FullLogitsMaskedLM(RunConfig(kind="mntp")).module(slow), bench.FullLogitsLM)


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


def test_the_accelerators_bf16_runs_labeled_positions_lm_under_autocast(tmp_path):
    """train.mixed_precision=bf16 (what adapt-*-bf16 runs): the prepared module's forward is autocast, loss in fp32."""
    inputs, labels = _batch("mntp", seed=6)
    model = _model()
    with torch.no_grad():
        reference = LabeledPositionsLM(model)(input_ids=inputs, labels=labels)["loss"]
    acc = build_accelerator(TrainConfig(mixed_precision="bf16"), tmp_path)
    module = acc.prepare(LabeledPositionsLM(model))
    seen = set()
    model.get_input_embeddings().register_forward_pre_hook(lambda m, a: seen.add(torch.is_autocast_enabled("cpu")))
    with torch.no_grad():
        loss = module(input_ids=inputs, labels=labels)["loss"]
    assert seen == {True} and loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=3e-2, atol=3e-2)


def test_build_optimizer_is_fused_and_trains_as_torchs_default_adamw():
    """adapt.training.loop.build_optimizer (fused AdamW, adapt's groups) == torch's default AdamW over the same groups, which
    is the benchmark's foreach lever (adapt-full-bf16)."""
    bench = _bench()
    train = TrainConfig(lr=1e-3, weight_decay=0.01)
    models = [_model(seed=3), None]
    models[1] = copy.deepcopy(models[0])
    optimizers = [build_optimizer(models[0], train), bench.foreach_adamw(build_optimizer(models[1], train))]
    assert bench.is_fused(optimizers[0]) and not bench.is_fused(optimizers[1])
    for opt in optimizers:
        decay, no_decay = opt.param_groups
        assert decay["weight_decay"] == 0.01 and all(p.ndim >= 2 for p in decay["params"])
        assert no_decay["weight_decay"] == 0.0 and all(p.ndim < 2 for p in no_decay["params"]) and no_decay["params"]
        assert opt.defaults["lr"] == 1e-3
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


def _masked_model_and_store():
    """A tiny bidirectional decoder with a mask token (as the benchmark prepares its model) and a token store."""
    tokenizer = tiny_tokenizer()
    model = _model(seed=4)
    setup_mask_token(model, tokenizer, "auto")
    blocks = np.random.default_rng(0).integers(6, VOCAB - 1, size=(8, 32)).astype(np.uint32)  # no special tokens
    return model, tokenizer, TokenStore(Path("unused"), blocks, blocks[:0], {})


def _direct_steps(model, tokenizer, store, run_dir, steps):
    """``steps`` optimizer steps straight through adapt's Trainer, as Trainer.fit takes them."""
    cfg = RunConfig(kind="mntp", objective=ObjectiveConfig(schedule="mntp", mask_ratio=0.25), data=DataConfig(seq_len=32),
                    train=TrainConfig(max_steps=1000, batch_size=2, lr=5e-5, warmup_ratio=0.0, scheduler="constant"))
    objective = MaskedLM(cfg)
    objective.configure_model(model, tokenizer)
    objective.store = store
    acc = build_accelerator(cfg.train, run_dir)
    trainer = Trainer(model, objective, train=cfg.train, run_dir=run_dir, accelerator=acc, show_progress=False)
    objective.start(0, acc)
    trainer.module.train()
    for _ in range(steps):
        trainer.train_step()
        trainer.scheduler.step()
        trainer.step += 1


def _runner(bench, model, tokenizer, store, run_dir, **kw):
    kw = {"amp": False, **kw}
    return bench.AdaptRunner("t", model, tokenizer, store, objective="mntp", ratio=0.25, batch=2, device="cpu",
                             shape=bench.Shape.of(model), train_base=True, run_dir=run_dir, **kw)


def test_benchmark_adapt_runner_times_the_trainers_own_step(tmp_path, monkeypatch):
    """adapt-* rows time adapt.training.loop.Trainer.train_step: the runner calls it once a step, and its steps train the
    weights exactly as steps taken directly through the Trainer do (same objective, data, masks, optimizer)."""
    bench = _bench()
    model, tokenizer, store = _masked_model_and_store()
    direct = copy.deepcopy(model)
    before = model.get_input_embeddings().weight.detach().clone()
    calls = []
    original = Trainer.train_step

    def counted(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", counted)
    runner = _runner(bench, model, tokenizer, store, tmp_path / "bench")
    assert runner.fused and runner.trainer.optimizer.optimizer.defaults["fused"]  # build_optimizer's, as adapt ships
    seconds = runner.run(2)  # (wall, cpu) seconds per step
    assert len(calls) == 2 and all(t is runner.trainer for t in calls)
    assert len(seconds) == 2 and all(wall > 0 and cpu > 0 for wall, cpu in seconds)
    assert runner.labels_per_step == [2 * round(0.25 * 31)] * 2  # the labels the step's module got
    assert len(runner.data_seconds) == 2 and all(0 < d < wall for d, (wall, _) in zip(runner.data_seconds, seconds))
    assert not torch.equal(before, model.get_input_embeddings().weight)

    monkeypatch.setattr(Trainer, "train_step", original)
    _direct_steps(direct, tokenizer, store, tmp_path / "direct", 2)
    for (name, a), (_, b) in zip(model.named_parameters(), direct.named_parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("lever", ["bf16", "full", "foreach"])
def test_benchmark_levers_run_on_adapts_trainer(tmp_path, monkeypatch, lever):
    """The levers change one thing of the same Trainer: bf16 autocast (checked inside the model at every step), the
    full-logits head, torch's default AdamW."""
    bench = _bench()
    model, tokenizer, store = _masked_model_and_store()
    calls = []
    original = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: calls.append(1) or original(self))
    kw = {"bf16": {"amp": True}, "full": {"head": "full"}, "foreach": {"optimizer": "foreach"}}[lever]
    runner = _runner(bench, model, tokenizer, store, tmp_path, **kw)
    runner.run(1)
    assert calls == [1]
    assert isinstance(runner.trainer.module, bench.FullLogitsLM) == (lever == "full")
    assert runner.fused == (lever != "foreach")
    assert runner.trainer.scheduler.optimizer is runner.trainer.optimizer.optimizer
    assert runner.flops_per_step == bench.step_flops(
        bench.Shape.of(model), tokens=64, seq_len=32, train_base=True,
        head_rows=64 if lever == "full" else runner.labels_per_step[0])
    shared = _runner(bench, model, tokenizer, store, tmp_path / "shared", share=runner)
    assert shared.trainer.optimizer is runner.trainer.optimizer
    runner.close()
    assert runner.trainer is None


def test_llm2vec_interpreter_comes_only_from_the_flag_or_the_environment(tmp_path, monkeypatch):
    bench = _bench()
    monkeypatch.delenv("LLM2VEC_PYTHON", raising=False)
    assert bench.parse_args([]).llm2vec_python is None
    path, why = bench.llm2vec_interpreter(None)
    assert path is None and "--llm2vec-python" in why and "LLM2VEC_PYTHON" in why
    path, why = bench.llm2vec_interpreter(str(tmp_path / "nope" / "python"))
    assert path is None and "nope" in why
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv("LLM2VEC_PYTHON", str(python))
    assert bench.llm2vec_interpreter(bench.parse_args([]).llm2vec_python) == (str(python), "")


def test_benchmark_packs_a_given_text_file(tmp_path, tokenizer):
    """--text (gpu_check.sh carries the text, gensim is not there): the file's tokens, packed into blocks."""
    bench = _bench()
    text = tmp_path / "corpus.txt"
    lines = [f"document number {i} talks about encoders made from decoders." for i in range(40)]
    text.write_text("\n".join(lines) + "\n")
    store = bench.token_store(tokenizer, 16, tmp_path / "cache", str(text))
    blocks = np.asarray(store.train)
    assert len(store.eval) == 0 and store.seq_len == 16  # everything trains
    assert blocks.ndim == 2 and blocks.shape[1] == 16 and blocks.shape[0] >= 10
    decoded = tokenizer.decode(blocks.reshape(-1).tolist())
    assert "document number 7 talks about encoders" in decoded and "document number 39" in decoded
