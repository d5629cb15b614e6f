"""``contrastive.keep_source``: the loss keeps the batch's pooled vectors close (linear CKA) to the stage's source's,
and the source is the source: its starting weights (LoRA switched off, or a frozen copy) with the attention it had."""
import json
from types import SimpleNamespace

import pytest
import torch

from adapt.model.bidirectional import is_bidirectional
from adapt.config.settings import RunConfig
from adapt.model.embedding import Embedder
from adapt.errors import ConfigError
from adapt.objectives import StageContext, build_objective
from adapt.objectives.infonce import linear_cka
from adapt.pipeline.stage import load_model, run_stage
from adapt.model.tuning import apply_tuning
from tests.objectives.test_contrastive import _cfg, _documents
from tests.tiny import tiny_decoder


def test_linear_cka_reads_shared_information_not_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    scaled = x * torch.tensor([1e3, 1, 1, 5, 1, 1, 0.01, 1]) + 7  # per-dimension scale and shift: the same content
    assert linear_cka(x, x).item() == pytest.approx(1.0, abs=1e-5)
    assert linear_cka(x, scaled).item() == pytest.approx(1.0, abs=1e-4)
    noisy = linear_cka(x, x + 0.3 * torch.randn(128, 8, generator=g)).item()
    unrelated = linear_cka(x, torch.randn(128, 8, generator=g)).item()
    assert noisy > 0.8 > 0.3 > unrelated >= 0
    # wider on one side (the source's 576 against a smaller student) is fine, and the gradient reaches x
    x.requires_grad_(True)
    (1 - linear_cka(x, torch.cat([x.detach(), torch.randn(128, 4, generator=g)], dim=1))).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def _crops_cfg(model_dir, tmp_path, **sections):
    corpus = tmp_path / "docs.txt"
    corpus.write_text(_documents(), encoding="utf-8")
    contrastive = {"loss": "crops", "dropout": 0.0, "max_length": 24, "keep_source": 1.0,
                   **sections.pop("contrastive", {})}
    cfg = _cfg(model_dir, data={"sources": [str(corpus)]}, contrastive=contrastive,
               train={"max_steps": 2, "eval_every": 2, "save_every": 2}, **sections)
    return RunConfig.from_dict({**cfg.to_dict(), "kind": "crops"})


def _texts_as_chunks(objective, texts):
    sunk, skips = objective.sunk(texts, len(texts))
    chunks, _ = objective.chunks(sunk, "cpu", skips)
    return chunks


@pytest.mark.parametrize("family,method", [("llama", "lora"), ("qwen3", "lora"), ("llama", "full")])
def test_the_source_is_the_causal_decoder_while_the_encoder_trains(tokenizer, tmp_path, family, method):
    from transformers import AutoModel

    model_dir = tmp_path / "model"
    tiny_decoder(family, vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    lora = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0}  # no dropout: two forwards give the same vectors
    cfg = _crops_cfg(model_dir, tmp_path, tuning={"method": method, **lora}, export={"sink_prompt": "\n"})
    objective = build_objective(cfg)
    objective.read_data()
    acc = SimpleNamespace(device=torch.device("cpu"), autocast=lambda: torch.autocast("cpu", enabled=False),
                          unwrap_model=lambda m: m)
    model, tok, new_ids = load_model(cfg, objective)
    objective.prepare(StageContext(model, tok, tmp_path, acc, False))
    model = apply_tuning(model, cfg.tuning, new_token_ids=new_ids)
    module = objective.module(model).train()
    with torch.no_grad():  # the encoder moves away from the source, as training would move it
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    chunks = _texts_as_chunks(objective, ["The quick brown fox jumps over the lazy dog.", "fox", "An encoder."])
    with torch.no_grad():
        before = torch.cat([module(**c) for c in chunks])
        source = objective.source_embeddings(module, acc, chunks)
        after = torch.cat([module(**c) for c in chunks])
        causal = Embedder(AutoModel.from_pretrained(str(model_dir)).eval(), "mean")  # the decoder as shipped
        expected = torch.cat([causal(**c) for c in chunks])
    torch.testing.assert_close(source, expected, atol=1e-5, rtol=1e-4)
    assert (before - source).abs().max() > 1e-2  # the encoder's vectors are not the source's
    torch.testing.assert_close(after, before)  # nothing of the source's forward stays behind
    assert module.training and is_bidirectional(model)
    assert objective.source_causal is True


def test_the_term_is_its_weight_times_one_minus_cka(tiny_model_dir, tmp_path):
    objective = build_objective(_crops_cfg(tiny_model_dir, tmp_path, contrastive={"keep_source": 0.5}))
    g = torch.Generator().manual_seed(0)
    embeddings, source = torch.randn(8, 16, generator=g), torch.randn(8, 32, generator=g)
    inverse = torch.tensor([3, 2, 1, 0, 7, 6, 5, 4])
    keys = list(range(4))
    plain, _ = objective.loss_fn(4, keys, keys, inverse, gather=False)(embeddings)
    kept, _ = objective.loss_fn(4, keys, keys, inverse, gather=False, source=source)(embeddings)
    assert kept.item() == pytest.approx(plain.item() + 0.5 * (1 - linear_cka(embeddings, source).item()), abs=1e-5)


def test_a_stage_keeping_its_source_trains_otherwise_and_records_it(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    lora = {"method": "lora", "lora_r": 4, "lora_alpha": 8}
    runs = {}
    for keep in (0.0, 5.0):
        cfg = _crops_cfg(tiny_model_dir, tmp_path, contrastive={"keep_source": keep}, tuning=lora)
        out = tmp_path / f"keep{keep}"
        run_stage(cfg, out, show_progress=False)
        runs[keep] = load_file(str(out / "model.safetensors"))
        summary = json.loads((out / "run" / "summary.json").read_text())
        stage = json.dumps(summary)
        assert ('"keep_source": 5.0' in stage and '"source_attention": "causal"' in stage) == bool(keep), stage
        evals = [r for r in map(json.loads, (out / "run" / "metrics.jsonl").read_text().splitlines())
                 if "eval/crops_loss" in r]
        assert evals and all(("eval/source_cka" in r) == bool(keep) for r in evals)
        assert all(0 < r["eval/source_cka"] <= 1 for r in evals if keep)
        logged = [r for r in map(json.loads, (out / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        assert logged and all(r["loss_name"] == ("InfoNCE + keep_source" if keep else "InfoNCE") for r in logged)
        for r in logged:  # the plot's terms: logged only when there are several, and they add up to the loss
            assert ("loss/keep_source" in r) == bool(keep)
            if keep:
                assert r["loss/infonce"] + r["loss/keep_source"] == pytest.approx(r["loss"], rel=1e-5)
    assert any((runs[0.0][k] - runs[5.0][k]).abs().max() > 1e-6 for k in runs[0.0])  # the term changed training


def test_keep_source_errors(tiny_model_dir, tmp_path):
    from accelerate.utils import DistributedType

    with pytest.raises(ConfigError, match="keep_source must be a weight"):
        _crops_cfg(tiny_model_dir, tmp_path, contrastive={"keep_source": -1})
    with pytest.raises(ConfigError, match="SPLADE"):
        build_objective(RunConfig.from_dict({**_crops_cfg(tiny_model_dir, tmp_path).to_dict(), "kind": "splade"}))
    objective = build_objective(_crops_cfg(tiny_model_dir, tmp_path))
    objective.read_data()
    for engine in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(ConfigError, match="use DDP"):
            objective.check_launch(SimpleNamespace(distributed_type=engine, num_processes=1))
