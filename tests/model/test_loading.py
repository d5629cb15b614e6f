"""Loading decoders: folders, bad inputs, pickle refusal, and the mask-token policy."""

import os
from importlib import metadata
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertModel

from adapt.model.bidirectional import is_bidirectional
from adapt.config.settings import ModelConfig
from adapt.errors import ModelLoadError
from adapt.model.loading import load_decoder, resolve_source, setup_mask_token
from tests.tiny import tiny_decoder


def test_load_folder_is_bidirectional_with_pad(tiny_model_dir):
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)))
    assert is_bidirectional(model)
    assert tok.pad_token is not None
    causal, _ = load_decoder(ModelConfig(source=str(tiny_model_dir)), bidirectional=False)
    assert not is_bidirectional(causal)


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        resolve_source(str(tmp_path / "nope" / "x"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_decoder(ModelConfig(source=str(tmp_path)))


def test_bert_folder_is_not_a_decoder(tmp_path, tokenizer):
    BertModel(BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="not a causal decoder"):
        load_decoder(ModelConfig(source=str(tmp_path)))


def test_pickle_weights_refused_unless_allowed(tmp_path, tokenizer):
    model = tiny_decoder("llama")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # transformers 5 only writes safetensors: make a pickle by hand
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(ModelLoadError, match="pickle"):
        load_decoder(ModelConfig(source=str(tmp_path)))
    loaded, _ = load_decoder(ModelConfig(source=str(tmp_path), allow_pickle=True))
    assert torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight)


def test_dtype_choice(tiny_model_dir):
    model, _ = load_decoder(ModelConfig(source=str(tiny_model_dir), dtype="bfloat16"))
    assert model.dtype == torch.bfloat16


def test_mask_token_auto_adds_and_resizes(tiny_model_dir):
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)))
    n = model.get_input_embeddings().num_embeddings
    mask = setup_mask_token(model, tok, "auto")
    assert (mask.policy, mask.added, mask.token) == ("add", True, "<mask>")
    assert tok.mask_token == "<mask>" and tok.convert_tokens_to_ids("<mask>") == mask.id
    assert model.get_input_embeddings().num_embeddings == n + 1 == len(tok)


def test_mask_token_prefers_tokenizer_then_reserved(tiny_model_dir):
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)))
    tok.add_special_tokens({"additional_special_tokens": ["<|reserved_special_token_0|>"]})
    model.resize_token_embeddings(len(tok))
    mask = setup_mask_token(model, tok, "auto")
    assert mask.policy == "reserved" and mask.token == "<|reserved_special_token_0|>" and not mask.added
    tok.add_special_tokens({"mask_token": "<mask>"})
    model.resize_token_embeddings(len(tok))
    assert setup_mask_token(model, tok, "auto").policy == "tokenizer"


@pytest.mark.parametrize("policy", ["eos", "underscore"])
def test_mask_token_llm2vec_choices(tiny_model_dir, policy):
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)))
    mask = setup_mask_token(model, tok, policy)
    assert not mask.added
    expected = tok.eos_token_id if policy == "eos" else tok.encode("_", add_special_tokens=False)[0]
    assert mask.id == expected


def test_mask_token_bad_literal(tiny_model_dir):
    model, tok = load_decoder(ModelConfig(source=str(tiny_model_dir)))
    with pytest.raises(ModelLoadError, match="not in the vocabulary"):
        setup_mask_token(model, tok, "<nope>")
    with pytest.raises(ModelLoadError, match="no mask token"):
        setup_mask_token(model, tok, "tokenizer")


def test_hub_id_without_network_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="hub id"):
        load_decoder(ModelConfig(source="some-org/some-model-that-is-not-here"))


# ---- tuning.cpu_malloc ---------------------------------------------------------------------------

@pytest.mark.parametrize("method, mode, env, device_map, expect", [
    ("qlora", "auto", False, None, True),        # QLoRA on the CPU: lean by default
    ("lora", "auto", False, None, False),        # LoRA and full keep glibc's default
    ("full", "lean", False, None, True),         # ... unless asked
    ("qlora", "glibc", False, None, False),      # opt-out
    ("qlora", "auto", True, None, False),        # the user's MALLOC_MMAP_THRESHOLD_ wins
    ("qlora", "auto", False, {"": "cuda:0"}, False),  # not a CPU load
    ("qlora", "auto", False, {"": "cpu"}, True),
])
def test_lean_cpu_malloc_decides_when_to_fix_the_threshold(monkeypatch, method, mode, env, device_map, expect):
    from adapt.model import loading
    from adapt.config.settings import TuningConfig

    calls = []
    monkeypatch.setattr(loading, "_set_mmap_threshold", lambda n: calls.append(n) or True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if env:
        monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    else:
        monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert loading.lean_cpu_malloc(TuningConfig(method=method, cpu_malloc=mode), device_map) is expect
    assert calls == ([loading.LEAN_MMAP_THRESHOLD] if expect else [])
    assert loading.lean_cpu_malloc(None) is False


def test_lean_cpu_malloc_makes_freed_blocks_leave_rss(tmp_path):
    """The mechanism, in fresh interpreters (the setting is process-wide and one-way): with glibc's default, a
    weight-sized block freed after a few others stays resident; with the lean setting it goes back to the OS."""
    import subprocess
    import sys

    import platform

    if not Path("/proc/self/status").exists() or platform.libc_ver()[0] != "glibc":
        pytest.skip("needs glibc and /proc (Linux)")
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys, torch\n"
        "from adapt.config.settings import TuningConfig\n"
        "from adapt.model.loading import lean_cpu_malloc\n"
        "def anon():\n"
        "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon:'))\n"
        "applied = lean_cpu_malloc(TuningConfig(method='qlora', cpu_malloc=sys.argv[1]))\n"
        "for _ in range(2):\n"
        "    t = torch.ones(2 * 1024 * 1024)\n"
        "    del t\n"
        "t = torch.ones(2 * 1024 * 1024)\n"
        "keep = torch.ones(1000)\n"
        "before = anon()\n"
        "del t\n"
        "print(applied, before - anon())\n")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    freed = {}
    for mode in ("auto", "glibc"):
        out = subprocess.run([sys.executable, str(probe), mode], capture_output=True, text=True, env=env,
                             cwd=Path(__file__).resolve().parents[2], timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        applied, kib = out.stdout.split()
        freed[mode] = (applied == "True", int(kib))
    applied, kib = freed["auto"]
    assert applied and kib >= 7 * 1024, freed  # set, and the freed 8 MiB block left RSS
    applied, kib = freed["glibc"]
    assert not applied and kib < 1024, freed  # not set, and the freed block stayed in RSS (glibc's own threshold)


def test_no_bitsandbytes_kernel_notice_on_a_plain_import():
    """peft and sentence-transformers import bitsandbytes on every run; its CPU-kernel notice reads like an
    install error and must not reach a user who asked for no quantization."""
    import subprocess
    import sys

    code = "import logging; logging.basicConfig(level=logging.INFO); import adapt.export.dense, peft, bitsandbytes"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gemm_4bit_forward" not in proc.stderr + proc.stdout
    bare = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(); import bitsandbytes"],
                          capture_output=True, text=True, timeout=120)
    if "gemm_4bit_forward" not in bare.stderr + bare.stdout:  # bitsandbytes 0.50 dropped the notice
        pytest.skip(f"bitsandbytes {metadata.version('bitsandbytes')} prints no CPU-kernel notice: the filter "
                    "has nothing to hide here")
