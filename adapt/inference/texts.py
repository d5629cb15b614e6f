"""The texts ``adapt embed`` reads: arguments, stdin (one text a line), or a file that :mod:`adapt.data.readers`
reads: text (``.txt``..., one text a line), JSON lines (``.jsonl``..., field ``field``, default "text"), ``.csv``
(column ``field``), ``.parquet`` (column ``field``, read in row batches)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterable, Iterator

from adapt.data.readers import file_format, iter_lines, iter_records, supported
from adapt.errors import ConfigError, DataError

INPUT_FORMATS = ("text", "jsonl", "csv", "parquet")  # adapt.data.readers formats


def read_records(path, fields: tuple[str, ...]) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of a JSON lines/CSV/Parquet file holding ``fields``; ``where``
    ("file:line" or "file: row i") names the record in error messages. See :func:`adapt.data.readers.iter_records`."""
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


def count_texts(input_path) -> int | None:
    """How many texts a file holds, for a progress bar's ETA: exact for text and JSON lines (one cheap pass),
    Parquet's row count; None for CSV and stdin."""
    if input_path is None or str(input_path) == "-" or not Path(input_path).is_file():
        return None
    kind = file_format(input_path)
    try:
        if kind == "text":
            return sum(1 for _ in iter_lines(input_path))
        if kind == "jsonl":
            return sum(1 for _, line in iter_lines(input_path) if line.strip())
        if kind == "parquet":
            import pyarrow.parquet as pq
            return pq.ParquetFile(input_path).metadata.num_rows
    except Exception:  # noqa: BLE001 - a bad file is reported, with its line, when it is read
        return None
    return None
