"""``contrastive.mini_batch: auto``: gradient caching chosen from the model's shape and the free memory, as the
default preset asks for it (64 documents, 128 texts of 128 tokens, do not fit 24 GiB on a 135M decoder without
caching: benchmarks/results/default_preset_memory.md)."""
from types import SimpleNamespace

import pytest
import torch
import yaml
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from adapt.config.settings import RunConfig, build_config
from adapt.errors import ConfigError
from adapt.objectives import build_objective, contrastive
from adapt.objectives.infonce import MEMORY_SHARE, auto_mini_batch, estimate_text_bytes
from adapt.pipeline.stage import run_stage
from tests.tiny import tiny_decoder

GIB = 2 ** 30
WORDS = ["fox", "river", "engine", "violin", "garden", "planet", "market", "winter", "castle", "doctor", "island",
         "bridge", "pencil", "tiger", "rocket", "coffee"]


def _documents(path, n=16):
    path.write_text("\n\n".join(" ".join(WORDS[(i + j) % 16] for j in range(24)) + f" number {i}." for i in range(n))
                    + "\n", encoding="utf-8")
    return path


def _cfg(model_dir, corpus, **contrastive_settings):
    return RunConfig.from_dict({
        "kind": "crops", "model": {"source": str(model_dir)}, "data": {"sources": [str(corpus)], "eval_fraction": 0.2},
        "tuning": {"method": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "train": {"max_steps": 2, "batch_size": 6, "lr": 1e-2, "warmup_ratio": 0.0, "eval_every": 0,
                  "eval_batches": 1, "save_every": 0},
        "contrastive": {"loss": "crops", "max_length": 32, "dropout": 0.0, "keep_source": 1.0, **contrastive_settings},
        "export": {"pooling": "mean", "max_seq_length": 64}})


def test_the_config_takes_auto_a_number_or_zero():
    assert build_config("default").contrastive.mini_batch == "auto"  # the no-preset recipe caches where needed
    assert build_config("tiny", ["contrastive.mini_batch=auto"]).contrastive.mini_batch == "auto"
    assert build_config("tiny", ["contrastive.mini_batch=16"]).contrastive.mini_batch == 16
    cfg = build_config("tiny", ["contrastive.mini_batch=auto"])
    assert RunConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
    for bad in ("big", "-1", "1.5", "true"):
        with pytest.raises(ConfigError, match="contrastive.mini_batch"):
            build_config("tiny", [f"contrastive.mini_batch={bad}"])


def test_auto_caches_a_big_step_and_not_one_that_fits():
    config = SimpleNamespace(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                             vocab_size=128256)  # Llama-3.2-1B's shape
    per_text = estimate_text_bytes(config, max_length=128, element_size=4)
    assert 0.93 * GIB < per_text < 1.5 * GIB  # measured: 0.93 GiB more peak RSS a text at 128 tokens (float32)
    chunk = auto_mini_batch(texts=128, per_text_bytes=per_text, free_bytes=22 * GIB)
    assert chunk in (8, 16, 32) and chunk & (chunk - 1) == 0  # a power of two that fits, well under the step
    assert auto_mini_batch(texts=128, per_text_bytes=per_text, free_bytes=2000 * GIB) == 0  # all fits: no caching
    assert auto_mini_batch(texts=128, per_text_bytes=per_text, free_bytes=GIB // 2) == 1  # nothing fits: one a chunk
    assert auto_mini_batch(texts=128, per_text_bytes=per_text, free_bytes=22 * GIB, fixed_bytes=15 * GIB) < chunk
    # gradient checkpointing keeps one layer's values, not sixteen; shorter texts hold less
    assert estimate_text_bytes(config, max_length=128, element_size=4, checkpointing=True) < per_text / 8
    assert estimate_text_bytes(config, max_length=32, element_size=4) == pytest.approx(per_text / 4, rel=1e-6)


def test_auto_resolves_when_the_stage_starts_and_trains_as_without_caching(tiny_model_dir, tmp_path, monkeypatch):
    """Little memory: auto caches (the step's 12 texts in chunks), the summary says so, and the trained weights
    equal those of the same run without caching."""
    corpus = _documents(tmp_path / "docs.txt")
    calls, backward = [], contrastive.contrastive_backward

    def spy(module, chunks, loss_fn, **kw):
        calls.append((len(chunks), kw["cache"]))
        return backward(module, chunks, loss_fn, **kw)

    monkeypatch.setattr(contrastive, "contrastive_backward", spy)
    room = _room_for(6)  # built before the run: the tiny model it measures would reseed torch in the run
    monkeypatch.setattr(contrastive, "free_memory", lambda device, processes=1: room)
    cached = run_stage(_cfg(tiny_model_dir, corpus, mini_batch="auto"), tmp_path / "auto", show_progress=False).summary
    assert cached["mini_batch"] == cached["mini_batch_auto"]["chose"] == 4
    assert cached["mini_batch_auto"]["texts_per_step"] == 12 and cached["mini_batch_auto"]["free_gib"] == 0.0
    assert calls == [(3, True)] * 2  # each step's 12 texts in 3 cached chunks
    plain = run_stage(_cfg(tiny_model_dir, corpus, mini_batch=0), tmp_path / "plain", show_progress=False).summary
    assert plain["mini_batch"] == 0 and "mini_batch_auto" not in plain and calls[2:] == [(1, False)] * 2
    assert plain["tokens"] == cached["tokens"]
    a, b = load_file(str(tmp_path / "auto/model.safetensors")), load_file(str(tmp_path / "plain/model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


def _room_for(texts: int) -> int:
    """Free bytes in which ``mini_batch: auto`` fits the tiny Llama's weights and ``texts`` texts at max_length 32."""
    model = tiny_decoder("llama", vocab_size=320)
    per_text = estimate_text_bytes(model.config, max_length=32, element_size=4)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return int((per_text * (texts + 0.5) + weights) / MEMORY_SHARE)


def _launched(cfg, distributed_type=DistributedType.NO):
    objective = build_objective(cfg)
    objective.read_data()
    acc = SimpleNamespace(distributed_type=distributed_type, num_processes=1, device=torch.device("cpu"))
    objective.check_launch(acc)
    return objective, acc


def test_auto_does_not_cache_a_step_that_fits(tiny_model_dir, tmp_path, monkeypatch):
    objective, acc = _launched(_cfg(tiny_model_dir, _documents(tmp_path / "docs.txt"), mini_batch="auto"))
    model = tiny_decoder("llama", vocab_size=320)  # the size of the tiny_model_dir's: _room_for counts its weights
    for free, chose in ((64 * GIB, 0), (_room_for(12), 0), (_room_for(11), 8), (_room_for(6), 4), (0, 1)):
        monkeypatch.setattr(contrastive, "free_memory", lambda device, processes=1: free)
        objective.resolve_mini_batch(model, acc)
        assert objective.mini_batch == objective.summary()["mini_batch_auto"]["chose"] == chose


@pytest.mark.parametrize("precision, distributed", [("fp16", DistributedType.NO), ("no", DistributedType.DEEPSPEED)])
def test_auto_never_turns_on_caching_where_it_is_refused(tiny_model_dir, tmp_path, monkeypatch, caplog, precision,
                                                         distributed):
    """fp16 loss scaling and DeepSpeed refuse gradient caching: auto launches, picks none and warns when the step
    may not fit; an explicit mini_batch is still refused there."""
    corpus = _documents(tmp_path / "docs.txt")
    raw = _cfg(tiny_model_dir, corpus, mini_batch="auto", keep_source=0.0).to_dict()
    raw["train"]["mixed_precision"] = precision
    objective, acc = _launched(RunConfig.from_dict(raw), distributed)
    room = _room_for(6)
    monkeypatch.setattr(contrastive, "free_memory", lambda device, processes=1: room)
    objective.resolve_mini_batch(tiny_decoder("llama", vocab_size=320), acc)
    assert objective.mini_batch == 0 and "gradient caching is refused" in caplog.text
    raw["contrastive"]["mini_batch"] = 4
    with pytest.raises(ConfigError, match="gradient caching"):
        _launched(RunConfig.from_dict(raw), distributed)


def test_a_splade_stage_counts_its_vocabulary_logits_and_records_the_choice(tiny_model_dir, tmp_path, monkeypatch):
    """SPLADE runs the LM head on every token (logits over the vocabulary): auto counts them, and its summary (its
    own) records the choice too."""
    raw = _cfg(tiny_model_dir, _documents(tmp_path / "docs.txt"), mini_batch="auto", keep_source=0.0).to_dict()
    raw["kind"] = "splade"
    splade, acc = _launched(RunConfig.from_dict(raw))
    dense, _ = _launched(_cfg(tiny_model_dir, _documents(tmp_path / "docs.txt"), mini_batch="auto"))
    model, room = tiny_decoder("llama", vocab_size=320), _room_for(11)
    monkeypatch.setattr(contrastive, "free_memory", lambda device, processes=1: room)
    for objective in (splade, dense):
        objective.resolve_mini_batch(model, acc)
    assert 0 < splade.mini_batch < dense.mini_batch == 8
    assert splade.summary()["mini_batch_auto"]["chose"] == splade.mini_batch
