"""Reading user data files: lines of UTF-8 text and records of JSON lines, CSV and Parquet, streamed.

The one module that opens input files (corpora in :mod:`adapt.data.token_store`, ``adapt embed`` inputs,
``adapt finetune`` data, contrastive pairs), so all of them accept the same files:

- The format comes from the name (:func:`file_format`): text (``.txt .text .md .cor``), JSON lines
  (``.jsonl .jsonlines .ndjson .json``), CSV (``.csv``), Parquet (``.parquet``). All but Parquet may
  be compressed: a last suffix ``.gz .bz2 .xz`` (``a.jsonl.gz``); Parquet compresses inside the file.
- Text is UTF-8; a UTF-8 byte order mark is dropped. A NUL byte (a binary or UTF-16 file) or bytes
  that are not UTF-8 raise :class:`DataError` naming ``FILE:LINE`` and how to convert the file.
- Records are dicts, each with a :class:`Where` naming it in messages: ``FILE:LINE`` (JSON lines;
  CSV: the record's last line) or ``FILE: row N`` (Parquet, 1-based). A line that is not JSON or not
  an object, and a missing field or column, raise :class:`DataError` saying where and what to do.
- Nothing reads a whole file: files are read a line at a time, Parquet in row batches. The readers
  are generators; the path is checked (exists, is a file, known format) when they are called.

A bottom-layer module: it imports only the standard library, pyarrow and :mod:`adapt.errors`.
"""
from __future__ import annotations

import bz2
import csv
import gzip
import json
import lzma
import zlib
from pathlib import Path
from typing import Iterable, Iterator

from adapt.errors import DataError

TEXT_EXTS = (".txt", ".text", ".md", ".cor")  # .cor: plain-text corpora as gensim ships them
JSONL_EXTS = (".jsonl", ".jsonlines", ".ndjson", ".json")
CSV_EXTS = (".csv",)
PARQUET_EXTS = (".parquet",)
FORMATS = {"text": TEXT_EXTS, "jsonl": JSONL_EXTS, "csv": CSV_EXTS, "parquet": PARQUET_EXTS}
RECORD_FORMATS = ("jsonl", "csv", "parquet")
COMPRESSED_EXTS = (".gz", ".bz2", ".xz")
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def file_format(path) -> str | None:
    """The format named by ``path``: "text", "jsonl", "csv", "parquet", or None when unknown.

    ``a.jsonl.gz`` is "jsonl" (compressed); ``a.parquet.gz`` is None (Parquet compresses inside).
    """
    suffixes = [s.lower() for s in Path(path).suffixes]
    compressed = bool(suffixes) and suffixes[-1] in COMPRESSED_EXTS
    if compressed:
        suffixes.pop()
    ext = suffixes[-1] if suffixes else ""
    for name, exts in FORMATS.items():
        if ext in exts and not (compressed and name == "parquet"):
            return name
    return None


def supported(formats: Iterable[str] = tuple(FORMATS)) -> str:
    """The extensions of ``formats`` for messages: ``".jsonl, ..., .parquet (... may end in .gz/.bz2/.xz)"``."""
    formats = tuple(formats)
    exts = ", ".join(ext for name in formats for ext in FORMATS[name])
    which = "all but .parquet" if "parquet" in formats else "each"
    return f"{exts} ({which} may end in {'/'.join(COMPRESSED_EXTS)})"


def _existing_file(path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file" if not path.exists() else f"{path} is not a file")
    return path


# ------------------------------------------------------------------------------------------- lines

def iter_lines(path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its line ending) of a UTF-8 text file, compressed or not.

    A generator; see the module docstring for BOMs, compression and the errors it raises.
    """
    return _lines(_existing_file(path), keepends=False)


def _lines(path: Path, keepends: bool) -> Iterator[tuple[int, str]]:
    opener = _OPENERS.get(path.suffix.lower(), open)
    number = 0
    try:
        with opener(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                if b"\0" in raw:
                    raise DataError(f"{path}:{number}: holds a NUL byte, so it is a binary file (or UTF-16 text), "
                                    f"not UTF-8 text. Pass a text file; convert UTF-16 first, for example "
                                    f"`iconv -f utf-16 -t utf-8 IN > OUT`.")
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{number}: not valid UTF-8 (byte {raw[e.start]:#04x} at byte offset "
                                    f"{e.start} of the line). Convert the file to UTF-8, for example "
                                    f"`iconv -f latin1 -t utf-8 IN > OUT`.") from None
                if number == 1:
                    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark
                yield number, text if keepends else text.rstrip("\r\n")
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:  # a truncated or corrupt file
        raise DataError(f"{path}: cannot read it after line {number}: {e}") from e


# ----------------------------------------------------------------------------------------- records

class Where(str):
    """Where a record is, as messages name it: ``FILE:LINE`` or ``FILE: row N``; ``.line`` is the number."""

    line: int

    def __new__(cls, path, line: int, *, row: bool = False):
        self = super().__new__(cls, f"{path}: row {line}" if row else f"{path}:{line}")
        self.line = line
        return self


def iter_records(path, fields: Iterable[str] = (), *, text_fields: Iterable[str] = (), format: str | None = None,
                 batch_rows: int = 1024) -> Iterator[tuple[Where, dict]]:
    """(where, record) for each record of a JSON lines, CSV or Parquet file, streamed.

    Every record must hold ``fields`` and ``text_fields`` (JSON: each object; CSV and Parquet: the
    header or schema, checked before the first record); a ``text_fields`` value must be text or null
    (JSON: each value; Parquet: the column type; CSV cells are text, null in a short row). Blank JSON
    lines are skipped. Parquet reads only the columns named, or all when none is. ``format`` ("jsonl",
    "csv", "parquet") overrides the one :func:`file_format` reads from the name.
    """
    path = _existing_file(path)
    kind = format or file_format(path)
    text_fields = tuple(text_fields)
    need = tuple(dict.fromkeys((*fields, *text_fields)))
    if kind == "jsonl":
        return _jsonl(path, need, text_fields)
    if kind == "csv":
        return _csv(path, need)
    if kind == "parquet":
        return _parquet(path, need, text_fields, batch_rows)
    raise DataError(f"{path}: unsupported format {path.suffix or '(no extension)'}; use one of "
                    f"{supported(RECORD_FORMATS)}")


def text_field_of(record, field: str, where) -> str | None:
    """``record[field]`` when it is text, None when it is null; a DataError naming ``where`` when
    ``record`` is not an object, has no ``field`` or holds something else there."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with a {field!r} field, got {type(record).__name__}.")
    _require(record, (field,), where)
    value = record[field]
    if value is not None and not isinstance(value, str):
        raise DataError(f"{where}: {field!r} holds {type(value).__name__}, not text.")
    return value


def _need(fields) -> str:
    s = "s" if len(fields) > 1 else ""
    return (f"Every record needs {', '.join(map(repr, fields))}: rename the field{s} in the file, or, where the "
            f"command has a field option, set it to the name{s} this file uses.")


def _require(record: dict, fields, where) -> None:
    for field in fields:
        if field not in record:
            keys = ", ".join(map(repr, list(record)[:20])) or "none"
            raise DataError(f"{where}: no {field!r} field (fields: {keys}). {_need(fields)}")


def _jsonl(path: Path, need: tuple[str, ...], text_fields: tuple[str, ...]) -> Iterator[tuple[Where, dict]]:
    shape = "one JSON object" + (" like {" + ", ".join(f'"{f}": ...' for f in need) + "}" if need else "")
    for number, line in _lines(path, keepends=False):
        if not line.strip():
            continue
        where = Where(path, number)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg}). Each line must hold {shape} (JSON lines); "
                            f"convert a JSON array or pretty-printed JSON first.") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}. Each line must "
                            f"hold {shape} (JSON lines).")
        _require(record, need, where)
        for field in text_fields:
            text_field_of(record, field, where)
        yield where, record


def _csv(path: Path, need: tuple[str, ...]) -> Iterator[tuple[Where, dict]]:
    # csv joins a quoted field's lines itself, so it gets them with their line endings
    reader = csv.DictReader(text for _, text in _lines(path, keepends=True))
    try:
        columns = reader.fieldnames or []
        missing = [f for f in need if f not in columns]
        if missing:
            raise DataError(f"{path}: no column {missing[0]!r} (columns: {', '.join(columns) or 'none'}). "
                            f"{_need(need)}")
        for record in reader:
            yield Where(path, reader.line_num), record
    except csv.Error as e:
        raise DataError(f"{path}:{reader.line_num}: malformed CSV ({e}).") from None


def _parquet(path: Path, need: tuple[str, ...], text_fields: tuple[str, ...],
             batch_rows: int) -> Iterator[tuple[Where, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e}).") from None
    schema = file.schema_arrow
    missing = [f for f in need if f not in schema.names]
    if missing:
        raise DataError(f"{path}: no column {missing[0]!r} (columns: {', '.join(schema.names)}). {_need(need)}")
    for field in text_fields:
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
            raise DataError(f"{path}: column {field!r} holds {kind}, not text.")
    row = 0
    try:
        for batch in file.iter_batches(batch_size=batch_rows, columns=list(need) or None):
            for record in batch.to_pylist():
                row += 1
                yield Where(path, row, row=True), record
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read it after row {row}: {e}") from e
