"""Sparse vectors from a SPLADE encoder folder: loaded by sentence-transformers' own ``SparseEncoder``, written as
term ids, weights and the tokens they stand for (``adapt embed``), scored by ``adapt bench``.

One row per text, in input order, its terms by descending weight::

    {"id": 0, "indices": [1012, 77, ...], "values": [2.31, 1.87, ...], "tokens": [" fox", " dog", ...]}

``.jsonl`` (or stdout) and ``.parquet`` (``id`` int64, ``indices`` list<int32>, ``values`` list<float32>,
``tokens`` list<string>, one row group per chunk); ``tokens`` are each id decoded alone (the token as stored
when that is part of a character; null for ids past the tokenizer's vocabulary). ``.npy`` is refused: a dense (texts x vocabulary) array is what sparse vectors
avoid. Files are written under a temporary name and renamed at the end.

An empty text is encoded as the tokenizer's EOS token (else BOS, else pad) and counted: sentence-transformers
cannot run a causal-LM module on a text of no tokens.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from adapt.errors import ConfigError, ModelLoadError
from adapt.files import atomic_path
from adapt.inference.texts import read_texts
from adapt.model.loading import parse_dtype

FORMATS = (".jsonl", ".parquet")
ROUTES = ("query", "document")  # the names adapt bench and --prompt give texts; a router routes on them


@dataclass
class SparseModel:
    """A SparseEncoder loaded from a folder; ``encode`` returns a scipy CSR matrix (texts x vocabulary), float32."""
    encoder: object
    name: str
    fingerprint: str = ""
    empty: int = 0  # empty texts met so far (encoded as a lone special token)
    _tokens: dict = field(default_factory=dict)

    @property
    def routed(self) -> bool:
        """Whether queries and documents take different routes (inference-free queries)."""
        return type(self.encoder[0]).__name__ == "Router"

    @property
    def dim(self) -> int:
        return int(self.encoder.get_embedding_dimension())

    def encode(self, texts: list[str], *, batch_size: int = 32, prompt_name: str | None = None):
        from scipy.sparse import csr_matrix

        tok = self.encoder.tokenizer
        filler = next((t for t in (tok.eos_token, tok.bos_token, tok.pad_token) if t), " ")
        self.empty += sum(1 for t in texts if not t)
        texts = [t if t else filler for t in texts]
        task = prompt_name if prompt_name in ROUTES else None  # a router's route (inference-free queries)
        prompt_name = prompt_name if prompt_name in (self.encoder.prompts or {}) else None
        if not texts:
            return csr_matrix((0, self.dim), dtype=np.float32)
        vectors = self.encoder.encode(texts, batch_size=batch_size, prompt_name=prompt_name, task=task,
                                      convert_to_sparse_tensor=True, show_progress_bar=False)
        vectors = vectors.detach().to("cpu", torch.float32).coalesce()
        rows, cols = vectors.indices().numpy()
        return csr_matrix((vectors.values().numpy(), (rows, cols)), shape=tuple(vectors.shape), dtype=np.float32)

    def tokens(self, ids) -> list[str | None]:
        """Each vocabulary id decoded alone, for a person to read (the stored token when that is part of a character;
        None past the tokenizer's vocabulary)."""
        tok, out = self.encoder.tokenizer, []
        for i in ids:
            i = int(i)
            if i not in self._tokens:
                text = tok.decode([i]) if i < len(tok) else None
                if text is not None and "\ufffd" in text:  # part of a character (byte-level BPE): its token as stored
                    text = tok.convert_ids_to_tokens(i)
                self._tokens[i] = text
            out.append(self._tokens[i])
        return out


def load_sparse(source, *, dtype="auto", device: str | None = None, max_length: int | None = None) -> SparseModel:
    """Load the SparseEncoder folder ``source`` (fp32 on the CPU and bf16/fp16 on a GPU for ``dtype="auto"``)."""
    from sentence_transformers import SparseEncoder

    from adapt.export.sparse import require_sparse_support

    require_sparse_support(f"sparse encoders such as {source}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch_dtype = parse_dtype(dtype) or (torch.float32 if device == "cpu" else
                                         torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no per-tensor loading bars in `adapt embed` output (as adapt.inference.encoder)
    try:
        encoder = SparseEncoder(str(source), device=device, model_kwargs={"dtype": torch_dtype})
    except Exception as err:  # noqa: BLE001 - every failure here is "not a sparse encoder we can load"
        raise ModelLoadError(f"cannot load a sparse encoder from {source}: {type(err).__name__}: {err}") from err
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if max_length:
        encoder.max_seq_length = int(max_length)
    manifest = Path(source) / "adapt_export.json"
    stamp = f"{manifest.stat().st_mtime_ns}" if manifest.is_file() else ""
    return SparseModel(encoder, Path(source).name, f"sparse:{Path(source).resolve()}:{stamp}:{torch_dtype}")


def sorted_rows(matrix) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    """(indices, values) of each row of a CSR matrix, heaviest term first."""
    for r in range(matrix.shape[0]):
        start, end = matrix.indptr[r], matrix.indptr[r + 1]
        idx, val = matrix.indices[start:end], matrix.data[start:end]
        order = np.argsort(-val, kind="stable")
        yield idx[order].astype(np.int32), val[order].astype(np.float32)


@dataclass
class SparseEmbedSummary:
    n: int
    dim: int  # vocabulary size
    seconds: float
    output: str
    empty: int = 0
    active_terms: float = 0.0  # average non-zero weights per vector

    def rate_line(self) -> str:
        seconds = max(self.seconds, 1e-9)
        return (f"embedded {self.n:,} texts in {self.seconds:.1f} s: {self.n / seconds:,.1f} texts/s (sparse, "
                f"{self.active_terms:.1f} active terms per text on average)")


def check_sparse_output(output_path) -> None:
    if output_path is None or str(output_path) == "-":
        return
    suffix = Path(output_path).suffix.lower()
    if suffix == ".npy":
        raise ConfigError(f"{output_path}: a sparse encoder's vectors do not go in .npy (a dense texts x vocabulary "
                          "array); write .jsonl or .parquet (term ids, weights and tokens)")
    if suffix not in FORMATS:
        raise ConfigError(f"{output_path}: unsupported output format for sparse vectors {suffix or '(no extension)'}; "
                          f"use {', '.join(FORMATS)} (or no -o for jsonl on stdout)")


def embed_sparse(source, texts: Iterable[str], output_path=None, *, n: int | None = None,
                 prompt_name: str | None = None, batch_size: int = 32, max_length: int | None = None, dtype="auto",
                 device: str | None = None, chunk_size: int = 10_000,
                 show_progress: bool = False) -> SparseEmbedSummary:
    """Encode ``texts`` with the sparse encoder folder ``source`` and write their rows (see the module docstring);
    ``n``: how many texts there are, for the progress bar."""
    from tqdm.auto import tqdm

    check_sparse_output(output_path)
    start = time.perf_counter()
    model = load_sparse(source, dtype=dtype, device=device, max_length=max_length)
    route = model.routed and prompt_name in ROUTES  # a router's route name works without a prompt of that name
    if prompt_name and prompt_name not in (model.encoder.prompts or {}) and not route:
        raise ConfigError(f"{model.name} has no prompt named {prompt_name!r}; its prompts: "
                          f"{', '.join(model.encoder.prompts or {}) or 'none'}")
    texts, total = iter(texts), n
    n = active = 0
    bar = tqdm(total=total, desc="embedding", unit="text", disable=not show_progress, file=sys.stderr)

    def chunks():
        while True:
            chunk = [t for _, t in zip(range(chunk_size), texts)]
            if not chunk:
                return
            yield chunk

    def rows():
        nonlocal n, active
        for chunk in chunks():
            matrix = model.encode(chunk, batch_size=batch_size, prompt_name=prompt_name)
            active += int(matrix.nnz)
            batch = [{"id": n + i, "indices": idx.tolist(), "values": val.tolist(), "tokens": model.tokens(idx)}
                     for i, (idx, val) in enumerate(sorted_rows(matrix))]
            n += len(batch)
            bar.update(len(batch))
            yield batch

    try:
        if output_path is None or str(output_path) == "-":
            for batch in rows():
                sys.stdout.writelines(json.dumps(row) + "\n" for row in batch)
                sys.stdout.flush()
        elif Path(output_path).suffix.lower() == ".jsonl":
            with atomic_path(output_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                for batch in rows():
                    f.writelines(json.dumps(row) + "\n" for row in batch)
        else:
            _write_parquet(output_path, rows())
    finally:
        bar.close()
    return SparseEmbedSummary(n=n, dim=model.dim, seconds=round(time.perf_counter() - start, 3),
                              output=str(output_path) if output_path not in (None, "-") else "-", empty=model.empty,
                              active_terms=active / max(n, 1))


def embed_sparse_folder(source, texts, input_path, output_path, *, field: str = "text", prompt_name=None,
                        batch_size: int = 32, max_length=None, dtype="auto", device=None, chunk_size: int = 10_000,
                        show_progress: bool = True, **_) -> SparseEmbedSummary:
    """``adapt embed`` of a sparse encoder folder (the ``sparse`` entry of :mod:`adapt.export.kinds`): the output
    format is checked before the input is opened and the model loaded; the dense-only options (shards, normalize,
    backend), refused by :func:`adapt.inference.embed.embed`, are not used."""
    check_sparse_output(output_path)
    stream, n = read_texts(input_path, texts, field=field)
    return embed_sparse(source, stream, output_path, n=n, prompt_name=prompt_name, batch_size=batch_size,
                        max_length=max_length, dtype=dtype, device=device, chunk_size=chunk_size,
                        show_progress=show_progress)


def _write_parquet(path, batches) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.int64()), ("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float32())),
                        ("tokens", pa.list_(pa.string()))])
    with atomic_path(path) as tmp:
        writer = pq.ParquetWriter(str(tmp), schema)
        try:
            for batch in batches:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
        finally:
            writer.close()
