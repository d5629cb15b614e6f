"""Chained stages on tiny models: MLM then SimCSE into one encoder, crash and resume, plans and their errors."""
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from adapt.model.bidirectional import probe
from adapt.training.loop import Trainer
from adapt.errors import ConfigError, DataError, OutputExistsError
from adapt.config.settings import load_preset
from adapt.objectives import build_objective, kinds
from adapt.config.preset_files import list_presets
from adapt.pipeline.chain import plan_stages, run_stages
from tests.objectives.test_contrastive import toy_sentences
from tests.tiny import CORPUS
from tests.procs import failure


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join([CORPUS] * 4 + toy_sentences(40)), encoding="utf-8")
    return path


def _run(model_dir, out, corpus, **kw):
    kw.setdefault("preset", "tiny-stages")
    return run_stages(str(model_dir), out, data=[str(corpus)], show_progress=False, **kw)


def test_mlm_then_simcse_gives_one_bidirectional_encoder(tiny_model_dir, corpus, tmp_path):
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "out"
    result = _run(tiny_model_dir, out, corpus, stages="mlm,simcse")
    assert [s.name for s in result.stages] == ["1-mlm", "2-simcse"]
    for name in ["1-mlm", "2-simcse"]:
        assert (out / "stages" / name / "run/summary.json").exists() and (out / "stages" / name / "modules.json").exists()
    assert (out / "config.json").exists() and (out / "modules.json").exists()
    st = SentenceTransformer(str(out), device="cpu")
    assert st.encode(["A decoder became an encoder."]).shape == (1, 32)
    assert probe(st[0].auto_model).bidirectional and result.summary["probe_after"]["bidirectional"]
    # stage 2 trained from stage 1's merged encoder, and OUT is stage 2's encoder
    simcse = result.summary["per_stage"]["2-simcse"]
    assert simcse["source"] == str(out / "stages/1-mlm") and simcse["steps"] == 4 and simcse["mini_batch"] == 3
    assert "eval/simcse_loss" in simcse["final_eval"]
    w1, w2, final = (load_file(str(p / "model.safetensors")) for p in (out / "stages/1-mlm", out / "stages/2-simcse", out))
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    for k in w2:
        torch.testing.assert_close(w2[k], final[k])
    # OUT/run/config.yaml is a preset that plans the same chain again
    again = plan_stages(str(tiny_model_dir), tmp_path / "again", preset=str(out / "run/config.yaml"))
    for a, b in zip(again, result.stages):
        da, db = a.config.to_dict(), b.config.to_dict()
        da["model"].pop("source"), db["model"].pop("source")
        assert da == db
    assert yaml.safe_load((out / "run/config.yaml").read_text())["stages"][0] == "mlm"


def test_crash_in_stage_2_then_resume_skips_stage_1(tiny_model_dir, corpus, tmp_path, monkeypatch):
    original, calls = Trainer.train_step, {"n": 0}

    def dying(self):
        calls["n"] += self.objective.kind == "simcse"  # the loop is shared: count stage 2's steps only
        if calls["n"] == 3:  # after the step-2 checkpoint
            raise RuntimeError("simulated kill")
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", dying)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated kill"):
        _run(tiny_model_dir, out, corpus)
    assert (out / "stages/1-mlm/run/summary.json").exists()
    assert (out / "stages/2-simcse/run/checkpoints/step-000002").is_dir()
    assert not (out / "modules.json").exists()
    monkeypatch.setattr(Trainer, "train_step", original)
    with pytest.raises(OutputExistsError, match="--resume"):
        _run(tiny_model_dir, out, corpus)
    with pytest.raises(ConfigError, match="2-simcse.*contrastive.temperature"):
        _run(tiny_model_dir, out, corpus, overrides=["simcse.contrastive.temperature=0.1"], resume=True)
    stage1 = (out / "stages/1-mlm/model.safetensors").stat().st_mtime_ns

    def no_mlm(*args, **kwargs):
        raise AssertionError("the finished MLM stage ran again")

    monkeypatch.setattr("adapt.pipeline.convert.convert", no_mlm)
    result = _run(tiny_model_dir, out, corpus, resume=True)
    assert (out / "stages/1-mlm/model.safetensors").stat().st_mtime_ns == stage1
    records = [json.loads(x) for x in (out / "stages/2-simcse/run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert result.summary["per_stage"]["2-simcse"]["steps"] == 4 and (out / "modules.json").exists()


def test_plan_applies_preset_stages_and_per_stage_overrides(tmp_path):
    out = tmp_path / "out"
    plan = plan_stages("org/model", out, preset="llm2vec", data=["corpus.txt"],
                       overrides=["train.lr=1e-4", "simcse.train.max_steps=7", "1.train.batch_size=3"])
    mntp, simcse = plan
    assert (mntp.name, simcse.name) == ("1-mntp", "2-simcse")
    assert mntp.config.objective.schedule == "mntp" and mntp.config.model.source == "org/model"
    assert mntp.config.train.batch_size == 3 and mntp.config.train.max_steps == 1000
    assert simcse.config.train.batch_size == 128 and simcse.config.train.max_steps == 7
    assert mntp.config.train.lr == simcse.config.train.lr == 1e-4  # --set section.key: every stage
    c = simcse.config.contrastive
    assert (c.loss, c.dropout, c.temperature, c.mini_batch) == ("simcse", 0.3, 0.05, 64)
    assert simcse.config.model.source == str(out.resolve() / "stages/1-mntp") and simcse.dir.parent.name == "stages"
    # --stages picks the preset's stages by kind (their settings come along) or adds new ones
    only = plan_stages("m", out, preset="llm2vec", stages="simcse", data=["c.txt"])
    assert [s.name for s in only] == ["1-simcse"] and only[0].config.train.batch_size == 128
    sup = plan_stages("m", out, preset="tiny", stages="mlm,contrastive", data=["c.txt"], pairs="p.jsonl",
                      max_steps=9, tuning="lora")
    assert sup[1].config.contrastive.loss == "pairs" and sup[1].config.contrastive.pairs == "p.jsonl"
    assert all(s.config.train.max_steps == 9 and s.config.tuning.method == "lora" for s in sup)


@pytest.fixture
def plans_sparse(monkeypatch):
    """Planning a splade stage checks that sentence-transformers can write sparse encoders (>= 6.2, tested in
    tests/export); these tests are about the settings a kind takes, so under an older one (make test-oldest)
    the check is lifted for them."""
    import adapt.pipeline.chain as chain
    from adapt.export.sparse import sparse_supported

    if not sparse_supported():
        monkeypatch.setattr(chain, "require_sparse_support", lambda *a, **k: None)


def _chains(preset: str) -> list[str]:
    """Each kind alone, after a masked stage, and after the preset's own kind or stages (the README's
    `--stages mlm,splade` on the default preset is one of these)."""
    own = load_preset(preset).get("kind") or "mlm"
    return sorted({c for kind in kinds() for c in (kind, f"mlm,{kind}", f"{own},{kind}")})


@pytest.mark.parametrize("preset", sorted(list_presets()))
def test_every_kind_takes_every_preset(preset, tmp_path, plans_sparse):
    """A stage takes only the settings that apply to its kind: a preset's dense-only settings (the sink
    prompt, keep_source) reach no SPLADE stage, and every planned stage's objective accepts its config."""
    for chain in _chains(preset):
        pairs = "p.jsonl" if "contrastive" in chain else None
        plan = plan_stages("m", tmp_path / "o", preset=preset, stages=chain, data=["c.txt"], pairs=pairs)
        for stage in plan:
            try:
                objective = build_objective(stage.config)
            except ConfigError as e:
                raise AssertionError(f"preset {preset}, --stages {chain}: {e}") from None
            for name in stage.dropped:
                assert name in objective.inapplicable


def test_settings_a_kind_cannot_take_are_dropped_and_said_or_refused_when_meant_for_it(tmp_path, plans_sparse):
    plan = plan_stages("m", tmp_path / "o", preset="default", stages="mlm,splade", data=["c.txt"])
    mlm, splade = plan
    assert mlm.config.export.sink_prompt == "\n" and mlm.config.contrastive.keep_source == 4.0 and not mlm.dropped
    assert splade.config.export.sink_prompt == "" and splade.config.contrastive.keep_source == 0.0
    assert splade.dropped == ["export.sink_prompt", "contrastive.keep_source"]
    # a --set for every stage is dropped where it does not apply, kept where it does
    plan = plan_stages("m", tmp_path / "o", preset="tiny", stages="crops,splade", data=["c.txt"],
                       overrides=["contrastive.keep_source=2"])
    assert plan[0].config.contrastive.keep_source == 2 and plan[1].dropped == ["contrastive.keep_source"]
    # set for the SPLADE stage itself: refused before anything runs, saying what to do
    for overrides in (["splade.export.sink_prompt=x"], ["2.contrastive.keep_source=1"]):
        with pytest.raises(ConfigError, match=r"stage 2 \(splade\): .* does not apply to this kind.*Remove it"):
            plan_stages("m", tmp_path / "o", preset="tiny", stages="mlm,splade", data=["c.txt"], overrides=overrides)


@pytest.mark.parametrize("kwargs, match", [
    (dict(stages="mlm,bert"), "unknown stage 'bert'"),
    (dict(stages="mlm,contrastive"), "needs pairs: pass --pairs"),
    (dict(stages="mlm,simcse", pairs="p.jsonl"), "--pairs is used by a `contrastive` stage"),
    (dict(stages="mlm,simcse", overrides=["3.train.lr=1"]), "names no stage"),
    (dict(stages="mlm,simcse", overrides=["simcse.contrastive.temperature=0"]), "stage 2 .*temperature"),
    (dict(stages=None), "no stages"),
    (dict(stages="simcse", data=None), "needs training text"),
])
def test_bad_plans_are_clear_errors(tmp_path, kwargs, match):
    kwargs = {"data": ["c.txt"], **kwargs}
    with pytest.raises(ConfigError, match=match):
        plan_stages("m", tmp_path / "o", preset="tiny", **kwargs)


def test_bad_preset_stages_and_bad_pairs_fail_before_any_training(tiny_model_dir, corpus, tmp_path):
    preset = tmp_path / "p.yaml"
    for stages, match in [("[mlm, {kind: simcse, nope: {}}]", "unknown key"), ("[mlm, {kind: simcse, train: {lrr: 1}}]",
                          "stage 2 .simcse.: unknown key.*'lrr'"), ("[mlm, bert]", "stage 2: kind must be")]:
        preset.write_text(f"stages: {stages}\n")
        with pytest.raises(ConfigError, match=match):
            plan_stages("m", tmp_path / "o", preset=str(preset), data=["c.txt"])
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"query": "a", "positive": "b"}\n{"query": "a"}\n')
    out = tmp_path / "out"
    with pytest.raises(DataError, match="pairs.jsonl:2: no 'positive'"):
        _run(tiny_model_dir, out, corpus, stages="mlm,contrastive", pairs=str(pairs))
    assert not (out / "stages").exists()


def test_two_process_chain_on_cpu(tiny_model_dir, corpus, tmp_path, free_port):
    """mlm then simcse under torchrun (gloo): every stage sees 2 processes, SimCSE gathers negatives."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "chain.py"
    script.write_text(
        "import sys, torch\n"
        "from adapt.pipeline.chain import run_stages\n"
        f"run_stages({str(tiny_model_dir)!r}, {str(tmp_path / 'out')!r}, stages='mlm,simcse', preset='tiny-stages', "
        f"data=[{str(corpus)!r}], show_progress=False)\n"
        "if torch.distributed.is_initialized():\n    torch.distributed.destroy_process_group()\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(Path.cwd())}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port,
           str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure(proc.stderr)
    summary = json.loads((tmp_path / "out/run/summary.json").read_text())
    assert summary["per_stage"]["1-mlm"]["tokens"] == 4 * 2 * 32 * 2  # steps x batch x seq_len x processes
    assert summary["per_stage"]["2-simcse"]["processes"] == 2 and summary["probe_after"]["bidirectional"]


def test_a_checkpoint_is_renamed_only_after_every_process_wrote_into_it(tmp_path):
    """Each process writes its own RNG state into the checkpoint's tmp folder; the rename must wait for the
    slowest. The fake's barrier is where the other rank's late write lands (what a barrier guarantees is done):
    renamed before it, that write has no folder (the race CI hit under torchrun) and the checkpoint lacks it."""
    from pathlib import Path
    from types import SimpleNamespace

    from adapt.config.run_folder import CHECKPOINTS, STATE_FILE

    class TwoRanks:
        is_main_process = True

        def __init__(self):
            self.pending = None

        def save_state(self, path, safe_serialization=True):
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / "random_states_0.pkl").write_bytes(b"0")
            self.pending = Path(path) / "random_states_1.pkl"  # rank 1 is still writing

        def wait_for_everyone(self):
            if self.pending is not None:
                self.pending.write_bytes(b"1")  # raises if the folder was renamed away
                self.pending = None

    run = SimpleNamespace(accelerator=TwoRanks(), run_dir=tmp_path, step=4, tokens=10, last_eval={},
                          tcfg=SimpleNamespace(keep_checkpoints=2))
    final = Trainer.save_checkpoint(run)
    assert sorted(p.name for p in final.iterdir()) == ["random_states_0.pkl", "random_states_1.pkl", STATE_FILE]
    assert [p.name for p in (tmp_path / CHECKPOINTS).iterdir()] == [final.name]
