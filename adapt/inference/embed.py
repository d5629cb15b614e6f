"""Inputs and outputs of ``adapt embed``: texts in, vectors out, larger than memory if need be.

Inputs: texts given as arguments, stdin (one text a line), or a file that :mod:`adapt.data.readers` reads:
text (``.txt``..., one text a line), JSON lines (``.jsonl``..., field ``field``, default "text"),
``.csv`` (column ``field``), ``.parquet`` (column ``field``, read in row batches); all but Parquet may
be compressed (``.gz .bz2 .xz``), and a UTF-8 byte order mark is dropped.

Outputs: ``.npy`` (float32 (n, dim), written incrementally through ``np.lib.format.open_memmap``),
``.parquet`` (``id`` + ``embedding`` fixed-size list, written row group by row group), ``.jsonl``
(``{"id": i, "embedding": [...]}`` a line), or stdout as jsonl. ``id`` is the text's 0-based position
in the input. Files are written to a temporary name and renamed at the end.

Bad input is an :class:`~adapt.errors.AdaptError`: a missing file or column, bytes that are not UTF-8
or a malformed line (:class:`DataError` naming the line), no texts at all. Empty texts and texts
longer than the encoder's limit are embedded as :mod:`adapt.inference.encoder` defines, counted in the summary.
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from adapt.model.bidirectional import attends_causally
from adapt.inference.shards import (barrier, embed_shards, end_group, gather, iter_shards, pending_rows, processes,
                                read_manifest, run_key, start_group, write_manifest)
from adapt.errors import ConfigError, DataError
from adapt.export import kinds
from adapt.export.backends import TORCH
from adapt.inference.texts import INPUT_FORMATS, count_texts, read_records, read_texts  # noqa: F401 - also read from here

OUTPUT_FORMATS = (".npy", ".parquet", ".jsonl")


@dataclass
class EmbedSummary:
    n: int                      # texts in the input (= output rows)
    dim: int
    seconds: float
    truncated: int
    empty: int
    output: str
    tokens: int = 0             # tokens embedded in this run (skipped shards not counted)
    embedded: int = 0           # texts embedded in this run
    backend: str = TORCH
    shards: str | None = None   # the shard folder of a sharded run
    shards_written: int = 0
    shards_skipped: int = 0

    def rate_line(self) -> str:
        """The closing line: texts and tokens per second of what this run embedded."""
        seconds = max(self.seconds, 1e-9)
        line = (f"embedded {self.embedded:,} texts ({self.tokens:,} tokens) in {self.seconds:.1f} s: "
                f"{self.embedded / seconds:,.1f} texts/s, {self.tokens / seconds:,.0f} tokens/s ({self.backend})")
        if self.shards is not None:
            line += (f"; shards {self.shards_written} written, {self.shards_skipped} already done, in "
                     f"{self.shards}")
        return line


class _FileWriter:
    """Writes to a temporary file next to ``path``; ``close`` renames it, ``abort`` removes it."""

    def __init__(self, path: Path, dim: int):
        self.path, self.dim, self.rows = Path(path), dim, 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        self.tmp = Path(tmp)

    def write(self, vectors: np.ndarray) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        pass

    def close(self) -> None:
        self._finish()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        for suffix in ("", ".raw"):
            Path(str(self.tmp) + suffix).unlink(missing_ok=True)


class NpyWriter(_FileWriter):
    """float32 ``(n, dim)`` .npy through ``open_memmap``; with ``n`` unknown, rows are spooled to a raw
    file first and copied into the memmap at the end."""

    def __init__(self, path, dim: int, n: int | None = None):
        super().__init__(path, dim)
        self.memmap = np.lib.format.open_memmap(self.tmp, mode="w+", dtype=np.float32, shape=(n, dim)) if n else None
        self.spool = None if n else open(str(self.tmp) + ".raw", "wb")

    def write(self, vectors):
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if self.memmap is not None:
            self.memmap[self.rows:self.rows + len(vectors)] = vectors
        else:
            self.spool.write(vectors.tobytes())
        self.rows += len(vectors)

    def _finish(self):
        if self.memmap is not None:
            if self.rows != self.memmap.shape[0]:
                raise DataError(f"expected {self.memmap.shape[0]} texts but read {self.rows}")
            self.memmap.flush()
            del self.memmap
            return
        self.spool.close()
        raw = np.memmap(str(self.tmp) + ".raw", dtype=np.float32, mode="r", shape=(self.rows, self.dim)) \
            if self.rows else np.zeros((0, self.dim), np.float32)
        out = np.lib.format.open_memmap(self.tmp, mode="w+", dtype=np.float32, shape=(self.rows, self.dim))
        for start in range(0, self.rows, 65536):
            out[start:start + 65536] = raw[start:start + 65536]
        out.flush()
        del out, raw
        Path(str(self.tmp) + ".raw").unlink(missing_ok=True)

    def abort(self):
        if self.spool is not None:
            self.spool.close()
        self.memmap = None
        super().abort()


class ParquetWriter(_FileWriter):
    """``id`` (int64) + ``embedding`` (fixed-size list of float32), one row group per chunk."""

    def __init__(self, path, dim: int, n: int | None = None):
        import pyarrow as pa
        import pyarrow.parquet as pq

        super().__init__(path, dim)
        self.pa = pa
        self.schema = pa.schema([("id", pa.int64()), ("embedding", pa.list_(pa.float32(), dim))])
        self.writer = pq.ParquetWriter(self.tmp, self.schema)

    def write(self, vectors):
        pa = self.pa
        ids = pa.array(np.arange(self.rows, self.rows + len(vectors), dtype=np.int64))
        flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1))
        self.writer.write_table(pa.Table.from_arrays([ids, pa.FixedSizeListArray.from_arrays(flat, self.dim)],
                                                     schema=self.schema))
        self.rows += len(vectors)

    def _finish(self):
        self.writer.close()

    def abort(self):
        self.writer.close()
        super().abort()


class JsonlWriter(_FileWriter):
    """``{"id": i, "embedding": [...]}`` a line, to a file (renamed at the end) or to a stream."""

    def __init__(self, path, dim: int, n: int | None = None, stream=None):
        if stream is None:
            super().__init__(path, dim)
            self.file = open(self.tmp, "w", encoding="utf-8")
        else:
            self.path, self.dim, self.rows, self.tmp, self.file = None, dim, 0, None, stream

    def write(self, vectors):
        for row in np.asarray(vectors, dtype=np.float32).tolist():
            self.file.write(json.dumps({"id": self.rows, "embedding": row}) + "\n")
            self.rows += 1
        self.file.flush()

    def close(self):
        if self.tmp is not None:
            self.file.close()
            os.replace(self.tmp, self.path)

    def abort(self):
        if self.tmp is not None:
            self.file.close()
            super().abort()


def open_writer(output_path, dim: int, n: int | None = None):
    """The writer for ``output_path``'s extension; None or "-" writes jsonl to stdout."""
    if output_path is None or str(output_path) == "-":
        return JsonlWriter(None, dim, stream=sys.stdout)
    return _writer_class(output_path)(Path(output_path), dim, n)


def _writer_class(output_path):
    suffix = Path(output_path).suffix.lower()
    classes = {".npy": NpyWriter, ".parquet": ParquetWriter, ".jsonl": JsonlWriter}
    if suffix not in classes:
        raise ConfigError(f"{output_path}: unsupported output format {suffix or '(no extension)'}; use one of "
                          f"{', '.join(OUTPUT_FORMATS)} (or no -o for jsonl on stdout)")
    return classes[suffix]


def is_shard_folder(output_path) -> bool:
    """``-o vectors/`` (a trailing slash, a folder that exists, or a name with no extension): shards + manifest."""
    if output_path is None or str(output_path) == "-":
        return False
    path = Path(output_path)
    return str(output_path).endswith(("/", os.sep)) or path.is_dir() or not path.suffix


def _bar(show: bool, total: int | None, desc: str):
    if not show:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="text", dynamic_ncols=True, smoothing=0.05, file=sys.stderr)


def embed(encoder_source, texts: Iterable[str] | None = None, input_path=None, output_path=None, *,
          field: str = "text", prompt_name: str | None = None, batch_size: int = 32, max_length: int | None = None,
          normalize: bool | None = None, dtype="auto", device: str | None = None, show_progress: bool = True,
          chunk_size: int = 10_000, allow_causal: bool = False, backend: str | None = None,
          shards: bool | None = None, shard_size: int = 10_000, dim: int | None = None) -> EmbedSummary:
    """``adapt embed``: encode texts (arguments, a file or stdin) and write the vectors (file or stdout).

    A causal model (a decoder never converted: ``is_causal`` is not false) is refused unless
    ``allow_causal``: each of its vectors would see only the text left of each token, silently.

    ``encoder_source`` is anything :func:`adapt.inference.encoder.load_encoder` loads, or an ``Encoder``; ``backend``
    None runs the graph an exported folder holds (ONNX/OpenVINO), else torch. Inputs and outputs are
    checked before the model is loaded, so a typo fails fast.

    Sharded and resumable (:mod:`adapt.inference.shards`) when ``output_path`` is a folder (``vectors/``),
    when ``shards`` is true (``vectors.npy`` then gets its shards in ``vectors.npy.shards/`` and is
    merged from them at the end), and always under several processes (``torchrun`` / ``accelerate
    launch``): each process embeds its share of the shards; a rerun skips the finished ones.

    ``dim``: keep the first ``dim`` dimensions (an encoder trained with Matryoshka sizes), re-normalized
    unless ``normalize`` is False.
    """
    from adapt.inference.encoder import Encoder

    normalize = True if dim is not None and normalize is None else normalize
    procs = processes()
    sharded = bool(shards) or procs.world > 1 or is_shard_folder(output_path)
    kind = kinds.get(kinds.DENSE) if isinstance(encoder_source, Encoder) else kinds.of_folder(encoder_source)
    asked = {"shards": sharded, "normalize": bool(normalize), "backend": backend not in (None, TORCH)}
    if any(on and option not in kind.options for option, on in asked.items()):
        raise ConfigError(f"{encoder_source} is a {kind.name} encoder: {kind.embed_refusal}")
    return kind.run("embed", encoder_source, texts, input_path, output_path, field=field, prompt_name=prompt_name,
                    batch_size=batch_size, max_length=max_length, normalize=normalize, dtype=dtype, device=device,
                    show_progress=show_progress, chunk_size=chunk_size, allow_causal=allow_causal, backend=backend,
                    shard_size=shard_size, dim=dim, sharded=sharded, procs=procs)


def embed_dense(encoder_source, texts, input_path, output_path, *, field, prompt_name, batch_size, max_length,
                normalize, dtype, device, show_progress, chunk_size, allow_causal, backend, shard_size, dim, sharded,
                procs) -> EmbedSummary:
    """``adapt embed`` of a dense encoder (the ``dense`` entry of :mod:`adapt.export.kinds`): vectors to a file,
    stdout or shards (see :func:`embed`)."""
    from adapt.inference.encoder import Encoder

    folder, merge_to = _shard_targets(output_path, sharded, procs, texts, input_path)
    stream, n = _open_input(input_path, texts, field, output=merge_to or (None if sharded else output_path))
    if n is None and show_progress and procs.main:
        n = count_texts(input_path)
    start = time.perf_counter()
    if device is None and procs.world > 1:
        import torch
        device = f"cuda:{procs.local_rank}" if torch.cuda.is_available() else None
    made_group = start_group(procs) if sharded else False
    try:
        encoder = _checked_encoder(encoder_source, allow_causal, normalize=normalize, dtype=dtype, device=device,
                                   max_length=max_length, backend=backend, truncate_dim=dim)
        if sharded:
            return _embed_sharded(encoder, stream, n, folder, merge_to, procs=procs, start=start,
                                  prompt_name=prompt_name, normalize=normalize, batch_size=batch_size,
                                  shard_size=shard_size, show_progress=show_progress,
                                  source={"model": str(encoder.name if isinstance(encoder_source, Encoder)
                                                       else encoder_source),
                                          "input": str(input_path) if input_path is not None else "arguments",
                                          "field": field, "prompt_name": prompt_name})
        return _embed_to_output(encoder, stream, n, output_path, start=start, prompt_name=prompt_name,
                                normalize=normalize, batch_size=batch_size, chunk_size=chunk_size,
                                show_progress=show_progress)
    finally:
        if made_group:
            end_group()


def _shard_targets(output_path, sharded: bool, procs, texts, input_path) -> tuple[Path | None, Path | None]:
    """(shard folder, file merged from it) of a sharded run, checked; (None, None) when not sharded."""
    if not sharded:
        return None, None
    if output_path is None or str(output_path) == "-":
        raise ConfigError("sharded embedding (several processes, or --shards) writes files: give -o DIR/ "
                          "(shards + manifest) or -o FILE.npy|.parquet|.jsonl (merged from FILE.shards/)")
    if procs.world > 1 and texts is None and (input_path is None or str(input_path) == "-"):
        raise ConfigError("several processes cannot share stdin: give --input FILE")
    if is_shard_folder(output_path):
        return Path(output_path), None
    return Path(f"{output_path}.shards"), Path(output_path)


def _open_input(input_path, texts, field: str, output) -> tuple[Iterable[str], int | None]:
    """The texts and their count if known; the output format (``output``, a file) and the input's first text are
    checked before the model loads, so a typo fails fast."""
    stream, n = read_texts(input_path, texts, field=field)
    if output is not None and str(output) != "-":
        _writer_class(output)
    stream = iter(stream)
    first = next(stream, None)  # opens and checks the input (format, field)
    if first is None:
        raise DataError(f"{input_path or 'the input'} holds no texts to embed")
    return itertools.chain([first], stream), n


def _checked_encoder(encoder_source, allow_causal: bool, **load):
    """The encoder to run (``encoder_source`` loaded, or an ``Encoder`` truncated to ``truncate_dim``); a causal
    model is refused unless ``allow_causal``."""
    from adapt.inference.encoder import Encoder, load_encoder, truncated

    encoder = truncated(encoder_source, load["truncate_dim"]) if isinstance(encoder_source, Encoder) else \
        load_encoder(encoder_source, **load)
    if not allow_causal and attends_causally(encoder.model):
        raise ConfigError(f"{encoder.name} is a causal {encoder.model.config.model_type!r} model (config.is_causal "
                          "is not false): its vectors would see only the text to the left of each token. Convert "
                          "it first (`adapt convert`), or pass --allow-causal to embed it as it is.")
    return encoder


def _embed_to_output(encoder, stream, n, output_path, *, start, prompt_name, normalize, batch_size, chunk_size,
                     show_progress) -> EmbedSummary:
    """One process, no shards: the vectors to one file (written to a temporary name, renamed) or stdout."""
    from adapt.inference.encoder import backend_of

    writer = open_writer(output_path, encoder.dim, n)
    bar = _bar(show_progress, n, "embedding")
    try:
        stats = encoder.encode_stream(stream, writer, chunk_size=chunk_size, batch_size=batch_size,
                                      prompt_name=prompt_name, normalize=normalize,
                                      on_batch=bar.update if bar is not None else None)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    return EmbedSummary(n=stats.n, dim=encoder.dim, seconds=round(time.perf_counter() - start, 3),
                        truncated=stats.truncated, empty=stats.empty, tokens=stats.tokens, embedded=stats.n,
                        output=str(output_path) if output_path not in (None, "-") else "-", backend=backend_of(encoder))


def _embed_sharded(encoder, stream, n, folder: Path, merge_to: Path | None, *, procs, start, prompt_name, normalize,
                   batch_size, shard_size, show_progress, source) -> EmbedSummary:
    from adapt.inference.encoder import backend_of

    prompt = encoder.resolve_prompt(prompt_name)
    key = run_key(encoder, backend=backend_of(encoder), prompt=prompt, normalize=normalize, shard_size=shard_size)
    total = pending_rows(folder, n, shard_size, procs) if n is not None else None
    bar = _bar(show_progress and procs.main,
               total, f"embedding (process 0 of {procs.world})" if procs.world > 1 else "embedding")
    try:
        run = embed_shards(encoder, stream, folder, procs=procs, key=key, shard_size=shard_size,
                           batch_size=batch_size, prompt=prompt, normalize=normalize,
                           progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    runs = gather(procs, run)  # also the barrier: every shard is written
    manifest = None
    if procs.main:
        manifest = write_manifest(folder, n=run.n, shard_size=shard_size, key=key,
                                  extra={**source, "encoder": encoder.name, "backend": backend_of(encoder),
                                         "processes": procs.world})
        if merge_to is not None:
            merge_shards(folder, merge_to, manifest=manifest)
    barrier(procs)  # the command ends everywhere with the output in place
    if procs.main:  # one warning for the texts truncated or empty among those embedded now
        from adapt.inference.encoder import EncodeStats

        EncodeStats(n=sum(r.embedded for r in runs), truncated=sum(r.truncated for r in runs),
                    empty=sum(r.empty for r in runs)).warn(encoder.max_length)
    if manifest is None:
        manifest = read_manifest(folder)
    return EmbedSummary(n=run.n, dim=encoder.dim, seconds=round(time.perf_counter() - start, 3),
                        truncated=manifest["truncated"], empty=manifest["empty"],
                        tokens=sum(r.tokens for r in runs), embedded=sum(r.embedded for r in runs),
                        output=str(merge_to or folder), backend=backend_of(encoder), shards=str(folder),
                        shards_written=sum(r.written_shards for r in runs),
                        shards_skipped=sum(r.skipped_shards for r in runs))


def merge_shards(folder, output_path, *, manifest: dict | None = None, verify: bool = True) -> EmbedSummary:
    """``adapt embed --merge DIR -o FILE``: join a finished shard folder, in input order, into .npy/.parquet/.jsonl
    (ids are input positions), each shard checked against the manifest's checksum."""
    start = time.perf_counter()
    to_stdout = output_path is None or str(output_path) == "-"
    if not to_stdout:
        _writer_class(output_path)  # a bad extension fails before any shard is read
    manifest = manifest or read_manifest(folder)
    writer = open_writer(None if to_stdout else output_path, manifest["dim"], manifest["n"])
    try:
        for vectors in iter_shards(folder, manifest, verify=verify):
            for at in range(0, len(vectors), 65536):
                writer.write(np.asarray(vectors[at:at + 65536]))
        if writer.rows != manifest["n"]:
            raise DataError(f"{folder}: the shards hold {writer.rows} vectors, the manifest says {manifest['n']}")
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return EmbedSummary(n=manifest["n"], dim=manifest["dim"], seconds=round(time.perf_counter() - start, 3),
                        truncated=manifest["truncated"], empty=manifest["empty"], tokens=manifest["tokens"],
                        embedded=0, output="-" if to_stdout else str(output_path),
                        backend=manifest.get("backend", TORCH), shards=str(folder))
