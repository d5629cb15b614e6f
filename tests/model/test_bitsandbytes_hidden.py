"""bitsandbytes is imported only where quantization is asked for (adapt.model.loading.hide_bitsandbytes).

The commands run in fresh interpreters (the switch is one-way for a process): a full or LoRA
``adapt convert`` and ``adapt embed`` leave ``sys.modules["bitsandbytes"]`` None and print no
bitsandbytes notice; QLoRA still imports it; QLoRA asked for after it was hidden is a clear error;
ADAPT_ALLOW_BNB=1 lets it in.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapt.config.settings import ModelConfig, TuningConfig
from adapt.errors import ConfigError
from adapt.model.quantization import ALLOW_BNB_ENV, hide_bitsandbytes
from adapt.model.loading import load_config, quantization_config
from tests.procs import failure
from tests.tiny import CORPUS, tiny_decoder, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
# Runs adapt's CLI commands in one process, one after another, and prints what became of bitsandbytes
# after each: "absent" (never looked for), "hidden" (None) or "imported", with the exit code.
DRIVER = """
import json, sys
from adapt.cli import main
for args in json.loads(sys.argv[1]):
    try:
        main(args, standalone_mode=False)
        code = 0
    except SystemExit as e:
        code = e.code
    state = sys.modules.get("bitsandbytes", "absent")
    print("STATE", json.dumps([code, "hidden" if state is None else state if state == "absent" else "imported"]),
          flush=True)
"""


def _run(commands: list[list[str]], **env) -> tuple[list, str]:
    env = {**{k: v for k, v in os.environ.items() if k != ALLOW_BNB_ENV}, "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(commands)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, failure(done.stderr)
    states = [json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("STATE ")]
    assert len(states) == len(commands), done.stdout[-2000:] + done.stderr[-2000:]
    return states, done.stdout + done.stderr


def _decoder(root: Path, family: str, **config) -> Path:
    tok = tiny_tokenizer()
    tiny_decoder(family, vocab_size=len(tok), **config).save_pretrained(root / family)
    tok.save_pretrained(root / family)
    return root / family


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb")
    (root / "corpus.txt").write_text("\n\n".join([CORPUS] * 6), encoding="utf-8")
    return root, root / "corpus.txt"


def _convert(src: Path, out: Path, corpus: Path, tuning: str) -> list[str]:
    return ["convert", str(src), "-o", str(out), "--preset", "tiny", "--data", str(corpus), "--tuning", tuning,
            "--max-steps", "2", "--set", "tuning.lora_r=4", "--quiet"]


def test_full_and_lora_convert_then_embed_keep_it_out(sources):
    root, corpus = sources
    llama, qwen2 = _decoder(root, "llama"), _decoder(root, "qwen2")
    states, output = _run([_convert(llama, root / "full", corpus, "full"),
                           _convert(qwen2, root / "lora", corpus, "lora"),  # peft's LoRA without bitsandbytes
                           _convert(llama, root / "late", corpus, "qlora")])
    assert states[0] == [0, "hidden"] and states[1] == [0, "hidden"]
    assert (root / "lora/run/adapter/adapter_model.safetensors").is_file()
    assert states[2][0] == 2 and "tuning.method=qlora needs bitsandbytes" in output and ALLOW_BNB_ENV in output
    assert not (root / "late" / "config.json").exists()
    assert "gemm_4bit" not in output and "bitsandbytes" not in output.replace("tuning.method=qlora needs bitsandbytes", "")
    states, output = _run([["embed", str(root / "lora"), "a text", "another", "-o", str(root / "v.npy"), "--quiet"]])
    assert states == [[0, "hidden"]] and "gemm_4bit" not in output and (root / "v.npy").is_file()


def test_qlora_convert_imports_it_and_the_escape_hatch(sources):
    root, corpus = sources
    # bitsandbytes' CPU 4-bit kernel needs in_features >= its 64-value block: hidden 64
    src = _decoder(root / "wide", "llama", hidden_size=64, intermediate_size=128)
    states, _ = _run([_convert(src, root / "qlora", corpus, "qlora")])
    assert states == [[0, "imported"]] and (root / "qlora/run/adapter/adapter_model.safetensors").is_file()
    states, _ = _run([["probe", str(src)]], **{ALLOW_BNB_ENV: "1"})
    assert states[0][0] == 0 and states[0][1] != "hidden"


@pytest.fixture
def bnb_restored(monkeypatch):
    """Whatever a test does to sys.modules["bitsandbytes"] is undone after it."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", sys.modules.get("bitsandbytes"))
    monkeypatch.delitem(sys.modules, "bitsandbytes")
    return monkeypatch


def test_hide_is_one_way_and_explains_itself(bnb_restored):
    bnb_restored.setenv(ALLOW_BNB_ENV, "1")
    assert hide_bitsandbytes() is False and "bitsandbytes" not in sys.modules
    bnb_restored.delenv(ALLOW_BNB_ENV)
    assert hide_bitsandbytes() is True and sys.modules["bitsandbytes"] is None
    import importlib.util

    assert importlib.util.find_spec("bitsandbytes") is None
    with pytest.raises(ModuleNotFoundError):
        import bitsandbytes  # noqa: F401
    assert quantization_config(TuningConfig(method="lora")) is None
    with pytest.raises(ConfigError, match=f"tuning.method=qlora needs bitsandbytes.*{ALLOW_BNB_ENV}=1"):
        quantization_config(TuningConfig(method="qlora"))


def test_weights_saved_quantized_need_it(bnb_restored, tmp_path):
    src = _decoder(tmp_path, "gemma")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (src / "config.json").write_text(json.dumps(config))
    assert load_config(ModelConfig(source=str(src))).model_type == "gemma"  # not hidden: loads as before
    bnb_restored.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ConfigError, match="saved quantized with bitsandbytes.*ADAPT_ALLOW_BNB=1"):
        load_config(ModelConfig(source=str(src)))
    from adapt.inference.encoder import load_encoder

    with pytest.raises(ConfigError, match="saved quantized with bitsandbytes"):
        load_encoder(str(src))


def test_a_dequantized_gguf_model_saves_as_plain_weights(tmp_path):
    """GGUF weights come dequantized but marked quantized: the marker would make save_pretrained write a
    quantization_config and peft treat the model as quantized (adapt.model.quantization.dequantized_gguf)."""
    import torch

    from adapt.model.quantization import dequantized_gguf

    model = tiny_decoder("llama")
    model.config.quantization_config = {"quant_method": "gguf"}  # what transformers leaves after a GGUF load
    model.hf_quantizer = object()
    model.to(torch.bfloat16)
    assert dequantized_gguf(model, torch.float32) is model
    assert model.hf_quantizer is None and next(model.parameters()).dtype == torch.float32
    model.save_pretrained(tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
