"""``adapt embed`` at scale: resumable shards + manifest, several processes (torchrun), a kill -9 and a rerun,
and ONNX / OpenVINO graphs checked per family (probe on the exported graph, cosine vs torch)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from adapt.export.graphs import add_backend
from adapt.export.backends import graph_backend
from adapt.inference.graph_model import folder_backend
from adapt.model.bidirectional import make_bidirectional, probe
from adapt.cli import main
from adapt.inference.embed import embed, merge_shards
from adapt.inference.shards import MANIFEST, read_manifest
from adapt.inference.encoder import load_encoder
from adapt.errors import ConfigError, DataError, ModelLoadError
from adapt.export.dense import export_encoder
from tests.tiny import CORPUS, TINY_CONFIGS, tiny_decoder, tiny_tokenizer
from tests.procs import failure, open_port

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [CORPUS[i:i + 4 + (7 * i) % 90] for i in range(0, 1200, 3)]  # 400 texts of mixed lengths


def cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    tok = tiny_tokenizer()
    return export_encoder(make_bidirectional(tiny_decoder("llama", vocab_size=len(tok))), tok,
                          tmp_path_factory.mktemp("enc") / "enc", max_seq_length=32, prompts={"query": "query: "})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, encoder_dir):
    root = tmp_path_factory.mktemp("in")
    (root / "in.txt").write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    return root / "in.txt", load_encoder(encoder_dir).encode(TEXTS)


def test_shard_folder_manifest_rerun_and_merge(encoder_dir, inputs, tmp_path):
    path, expected = inputs
    out = tmp_path / "vectors"  # no extension: a shard folder
    summary = embed(str(encoder_dir), input_path=path, output_path=out, shard_size=64, show_progress=False)
    assert (summary.n, summary.embedded, summary.shards_written, summary.shards_skipped) == (400, 400, 7, 0)
    names = sorted(p.name for p in out.iterdir())
    assert names == [MANIFEST] + sorted(f"shard-{k:06d}.{ext}" for k in range(7) for ext in ("json", "npy"))
    manifest = read_manifest(out)
    assert (manifest["n"], manifest["dim"], len(manifest["shards"]), manifest["shard_size"]) == (400, 32, 7, 64)
    assert manifest["settings"]["fingerprint"] and manifest["backend"] == "torch" and manifest["tokens"] > 400
    assert [s["first"] for s in manifest["shards"]] == list(range(0, 400, 64))
    assert "embedded 400 texts" in summary.rate_line() and "texts/s" in summary.rate_line()
    # a rerun skips every finished shard; a shard lost in a crash is the only one redone
    (out / "shard-000003.json").unlink()
    again = embed(str(encoder_dir), input_path=path, output_path=out, shard_size=64, show_progress=False)
    assert (again.shards_written, again.shards_skipped, again.embedded) == (1, 6, 64)
    for target in ("merged.npy", "merged.parquet", "merged.jsonl"):
        merge_shards(out, tmp_path / target)
    got = np.load(tmp_path / "merged.npy")
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 1e-5
    table = pq.read_table(tmp_path / "merged.parquet")
    assert table.column("id").to_pylist() == list(range(400))
    assert np.array_equal(np.array(table.column("embedding").to_pylist(), dtype=np.float32), got)
    rows = [json.loads(line) for line in (tmp_path / "merged.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(400)) and np.allclose([r["embedding"] for r in rows], got)


def _leftovers(folder):
    """What a ``kill -9`` can leave in a shard folder: a ``.npy`` being written, and the temporary folders
    ``atomic_write_json`` writes a shard record and the manifest in."""
    (folder / ".shard-000002.npy.4242.tmp").write_bytes(b"\x93NUMPY half")
    for name in ("shard-000003.json", MANIFEST):
        (folder / f".{name}.k1ll3d_.tmp").mkdir()
        (folder / f".{name}.k1ll3d_.tmp" / name).write_text('{"rows": 6', encoding="utf-8")


def test_rerun_clears_what_a_killed_run_left_half_written(encoder_dir, inputs, tmp_path):
    path, expected = inputs
    out = tmp_path / "v"
    embed(str(encoder_dir), input_path=path, output_path=out, shard_size=64, show_progress=False)
    (out / "shard-000003.json").unlink()
    (out / MANIFEST).unlink()
    _leftovers(out)
    again = embed(str(encoder_dir), input_path=path, output_path=out, shard_size=64, show_progress=False)
    assert (again.shards_written, again.shards_skipped) == (1, 6)
    assert not list(out.glob(".*"))
    merge_shards(out, tmp_path / "v.npy")
    assert np.abs(np.load(tmp_path / "v.npy") - expected).max() <= 1e-5


def test_each_process_clears_only_its_own_leftovers(tmp_path):
    from adapt.inference.shards import Processes, _clean_temporaries

    _leftovers(tmp_path)
    _clean_temporaries(tmp_path, Processes(rank=1, world=2))  # shard 3 is rank 1's; 2 and the manifest are not
    assert sorted(p.name for p in tmp_path.iterdir()) == [".manifest.json.k1ll3d_.tmp", ".shard-000002.npy.4242.tmp"]
    _clean_temporaries(tmp_path, Processes(rank=0, world=2))
    assert not list(tmp_path.iterdir())


def test_rerun_refuses_other_settings_changed_input_and_damage(encoder_dir, inputs, tmp_path):
    path, _ = inputs
    out = tmp_path / "v.npy"  # --shards with a file: shards next to it, merged into it
    summary = embed(str(encoder_dir), input_path=path, output_path=out, shards=True, shard_size=100,
                    show_progress=False)
    assert summary.output == str(out) and np.load(out).shape == (400, 32)
    shards = tmp_path / "v.npy.shards"
    with pytest.raises(ConfigError, match="another encoder or other settings"):
        embed(str(encoder_dir), input_path=path, output_path=out, shards=True, shard_size=100, prompt_name="query",
              show_progress=False)
    changed = tmp_path / "changed.txt"
    changed.write_text("".join(t + "\n" for t in ["a different first text"] + TEXTS[1:]), encoding="utf-8")
    with pytest.raises(DataError, match="changed since this shard was written"):
        embed(str(encoder_dir), input_path=changed, output_path=out, shards=True, shard_size=100,
              show_progress=False)
    data = bytearray((shards / "shard-000001.npy").read_bytes())
    data[-1] ^= 0xFF
    (shards / "shard-000001.npy").write_bytes(bytes(data))
    with pytest.raises(DataError, match="checksum differs"):
        merge_shards(shards, tmp_path / "again.npy")
    assert not (tmp_path / "again.npy").exists()
    (shards / MANIFEST).unlink()
    with pytest.raises(DataError, match="has not finished"):
        merge_shards(shards, tmp_path / "again.npy")
    with pytest.raises(ConfigError, match="writes files"):
        embed(str(encoder_dir), texts=["x"], shards=True, show_progress=False)


def test_cli_shards_merge_and_closing_line(encoder_dir, inputs, tmp_path):
    path, expected = inputs
    runner = CliRunner()
    result = runner.invoke(main, ["embed", str(encoder_dir), "-i", str(path), "-o", f"{tmp_path}/v/",
                                  "--shard-size", "150", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "texts/s" in result.output and "tokens/s" in result.output and "3 written" in result.output
    result = runner.invoke(main, ["embed", "--merge", str(tmp_path / "v"), "-o", str(tmp_path / "v.npy")])
    assert result.exit_code == 0, result.output
    assert np.abs(np.load(tmp_path / "v.npy") - expected).max() <= 1e-5


def _torchrun(port: str, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", port, "-m", "adapt", "embed", *args]


def _env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(ROOT)}


def test_two_processes_write_what_one_writes(encoder_dir, inputs, tmp_path, free_port):
    path, expected = inputs
    out = tmp_path / "two.parquet"
    run = subprocess.run(_torchrun(free_port, str(encoder_dir), "-i", str(path), "-o", str(out), "--shard-size", "50",
                                   "--quiet"), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, failure(run.stderr)
    manifest = read_manifest(tmp_path / "two.parquet.shards")
    assert manifest["processes"] == 2 and manifest["n"] == 400 and len(manifest["shards"]) == 8
    got = np.array(pq.read_table(out).column("embedding").to_pylist(), dtype=np.float32)
    assert np.abs(got - expected).max() <= 1e-5
    assert run.stderr.count("embedded 400 texts") == 2  # process 0's report only (the summary + the rate line)


def test_kill_9_mid_run_then_rerun_equals_an_uninterrupted_run(encoder_dir, inputs, tmp_path, free_port):
    """A 2-process run killed at a random point (``kill -9`` of every process) loses at most the shards in flight;
    the rerun embeds only the missing ones, and the merged output equals an uninterrupted run's."""
    path, expected = inputs
    out = tmp_path / "v"
    cmd = _torchrun(free_port, str(encoder_dir), "-i", str(path), "-o", str(out), "--shard-size", "8", "--quiet")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = int(np.random.default_rng().integers(3, 30))  # of 50 shards
    deadline = time.time() + 240
    while len(list(out.glob("shard-*.json"))) < target and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    import psutil

    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    for pid in family:  # torchrun starts each worker in a session of its own: kill every process
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    done = {p.name for p in out.glob("shard-*.json")}
    assert 0 < len(done) < 50 and not (out / MANIFEST).exists(), "the kill must land mid-run"
    # nothing a reader would load is half-written: every shard record points at complete vectors
    for name in done:
        record = json.loads((out / name).read_text())
        assert np.load(out / record["file"]).shape == (record["rows"], 32)
    cmd[cmd.index("--master_port") + 1] = open_port()  # the killed run's rendezvous port may linger
    rerun = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, failure(rerun.stderr)
    assert f"{50 - len(done)} written, {len(done)} already done" in rerun.stderr
    merge_shards(out, tmp_path / "v.npy")
    assert np.abs(np.load(tmp_path / "v.npy") - expected).max() <= 1e-5
    assert not list(out.glob(".*"))  # temporaries of the killed run were cleaned up


# ------------------------------------------------------------------------------------------- backends

FAST_FAMILIES = {"llama", "gpt2", "gemma2"}  # RoPE, absolute positions, eager + sliding window; the rest: slow


def _family_export(family, tmp_path):
    tok = tiny_tokenizer()
    from adapt.model.families import facts_for

    model = make_bidirectional(tiny_decoder(family, vocab_size=len(tok),
                                            attn_implementation=facts_for(family).attn_implementations[0]))
    return export_encoder(model, tok, tmp_path / family, max_seq_length=48)


def _is_moe(family) -> bool:
    from adapt.model.families import num_experts
    from tests.tiny import tiny_config

    return num_experts(tiny_config(family)) > 1


DENSE = [f for f in TINY_CONFIGS if not _is_moe(f)]
MOE = [f for f in TINY_CONFIGS if _is_moe(f)]


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in FAST_FAMILIES else pytest.mark.slow)
                                    for f in DENSE])
def test_onnx_export_per_family(family, tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed (make test installs it)")
    folder = _family_export(family, tmp_path)
    record = add_backend(folder, "onnx")
    assert record["probe"]["bidirectional"] and record["probe"]["family"] == family
    assert record["parity"]["min_cosine"] >= 0.9999
    assert folder_backend(folder)["name"] == "onnx" and (folder / graph_backend("onnx").graph_file).is_file()
    import onnxruntime as ort

    session = ort.InferenceSession(str(folder / "onnx/model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]  # what the tokenizer gives
    assert [o.name for o in session.get_outputs()] == ["last_hidden_state"]
    graph = load_encoder(folder)  # adapt embed runs the graph the folder holds
    assert type(graph.model).__name__ == "BackendModel" and probe(graph.model).bidirectional
    texts = TEXTS[:20] + ["", CORPUS]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_vectors = load_encoder(folder, backend="torch").encode(texts, batch_size=7)
        assert cosines(graph.encode(texts, batch_size=5), torch_vectors).min() >= 0.9999


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "llama" else pytest.mark.slow)
                                    for f in DENSE])
def test_openvino_int8_export_per_family(family, tmp_path):
    pytest.importorskip("openvino", reason="the openvino extra is not installed (make test installs it)")
    folder = _family_export(family, tmp_path)
    record = add_backend(folder, "openvino", quantize="int8")
    assert record["probe"]["bidirectional"] and record["quantize"] == "int8"
    assert record["parity"]["min_cosine"] > 0.99, record["parity"]
    assert (folder / "openvino/openvino_model.xml").is_file() and (folder / "openvino/openvino_model.bin").is_file()
    assert probe(load_encoder(folder).model).bidirectional


@pytest.mark.parametrize("backend", ["onnx", "openvino"])
@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == MOE[0] else pytest.mark.slow) for f in MOE])
def test_mixture_of_experts_exports_are_refused_naming_the_family(family, backend, tmp_path):
    """The experts' routing (torch.histc) has no ONNX operator: a clear refusal, the folder left as it was."""
    pytest.importorskip("onnxruntime" if backend == "onnx" else "openvino")
    folder = _family_export(family, tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(ModelLoadError, match=rf"cannot export the '{family}' family to ONNX.*use the torch backend"):
        add_backend(folder, backend)
    assert sorted(p.name for p in folder.iterdir()) == before


def test_onnx_int8_weights_only(tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed (make test installs it)")
    folder = _family_export("llama", tmp_path)
    record = add_backend(folder, "onnx", quantize="int8-weights")
    assert record["probe"]["bidirectional"] and record["parity"]["min_cosine"] > 0.99, record
    import onnx

    ops = {node.op_type for node in onnx.load(str(folder / "onnx/model.onnx")).graph.node}
    assert "MatMulNBits" in ops and "DynamicQuantizeLinear" not in ops


def test_export_cli_with_backend_and_embed_uses_it(encoder_dir, tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed (make test installs it)")
    runner = CliRunner()
    out = tmp_path / "onnx-int8"
    result = runner.invoke(main, ["export", str(encoder_dir), "-o", str(out), "--backend", "onnx", "--quantize", "int8"])
    assert result.exit_code == 0, result.output
    assert "onnx int8: probe bidirectional, cosine vs torch min" in result.output
    manifest = json.loads((out / "adapt_export.json").read_text())
    assert manifest["backend"]["file"] == "onnx/model.onnx" and "onnx" in manifest["files"]
    assert "model_kwargs" not in json.loads((out / "sentence_bert_config.json").read_text())
    card = (out / "README.md").read_text()  # the model card says how to load the graph, and what that needs
    assert f"# {out.name}\n" in card and f'SentenceTransformer("{out.name}", backend="onnx")' in card
    assert "optimum-onnx" in card
    assert f"cosine vs torch min {manifest['backend']['parity']['min_cosine']}" in card
    result = runner.invoke(main, ["embed", str(out), "a text", "another text", "-o", str(tmp_path / "v.npy"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "(onnx)" in result.output and np.load(tmp_path / "v.npy").shape == (2, 32)
    # re-exported as torch: the graph goes, and the folder is a torch encoder again
    assert runner.invoke(main, ["export", str(out), "-o", str(out)]).exit_code == 0
    assert not (out / "onnx").exists() and folder_backend(out) is None
    assert 'backend="onnx"' not in (out / "README.md").read_text()
    with pytest.raises(ModelLoadError, match="holds no onnx graph"):
        load_encoder(out, backend="onnx")
    result = runner.invoke(main, ["export", str(encoder_dir), "-o", str(tmp_path / "x"), "--quantize", "int8"])
    assert result.exit_code != 0 and "--quantize needs --backend" in result.output
