"""Inputs and outputs of ``adapt embed``: texts in, vectors out, larger than memory if need be.

Inputs: texts given as arguments, stdin (one text a line), or a file that :mod:`adapt.readers` reads:
text (``.txt``..., one text a line), JSON lines (``.jsonl``..., field ``field``, default "text"),
``.csv`` (column ``field``), ``.parquet`` (column ``field``, read in row batches); all but Parquet may
be compressed (``.gz .bz2 .xz``), and a UTF-8 byte order mark is dropped.

Outputs: ``.npy`` (float32 (n, dim), written incrementally through ``np.lib.format.open_memmap``),
``.parquet`` (``id`` + ``embedding`` fixed-size list, written row group by row group), ``.jsonl``
(``{"id": i, "embedding": [...]}`` a line), or stdout as jsonl. ``id`` is the text's 0-based position
in the input. Files are written to a temporary name and renamed at the end.

Bad input is an :class:`~adapt.errors.AdaptError`: a missing file or column, bytes that are not UTF-8
or a malformed line (:class:`DataError` naming the line), no texts at all. Empty texts and texts
longer than the encoder's limit are embedded as :mod:`adapt.encoder` defines, counted in the summary.
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
from typing import Iterable, Iterator

import numpy as np

from adapt.bidirectional import attends_causally
from adapt.errors import ConfigError, DataError
from adapt.readers import file_format, iter_lines, iter_records, supported

INPUT_FORMATS = ("text", "jsonl", "csv", "parquet")  # adapt.readers formats
OUTPUT_FORMATS = (".npy", ".parquet", ".jsonl")


@dataclass
class EmbedSummary:
    n: int
    dim: int
    seconds: float
    truncated: int
    empty: int
    output: str


def read_records(path, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of a JSON lines/CSV/Parquet file holding ``fields``; ``where``
    ("file:line" or "file: row i") names the record in error messages. See :func:`adapt.readers.iter_records`."""
    return iter_records(path, fields)


def _field_texts(records: Iterator[tuple[str, dict]], field: str) -> Iterator[str]:
    for where, record in records:
        if record[field] is None:  # iter_records let only text or null through
            raise DataError(f"{where}: {field!r} is None, not text")
        yield record[field]


def read_texts(input_path=None, texts: Iterable[str] | None = None, *,
               field: str = "text") -> tuple[Iterable[str], int | None]:
    """The texts to embed and their count when known cheaply (None for streams)."""
    if texts is not None and input_path is not None:
        raise ConfigError("give texts or an input file, not both")
    if texts is not None:
        texts = [texts] if isinstance(texts, str) else list(texts)
        return texts, len(texts)
    if input_path is None or str(input_path) == "-":
        return (line.rstrip("\r\n") for line in sys.stdin), None
    path = Path(input_path)
    kind = file_format(path)
    if kind == "text":
        return (text for _, text in iter_lines(path)), None
    if kind not in INPUT_FORMATS and path.is_file():
        raise DataError(f"{path}: unsupported input format {path.suffix or '(no extension)'}; use one of "
                        f"{supported(INPUT_FORMATS)}")
    records = iter_records(path, text_fields=(field,))  # a missing file: "no such file"
    n = None
    if kind == "parquet":
        import pyarrow.parquet as pq
        try:
            n = pq.ParquetFile(path).metadata.num_rows
        except Exception:  # noqa: BLE001 - a bad file is reported, with its name, when it is read
            n = None
    return _field_texts(records, field), n


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


def embed(encoder_source, texts: Iterable[str] | None = None, input_path=None, output_path=None, *,
          field: str = "text", prompt_name: str | None = None, batch_size: int = 32, max_length: int | None = None,
          normalize: bool | None = None, dtype="auto", device: str | None = None, show_progress: bool = True,
          chunk_size: int = 10_000, allow_causal: bool = False) -> EmbedSummary:
    """``adapt embed``: encode texts (arguments, a file or stdin) and write the vectors (file or stdout).

    A causal model (a decoder never converted: ``is_causal`` is not false) is refused unless
    ``allow_causal``: each of its vectors would see only the text left of each token, silently.

    ``encoder_source`` is anything :func:`adapt.encoder.load_encoder` loads, or an ``Encoder``. Inputs
    and outputs are checked before the model is loaded, so a typo fails fast.
    """
    from adapt.encoder import Encoder, load_encoder

    stream, n = read_texts(input_path, texts, field=field)
    if output_path is not None and str(output_path) != "-":
        _writer_class(output_path)
    stream = iter(stream)
    first = next(stream, None)  # opens and checks the input (format, field) before the model loads
    if first is None:
        raise DataError(f"{input_path or 'the input'} holds no texts to embed")
    stream = itertools.chain([first], stream)
    start = time.perf_counter()
    encoder = encoder_source if isinstance(encoder_source, Encoder) else load_encoder(
        encoder_source, normalize=normalize, dtype=dtype, device=device, max_length=max_length)
    if not allow_causal and attends_causally(encoder.model):
        raise ConfigError(f"{encoder.name} is a causal {encoder.model.config.model_type!r} model (config.is_causal is "
                          "not false): its vectors would see only the text to the left of each token. Convert it "
                          "first (`adapt convert`), or pass --allow-causal to embed it as it is.")
    writer = open_writer(output_path, encoder.dim, n)
    try:
        stats = encoder.encode_stream(stream, writer, chunk_size=chunk_size, batch_size=batch_size,
                                      prompt_name=prompt_name, normalize=normalize, show_progress=show_progress)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return EmbedSummary(n=stats.n, dim=encoder.dim, seconds=round(time.perf_counter() - start, 3),
                        truncated=stats.truncated, empty=stats.empty,
                        output=str(output_path) if output_path not in (None, "-") else "-")
