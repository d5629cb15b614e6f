"""Shared fixtures: tiny tokenizers and tiny random decoders built from configs (offline, fast)."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# CLI commands run in this process (CliRunner) would keep bitsandbytes out of it for good (adapt.model.quantization), and a
# later QLoRA test would fail: tests of that switch run fresh interpreters without this variable
os.environ.setdefault("ADAPT_ALLOW_BNB", "1")

import pytest
import torch

torch.set_num_threads(1)

from tests.procs import open_port  # noqa: E402
from tests.tiny import tiny_decoder, tiny_tokenizer  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: uses the real SmolLM2 decoder or runs long")


@pytest.fixture
def free_port() -> str:
    """A TCP port nobody listens on now, for a torch.distributed rendezvous (fixed ports collide)."""
    return open_port()


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A saved tiny Llama causal LM with its tokenizer (no mask token), as a user's folder would be. The
    tokenizer is a fresh one, not the session's: a test that adds a token to that one must not reach this."""
    tokenizer = tiny_tokenizer()
    model = tiny_decoder("llama", vocab_size=len(tokenizer))
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
