"""The CLI: help texts, a tiny conversion through `adapt convert`, friendly errors, 2-process DDP."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from adapt.cli import main
from tests.tiny import CORPUS
from tests.procs import failure

COMMANDS = ["convert", "presets", "probe", "export", "embed", "finetune", "classify", "bench"]


def test_help_lists_every_command():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output


@pytest.mark.parametrize("name", COMMANDS)
def test_command_help(name):
    result = CliRunner().invoke(main, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output and len(result.output) > 200


def test_presets_list_and_show():
    result = CliRunner().invoke(main, ["presets"])
    assert result.exit_code == 0 and "llm2vec-mntp" in result.output and "qlora" in result.output
    shown = CliRunner().invoke(main, ["presets", "mlm-40"])
    assert "mask_ratio: 0.4" in shown.output
    path = CliRunner().invoke(main, ["presets", "--path", "accelerate/ddp"])
    assert path.exit_code == 0 and Path(path.output.strip()).is_file()
    assert "distributed_type" in CliRunner().invoke(main, ["presets", "accelerate/ddp"]).output
    bad = CliRunner().invoke(main, ["presets", "nope"])
    assert bad.exit_code == 2 and "available:" in bad.output and "accelerate/ddp" in bad.output


def test_convert_cli_and_friendly_errors(tiny_model_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS * 4)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(tiny_model_dir), "-o", str(out), "--preset", "tiny",
                                       "--data", str(corpus), "--objective", "mntp", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "probe after reload" in result.output
    assert (out / "run/config.yaml").read_text().count("mntp") >= 1
    assert "checkpoints kept for --resume" in result.output and "run/checkpoints" in result.output
    again = CliRunner().invoke(main, ["convert", str(tiny_model_dir), "-o", str(out), "--preset", "tiny",
                                      "--data", str(corpus), "--quiet"])
    assert again.exit_code == 2 and "--overwrite" in again.output and "Traceback" not in again.output
    bad = CliRunner().invoke(main, ["convert", str(tmp_path / "nope"), "-o", str(tmp_path / "o2"), "--preset", "tiny",
                                    "--data", str(corpus)])
    assert bad.exit_code == 2 and "error:" in bad.output


def test_probe_cli(tiny_model_dir):
    assert CliRunner().invoke(main, ["probe", str(tiny_model_dir)]).exit_code == 0
    causal = CliRunner().invoke(main, ["probe", str(tiny_model_dir), "--as-is"])
    assert causal.exit_code == 1 and '"bidirectional": false' in causal.output


def test_two_process_ddp_on_cpu(tiny_model_dir, tmp_path, free_port):
    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS * 8)
    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": str(Path.cwd())}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port,
           "-m", "adapt", "convert", str(tiny_model_dir), "-o", str(out), "--preset", "tiny",
           "--data", str(corpus), "--quiet"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, failure(proc.stderr)
    summary = json.loads((out / "run/summary.json").read_text())
    assert summary["tokens"] == 4 * 2 * 32 * 2  # steps x batch x seq_len x processes
    assert summary["probe_after"]["bidirectional"]


def test_convert_with_no_preset_runs_the_default_recipe(tiny_model_dir, tmp_path):
    """No --preset: the `default` preset's recipe runs (crops with LoRA, the recipe study's best), with the
    settings the preset names; --objective then asks for a masked stage first (mlm,crops)."""
    import yaml

    from adapt.config.settings import load_preset

    default = load_preset("default")
    corpus = tmp_path / "c.txt"  # distinct documents: crops never pair a document with its own copy
    corpus.write_text("\n\n".join(f"Document number {i} says: {CORPUS}" for i in range(8)))
    small = ["--max-steps", "1", "--quiet", "--set", "data.seq_len=32", "--set", "train.batch_size=2",
             "--set", "train.eval_batches=1", "--set", "contrastive.max_length=16"]
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(tiny_model_dir), "-o", str(out), "--data", str(corpus), *small])
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((out / "run/config.yaml").read_text())
    assert saved["kind"] == default["kind"] == "crops" and saved["contrastive"]["loss"] == "crops"
    assert saved["tuning"]["method"] == default["tuning"]["method"] and saved["train"]["lr"] == default["train"]["lr"]
    summary = json.loads((out / "run/summary.json").read_text())
    assert summary["loss"] == "crops" and summary["probe_after"]["bidirectional"]

    out2 = tmp_path / "out2"
    result = CliRunner().invoke(main, ["convert", str(tiny_model_dir), "-o", str(out2), "--data", str(corpus),
                                       "--objective", "mntp", *small])
    assert result.exit_code == 0, result.output
    summary = json.loads((out2 / "run/summary.json").read_text())
    assert summary["stages"] == ["1-mlm", "2-crops"] and summary["probe_after"]["bidirectional"]
    first = yaml.safe_load((out2 / "stages/1-mlm/run/config.yaml").read_text())
    assert first["objective"]["schedule"] == "mntp"


def test_convert_cli_runs_stages_with_pairs(tiny_model_dir, tmp_path):
    """`adapt convert --stages mlm,contrastive --pairs FILE`: two stages, one published encoder."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS * 4)
    pairs = tmp_path / "pairs.jsonl"
    lines = [{"query": f"what is item {i}", "positive": f"item {i} is a thing number {i}",
              "negatives": [f"item {i + 1} is another thing"]} for i in range(12)]
    pairs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    args = ["convert", str(tiny_model_dir), "-o", str(out), "--preset", "tiny-stages", "--data", str(corpus),
            "--stages", "mlm,contrastive", "--pairs", str(pairs), "--set", "contrastive.train.max_steps=2", "--quiet"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "through 2 stages" in result.output and "2-contrastive: 2 steps" in result.output
    summary = json.loads((out / "run/summary.json").read_text())
    assert summary["stages"] == ["1-mlm", "2-contrastive"] and summary["probe_after"]["bidirectional"]
    assert (out / "modules.json").exists() and (out / "stages/2-contrastive/run/summary.json").exists()
    # --pairs without a contrastive stage is a clear error, not a traceback
    bad = CliRunner().invoke(main, ["convert", str(tiny_model_dir), "-o", str(tmp_path / "o2"), "--preset", "tiny",
                                    "--data", str(corpus), "--stages", "mlm,simcse", "--pairs", str(pairs)])
    assert bad.exit_code == 2 and "--pairs is used by a `contrastive` stage" in bad.output


def test_embed_cli_refuses_a_causal_decoder_and_says_how(tiny_model_dir):
    result = CliRunner().invoke(main, ["embed", str(tiny_model_dir), "a text", "--quiet"])
    assert result.exit_code == 2 and "--allow-causal" in result.output and "Traceback" not in result.output
    allowed = CliRunner().invoke(main, ["embed", str(tiny_model_dir), "a text", "--quiet", "--allow-causal"])
    assert allowed.exit_code == 0 and '"embedding"' in allowed.output


@pytest.mark.parametrize("command", [["probe"], ["embed", "a text"], ["finetune", "--data", "LABELED", "-o", "OUT"],
                                     ["bench", "--suite", "quick", "-o", "OUT"], ["bench", "--suite", "quick", "--baselines"],
                                     ["convert", "-o", "OUT", "--data", "LABELED", "--preset", "tiny"],
                                     ["convert", "-o", "OUT", "--data", "LABELED"],  # the default: 4 texts < a batch
                                     ["convert", "-o", "OUT", "--data", "LABELED", "--stages", "mlm,crops"]])
def test_every_command_says_when_the_model_path_does_not_exist(command, tmp_path):
    """The first thing a command says about a missing model is the error: no progress bar, nothing written,
    and no complaint about other inputs (here: too little data for the default's batch) before it."""
    labeled = tmp_path / "labeled.jsonl"
    labeled.write_text("".join(json.dumps({"text": f"text {i}", "label": "ab"[i % 2]}) + "\n" for i in range(4)))
    args = [str(labeled) if a == "LABELED" else str(tmp_path / "out") if a == "OUT" else a for a in command]
    result = CliRunner().invoke(main, args[:1] + ["runs/no-such/model"] + args[1:])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: runs/no-such/model: no such file or folder"), result.output
    assert "Repo id" not in result.output and "%|" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labeled.jsonl"]


@pytest.mark.parametrize("command, missing", [
    (["embed", "MODEL", "-i", "MISSING", "-o", "OUT.npy"], "no such file"),
    (["convert", "MODEL", "-o", "OUT", "--preset", "tiny", "--data", "MISSING"], "data source not found"),
    (["convert", "MODEL", "-o", "OUT", "--preset", "tiny", "--data", "MISSING", "--stages", "mlm,crops"],
     "data source not found"),
    (["convert", "MODEL", "-o", "OUT", "--preset", "tiny", "--stages", "contrastive", "--pairs", "MISSING"],
     "does not exist"),
    (["finetune", "MODEL", "--data", "MISSING", "-o", "OUT"], "does not exist"),
    (["classify", "MODEL", "--input", "MISSING"], "is an embedding encoder"),  # the folder is refused first
    (["export", "MODEL", "-o", "OUT", "--order-dims", "pca", "--data", "MISSING"], "data source not found"),
])
def test_a_missing_input_file_is_the_first_thing_said(command, missing, tiny_model_dir, tmp_path):
    """Errors about inputs come before any work: no progress bar, no output folder."""
    from adapt.export.dense import export_encoder
    from transformers import AutoModel, AutoTokenizer

    from adapt.model.bidirectional import make_bidirectional

    model = tiny_model_dir
    if command[0] in ("classify", "export"):
        model = export_encoder(make_bidirectional(AutoModel.from_pretrained(tiny_model_dir)),
                               AutoTokenizer.from_pretrained(tiny_model_dir), tmp_path / "enc")
    names = {"MODEL": str(model), "MISSING": str(tmp_path / "missing.jsonl"), "OUT": str(tmp_path / "out"),
             "OUT.npy": str(tmp_path / "out.npy")}
    result = CliRunner().invoke(main, [names.get(a, a) for a in command])
    assert result.exit_code == 2, result.output
    assert missing in result.output and "%|" not in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.npy").exists()


def test_version():
    from importlib.metadata import version

    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output == f"adapt {version('adapt')}\n"


def test_a_full_disk_during_export_says_so_leaves_nothing_half_written_and_resume_finishes(tiny_model_dir, tmp_path,
                                                                                         monkeypatch):
    import transformers.modeling_utils

    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS * 4)
    out = tmp_path / "out"
    args = ["convert", str(tiny_model_dir), "-o", str(out), "--preset", "tiny", "--data", str(corpus), "--quiet"]

    def full(*a, **k):  # what safetensors raised in CI when /tmp filled up (it is not an OSError)
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    failed = CliRunner().invoke(main, args)
    assert failed.exit_code == 2, failed.output
    assert "the disk is full" in failed.output and "--resume" in failed.output and "Traceback" not in failed.output
    assert not (out / "config.json").exists() and not (out / "model.safetensors").exists()
    assert not [p.name for p in tmp_path.iterdir() if ".export." in p.name]  # the scratch folder went too

    monkeypatch.undo()
    resumed = CliRunner().invoke(main, args + ["--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert (out / "config.json").is_file() and "probe after reload" in resumed.output

    other = CliRunner().invoke(main, ["probe", str(tmp_path / "nope")])
    assert "the disk is full" not in other.output  # an ordinary error is not taken for a full disk
