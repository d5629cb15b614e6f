"""Fake encoders for the benchmark tests (no tests here): deterministic hashing bags of words."""
from __future__ import annotations

import hashlib
import re

import numpy as np


class HashEncoder:
    """Signed feature hashing of lower-cased words: texts sharing words get similar embeddings."""

    def __init__(self, name: str = "hash-bow", dim: int = 128, seed: int = 0):
        self.name = name
        self.dim = dim
        self.seed = seed
        self.calls = 0
        self.texts_encoded = 0
        self.prompts_seen: list = []

    @property
    def fingerprint(self) -> str:
        return f"hash:{self.dim}:{self.seed}"

    def encode(self, texts, *, batch_size=32, prompt_name=None, normalize=None, show_progress=False):
        self.calls += 1
        self.texts_encoded += len(texts)
        self.prompts_seen.append(prompt_name)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                h = int.from_bytes(hashlib.md5(f"{self.seed}:{word}".encode()).digest()[:4], "little")
                out[i, h % self.dim] += 1.0 if h >> 31 else -1.0
            out[i, 0] += 1e-3  # no all-zero rows
        return out


class PromptedHashEncoder(HashEncoder):
    """A HashEncoder that declares prompts, like a sentence-transformers model with query prompts."""

    prompts = {"query": "query: ", "document": "passage: "}
