"""adapt convert end to end on tiny models: layout, reload, resume, crashes and bad inputs."""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

from adapt.model.bidirectional import probe
from adapt.pipeline.convert import convert
from adapt.errors import ConfigError, DataError, ModelLoadError, OutputExistsError, TrainingError
from adapt.config.run_folder import checkpoint_dirs
from adapt.objectives.masked import MaskedLM
from adapt.export.sparse import sparse_supported
from adapt.training.loop import Trainer
from tests.tiny import CORPUS


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join([CORPUS] * 6), encoding="utf-8")
    return path


def _run(model_dir, out, corpus, **kw):
    kw.setdefault("preset", "tiny")
    return convert(str(model_dir), out, data=[str(corpus)], show_progress=False, **kw)


def test_convert_layout_and_reload(tiny_model_dir, corpus, tmp_path):
    out = tmp_path / "out"
    result = _run(tiny_model_dir, out, corpus)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["is_causal"] is False
    assert (out / "model.safetensors").exists() and not list(out.glob("*.bin"))
    for f in ["run/config.yaml", "run/metrics.jsonl", "run/summary.json", "run/loss.png", "modules.json"]:
        assert (out / f).exists(), f
    assert checkpoint_dirs(out / "run")
    summary = json.loads((out / "run/summary.json").read_text())
    assert summary["probe_before"]["bidirectional"] and summary["probe_after"]["bidirectional"]
    assert summary["mask_token"]["added"] and summary["steps"] == 4
    assert "eval/mlm_loss" in summary["final_eval"]
    model = AutoModel.from_pretrained(out)
    assert probe(model).bidirectional
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).mask_token == "<mask>"
    assert result.summary["tokens"] == 4 * 2 * 32


def _weights(out):
    return load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("tuning, old_checkpoints", [("full", False), ("lora", False), ("qlora", False),
                                                     ("lora", True)])
def test_resume_after_crash_equals_uninterrupted_run(tiny_model_dir, corpus, tmp_path, monkeypatch, tuning,
                                                     old_checkpoints):
    """Bit for bit. A LoRA/QLoRA checkpoint holds the trained weights only (the frozen base comes from the
    source again); ``old_checkpoints``: the crashed run wrote the whole model, as checkpoints did before."""
    from adapt.training import loop as train
    overrides = ["train.max_steps=6", "train.save_every=2", "tuning.lora_r=4"]
    straight = tmp_path / "straight"
    _run(tiny_model_dir, straight, corpus, tuning=tuning, overrides=overrides)

    crashed = tmp_path / "crashed"
    original = MaskedLM.batch
    calls = {"n": 0}

    def dying_batch(self, blocks, objective, gen, device=None):
        calls["n"] += 1
        if calls["n"] == 4 + 1:  # step 5 begins after the step-4 checkpoint (eval batches excluded below)
            raise RuntimeError("simulated kill")
        return original(self, blocks, objective, gen, device)

    monkeypatch.setattr(Trainer, "evaluate", lambda self: {})
    monkeypatch.setattr(MaskedLM, "batch", dying_batch)
    if old_checkpoints:
        monkeypatch.setattr(train, "keeps_trained_only", lambda model: False)
    with pytest.raises(RuntimeError, match="simulated kill"):
        _run(tiny_model_dir, crashed, corpus, tuning=tuning, overrides=overrides)
    assert [p.name for p in checkpoint_dirs(crashed / "run")] == ["step-000002", "step-000004"]
    assert not (crashed / "model.safetensors").exists()
    saved = _weights(crashed / "run/checkpoints/step-000004")
    base = [k for k in saved if k.endswith("q_proj.weight") or k.endswith("q_proj.base_layer.weight")]
    assert bool(base) == (tuning == "full" or old_checkpoints)
    monkeypatch.undo()  # the resumed run is today's code (evaluation off, as in the crashed run)
    monkeypatch.setattr(Trainer, "evaluate", lambda self: {})
    with pytest.raises(OutputExistsError, match="--resume"):
        _run(tiny_model_dir, crashed, corpus, tuning=tuning, overrides=overrides)
    _run(tiny_model_dir, crashed, corpus, tuning=tuning, overrides=overrides, resume=True)
    a, b = _weights(straight), _weights(crashed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [r["step"] for r in map(json.loads, (crashed / "run/metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == sorted(steps) and len(steps) == len(set(steps)) == 6


@pytest.mark.parametrize("tuning", ["lora", "qlora"])
def test_a_lora_checkpoint_holds_the_trained_weights_only(tiny_model_dir, corpus, tmp_path, tuning):
    """No frozen base weight (not the 4-bit ones either): the adapters and the new mask token's row. A
    checkpoint that lacks one of them, or holds one this run does not train, is refused on --resume, naming it."""
    import re

    from safetensors.torch import save_file

    out = tmp_path / "out"
    _run(tiny_model_dir, out, corpus, tuning=tuning, overrides=["train.max_steps=2", "tuning.lora_r=4"])
    ckpt = checkpoint_dirs(out / "run")[-1]
    saved = _weights(ckpt)
    assert saved and all(re.search(r"\.lora_[AB]\.default\.weight$|\.trainable_tokens_delta\.default$", k) for k in saved)
    assert (ckpt / "model.safetensors").stat().st_size < (tiny_model_dir / "model.safetensors").stat().st_size / 4
    dropped, extra = sorted(saved)[0], "model.base_model.model.model.norm.lora_A.default.weight"
    for state, says in (({k: v for k, v in saved.items() if k != dropped},
                         f"lacks 1 trained weights of this run (e.g. {dropped})"),
                        ({**saved, extra: torch.zeros(4, 4)}, f"holds 1 weights this run does not train (e.g. {extra})")):
        save_file(state, str(ckpt / "model.safetensors"))
        with pytest.raises(TrainingError, match=re.escape(says)):
            _run(tiny_model_dir, out, corpus, tuning=tuning, overrides=["train.max_steps=2", "tuning.lora_r=4"],
                 resume=True)


@pytest.mark.skipif(not sparse_supported(), reason="sparse encoders need sentence-transformers >= 6.2")
def test_a_lora_splade_stage_resumes_exactly_with_its_term_bias_and_idf(tiny_model_dir, tmp_path, monkeypatch):
    """The training module's own state outside the tuned model (the trained term bias, the queries' IDF) is in
    a LoRA checkpoint with the adapters; resumed, the run exports what the uninterrupted one did."""
    from adapt.pipeline.reexport import load_checkpoint_model
    from tests.objectives.test_contrastive import toy_sentences

    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join([CORPUS] * 4 + [" ".join(toy_sentences(40)[i:i + 5]) for i in range(24)]) + "\n")
    preset = tmp_path / "splade.yaml"
    preset.write_text("kind: splade\ndata: {eval_fraction: 0.2}\nexport: {max_seq_length: 64}\n"
                      "train: {max_steps: 4, batch_size: 4, lr: 1.0e-3, warmup_ratio: 0.0, eval_every: 2, eval_batches: 2, "
                      "save_every: 2, log_every: 1}\ncontrastive: {max_length: 32}\n"
                      "splade: {queries: idf, init_active_terms: 20}\ntuning: {method: lora, lora_r: 4}\n")

    def run(out, **kw):
        return convert(str(tiny_model_dir), out, preset=str(preset), data=[str(docs)], show_progress=False, **kw)

    run(tmp_path / "straight")
    original, calls = Trainer.train_step, {"n": 0}

    def dying_step(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kill")
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", dying_step)
    with pytest.raises(RuntimeError, match="simulated kill"):
        run(tmp_path / "crashed")
    ckpt = tmp_path / "crashed/run/checkpoints/step-000002"
    assert {k for k in _weights(ckpt) if ".lora_" not in k and "trainable_tokens" not in k} == {"term_bias", "query_idf"}
    monkeypatch.undo()
    run(tmp_path / "crashed", resume=True)
    files = [p for p in (p.relative_to(tmp_path / "straight") for p in (tmp_path / "straight").rglob("*.safetensors"))
             if p.parts[0] != "run"]
    assert len(files) >= 2  # the backbone and the Dense head that holds the term bias
    for name in files:
        a, b = load_file(str(tmp_path / "straight" / name)), load_file(str(tmp_path / "crashed" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    rebuilt = load_checkpoint_model(tmp_path / "crashed/run/checkpoints/step-000004")
    saved = _weights(tmp_path / "straight/run/checkpoints/step-000004")
    assert torch.equal(rebuilt.term_bias, saved["term_bias"]) and torch.equal(rebuilt.query_idf, saved["query_idf"])


def test_resume_refuses_changed_settings(tiny_model_dir, corpus, tmp_path):
    out = tmp_path / "out"
    _run(tiny_model_dir, out, corpus)
    with pytest.raises(ConfigError, match="train.lr"):
        _run(tiny_model_dir, out, corpus, overrides=["train.lr=0.5"], resume=True)


def test_ctrl_c_saves_a_checkpoint(tiny_model_dir, corpus, tmp_path, monkeypatch):
    calls = {"n": 0}
    original = MaskedLM.batch

    def interrupted(self, blocks, objective, gen, device=None):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return original(self, blocks, objective, gen, device)

    monkeypatch.setattr(MaskedLM, "batch", interrupted)
    out = tmp_path / "out"
    with pytest.raises(TrainingError, match="--resume"):
        _run(tiny_model_dir, out, corpus, overrides=["train.save_every=0", "train.eval_every=0"])
    assert [p.name for p in checkpoint_dirs(out / "run")] == ["step-000003"]


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_model_dir, corpus, tmp_path, monkeypatch):
    from adapt.objectives import masking

    original = masking.LabeledPositionsLM.forward
    calls = {"n": 0}

    def nan_forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls["n"] += 1
        if self.training and calls["n"] >= 4:
            out["loss"] = out["loss"] * float("nan")
        return out

    monkeypatch.setattr(masking.LabeledPositionsLM, "forward", nan_forward)
    out = tmp_path / "out"
    with pytest.raises(TrainingError, match="last good checkpoint is .*step-000002"):
        _run(tiny_model_dir, out, corpus, overrides=["train.eval_every=0"])
    assert not (out / "model.safetensors").exists()


def test_out_holding_another_run_is_refused_unless_overwrite(tiny_model_dir, corpus, tmp_path):
    out = tmp_path / "out"
    _run(tiny_model_dir, out, corpus)
    with pytest.raises(OutputExistsError, match="--overwrite"):
        _run(tiny_model_dir, out, corpus)
    _run(tiny_model_dir, out, corpus, overwrite=True)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        _run(tiny_model_dir, other, corpus)
    assert (other / "notes.txt").read_text() == "mine"


def test_bad_inputs(tiny_model_dir, corpus, tmp_path):
    with pytest.raises(ModelLoadError):
        _run(tmp_path / "missing-model", tmp_path / "o1", corpus)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="empty"):
        _run(tiny_model_dir, tmp_path / "o2", empty)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good line\nanother\n\xff\xfe broken\n")
    with pytest.raises(DataError, match=r"bad.txt:3: not valid UTF-8"):
        _run(tiny_model_dir, tmp_path / "o3", bad)
    with pytest.raises(ConfigError, match="no training text"):
        convert(str(tiny_model_dir), tmp_path / "o4", preset="tiny", show_progress=False)


@pytest.mark.parametrize("schedule", ["mntp", "clm", "{mlm: 0.5, clm: 0.5}", "[{objective: clm, until: 0.5}, {objective: mlm, until: 1.0}]"])
def test_objectives_and_schedules_run(tiny_model_dir, corpus, tmp_path, schedule):
    out = tmp_path / "out"
    result = _run(tiny_model_dir, out, corpus, overrides=[f"objective.schedule={schedule}"])
    assert result.summary["probe_after"]["bidirectional"]
    records = [json.loads(line) for line in (out / "run/metrics.jsonl").read_text().splitlines()]
    used = {r["objective"] for r in records if "objective" in r}
    expected = {"mntp"} if schedule == "mntp" else {"clm"} if schedule == "clm" else {"clm", "mlm"}
    assert used <= expected and (used == expected or schedule.startswith("{"))


@pytest.mark.parametrize("family", ["gpt2", "qwen3", "gemma2", "phi3"])
def test_convert_other_families(family, tmp_path, corpus, tokenizer):
    from tests.tiny import tiny_decoder

    src = tmp_path / family
    tiny_decoder(family, vocab_size=len(tokenizer)).save_pretrained(src)
    tokenizer.save_pretrained(src)
    result = _run(src, tmp_path / "out", corpus, tuning="lora")
    assert result.summary["probe_after"]["bidirectional"]
    assert (tmp_path / "out/run/adapter/adapter_model.safetensors").exists()


def test_qlora_conversion_merges_into_unquantized_base(corpus, tmp_path, tokenizer):
    from tests.tiny import tiny_decoder

    # bitsandbytes' CPU inference kernel needs in_features >= its 64-value block: hidden 64, not 32
    src = tmp_path / "llama64"
    tiny_decoder("llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128).save_pretrained(src)
    tokenizer.save_pretrained(src)
    out = tmp_path / "q"
    result = _run(src, out, corpus, tuning="qlora", overrides=["tuning.lora_r=4"])
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["is_causal"] is False
    assert result.summary["probe_after"]["bidirectional"]
    weights = _weights(out)
    assert all(v.dtype in (torch.float32, torch.bfloat16) for v in weights.values())
    assert (out / "run/adapter/adapter_model.safetensors").exists()


def test_trackers_reach_tensorboard(tiny_model_dir, corpus, tmp_path):
    """`train.trackers` reaches the Accelerator the runner builds: TensorBoard gets the loss and eval metrics."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    _run(tiny_model_dir, out, corpus, overrides=["train.trackers=[tensorboard]"])
    events = sorted((out / "run" / "adapt").glob("events.out.tfevents.*"))  # the run's scalars (hparams: a subfolder)
    assert events, "no TensorBoard event file under run/adapt/"
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "lr", "eval/mlm_loss", "eval/mlm_acc"} <= tags, tags
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4]  # the tiny preset logs every step
    assert [e.step for e in acc.Scalars("eval/mlm_loss")] == [2, 4]


def test_the_loss_plot_says_what_each_curve_is_and_draws_the_terms():
    """Not "cross-entropy" for every run: the curve is named by the objective (InfoNCE + keep_source), and a
    loss with several terms gets them plotted below."""
    from adapt.training.loop import loss_figure

    records = [{"step": s, "loss": 3.0 - s / 10, "loss_name": "InfoNCE + keep_source", "loss/infonce": 2.5 - s / 10,
                "loss/keep_source": 0.5} for s in range(1, 6)] + [{"step": 5, "eval/crops_loss": 2.0}]
    fig = loss_figure(records)
    top, below = fig.axes
    assert [t.get_text() for t in top.get_legend().get_texts()] == ["train: InfoNCE + keep_source",
                                                                     "held out: crops_loss"]
    assert top.get_ylabel() == "InfoNCE + keep_source" and "cross-entropy" not in top.get_ylabel()
    assert [t.get_text() for t in below.get_legend().get_texts()] == ["infonce", "keep_source"]
    assert list(below.lines[1].get_ydata()) == [0.5] * 5
    masked = loss_figure([{"step": 1, "loss": 5.0, "loss_name": "cross-entropy", "objective": "mlm"}])
    assert len(masked.axes) == 1 and masked.axes[0].get_ylabel() == "cross-entropy"
    assert loss_figure([{"step": 1, "loss": float("nan")}]) is None
