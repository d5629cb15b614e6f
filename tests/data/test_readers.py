"""adapt.data.readers: every reader of user files decodes, decompresses and reports errors the same way,
streams (generators, nothing read ahead), and names FILE:LINE (or FILE: row N) in its messages."""
from __future__ import annotations

import bz2
import gzip
import inspect
import itertools
import json
import lzma

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from adapt.errors import DataError
from adapt.data.readers import Where, file_format, iter_lines, iter_records, supported, text_field_of

OPENERS = {"": open, ".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def write(path, data: bytes):
    with OPENERS[path.suffix if path.suffix in OPENERS else ""](path, "wb") as f:
        f.write(data)
    return path


def records(path, *args, **kw):
    return [(str(where), record) for where, record in iter_records(path, *args, **kw)]


@pytest.mark.parametrize("name, kind", [
    ("a.txt", "text"), ("a.MD", "text"), ("a.cor", "text"), ("a.txt.gz", "text"), ("a.jsonl", "jsonl"),
    ("a.ndjson.bz2", "jsonl"), ("a.json.xz", "jsonl"), ("a.csv.gz", "csv"), ("a.parquet", "parquet"),
    ("a.parquet.gz", None), ("a.gz", None), ("a.docx", None), ("README", None), ("v1.2.jsonl", "jsonl"),
])
def test_format_from_the_name(name, kind):
    assert file_format(name) == kind


def test_supported_lists_extensions_and_compression():
    assert supported(("text",)) == ".txt, .text, .md, .cor (each may end in .gz/.bz2/.xz)"
    assert supported(("csv", "parquet")) == ".csv, .parquet (all but .parquet may end in .gz/.bz2/.xz)"


@pytest.mark.parametrize("suffix", ["", ".gz", ".bz2", ".xz"])
def test_lines_bom_compression_and_line_endings(tmp_path, suffix):
    f = write(tmp_path / f"a.txt{suffix}", "\ufefffirst\r\n\nc\u00e9\n".encode("utf-8"))
    assert list(iter_lines(f)) == [(1, "first"), (2, ""), (3, "c\u00e9")]


def test_readers_are_generators_that_read_no_further_than_asked(tmp_path):
    f = write(tmp_path / "a.jsonl.gz", b'{"text": "a"}\n{"text": "b"}\nnot json\n\xff\n')
    lines, recs = iter_lines(f), iter_records(f, ("text",))
    assert inspect.isgenerator(lines) and inspect.isgenerator(recs)
    assert [text for _, text in itertools.islice(lines, 2)] == ['{"text": "a"}', '{"text": "b"}']
    assert [r["text"] for _, r in itertools.islice(recs, 2)] == ["a", "b"]  # the bad lines are not read yet
    with pytest.raises(DataError, match=r"a\.jsonl\.gz:3: not valid JSON"):
        next(recs)


@pytest.mark.parametrize("name", ["latin.txt", "latin.jsonl.gz", "latin.csv.xz"])
def test_bad_utf8_names_file_and_line_and_says_how_to_convert(tmp_path, name):
    data = b'{"a": 1}\n{"a": 2}\n{"a": "caf\xe9"}\n' if "jsonl" in name else b"text\nok\ncaf\xe9\n"
    f = write(tmp_path / name, data)
    read = iter_lines if file_format(name) == "text" else iter_records
    with pytest.raises(DataError, match=rf"{name.replace('.', '[.]')}:3: not valid UTF-8 \(byte 0xe9 at byte "
                                        r"offset \d+ of the line\)\. Convert the file to UTF-8.*iconv"):
        list(read(f))


def test_nul_bytes_binary_and_utf16(tmp_path):
    binary = write(tmp_path / "weights.txt", b"fine\n\x00\x01\x02\n")
    with pytest.raises(DataError, match=r"weights\.txt:2: holds a NUL byte.*binary file"):
        list(iter_lines(binary))
    utf16 = tmp_path / "u16.csv"
    utf16.write_text("text\nhello\n", encoding="utf-16")
    with pytest.raises(DataError, match=r"u16\.csv:1: holds a NUL byte.*UTF-16.*iconv -f utf-16"):
        list(iter_records(utf16))


def test_missing_unsupported_and_corrupt_files(tmp_path):
    with pytest.raises(DataError, match="nope.txt: no such file"):
        iter_lines(tmp_path / "nope.txt")  # checked on the call, before the first line
    with pytest.raises(DataError, match="is not a file"):
        iter_records(tmp_path)
    (tmp_path / "a.docx").write_text("x")
    with pytest.raises(DataError, match=r"a\.docx: unsupported format \.docx; use one of \.jsonl.*\.csv.*\.parquet"):
        iter_records(tmp_path / "a.docx")
    truncated = tmp_path / "t.txt.gz"
    truncated.write_bytes(gzip.compress(b"one\ntwo\nthree\n" * 1000)[:-30])
    with pytest.raises(DataError, match=r"t\.txt\.gz: cannot read it after line \d+"):
        list(iter_lines(truncated))


def test_jsonl_records_where_bom_blank_lines_and_format_override(tmp_path):
    f = write(tmp_path / "a.jsonl", '\ufeff{"text": "a", "n": 1}\n\n  \n{"text": null}\n'.encode("utf-8"))
    assert records(f, text_fields=("text",)) == [(f"{f}:1", {"text": "a", "n": 1}), (f"{f}:4", {"text": None})]
    where, _ = next(iter_records(f))
    assert isinstance(where, Where) and isinstance(where, str) and where.line == 1
    named = write(tmp_path / "pairs.txt.gz", b'{"query": "q"}\n')  # JSON lines whatever the name says
    assert records(named, ("query",), format="jsonl") == [(f"{named}:1", {"query": "q"})]


@pytest.mark.parametrize("line, message", [
    ('{"text": "unterminated', r"not valid JSON \(.*\)\. Each line must hold one JSON object like \{.text.: \.\.\.\}"),
    ('["text"]', r"expected a JSON object, got list"),
    ('{"body": "x", "id": 3}', r"no 'text' field \(fields: 'body', 'id'\)\. Every record needs 'text'"),
    ('{"text": 5}', r"'text' holds int, not text"),
    ('{"text": ["a"]}', r"'text' holds list, not text"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    f = write(tmp_path / "a.jsonl", ('{"text": "fine"}\n\n' + line + "\n").encode())
    with pytest.raises(DataError, match=rf"a\.jsonl:3: {message}"):
        list(iter_records(f, text_fields=("text",)))


def test_required_fields_need_not_be_text(tmp_path):
    f = write(tmp_path / "a.jsonl", json.dumps({"text": "a", "label": 3}).encode() + b"\n")
    assert records(f, ("label",), text_fields=("text",)) == [(f"{f}:1", {"text": "a", "label": 3})]
    with pytest.raises(DataError, match=r"a\.jsonl:1: no 'y' field.*needs 'y', 'text'"):
        list(iter_records(f, ("y",), text_fields=("text",)))


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_csv_records_bom_quoted_newlines_and_missing_column(tmp_path, suffix):
    f = write(tmp_path / f"a.csv{suffix}", '\ufeffid,text\n1,plain\n2,"two\nlines, quoted"\n3,\n'.encode("utf-8"))
    assert records(f, ("text",)) == [(f"{f}:2", {"id": "1", "text": "plain"}),
                                     (f"{f}:4", {"id": "2", "text": "two\nlines, quoted"}),
                                     (f"{f}:5", {"id": "3", "text": ""})]
    with pytest.raises(DataError, match=r"a\.csv(\.gz)?: no column 'body' \(columns: id, text\)"):
        list(iter_records(f, ("body",)))
    empty = write(tmp_path / "empty.csv", b"")
    with pytest.raises(DataError, match=r"no column 'text' \(columns: none\)"):
        list(iter_records(empty, ("text",)))


def test_parquet_rows_in_batches_only_the_named_columns(tmp_path, monkeypatch):
    f = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": [f"t{i}" for i in range(5)], "n": list(range(5)), "big": ["x"] * 5}), f,
                   row_group_size=2)

    def whole_file(*a, **k):
        raise AssertionError("parquet must be read in row batches")

    monkeypatch.setattr(pq, "read_table", whole_file)
    monkeypatch.setattr(pq.ParquetFile, "read", whole_file)
    got = records(f, ("n",), text_fields=("text",), batch_rows=2)
    assert got[0] == (f"{f}: row 1", {"text": "t0", "n": 0}) and len(got) == 5  # 1-based rows, no "big"
    assert records(f)[4] == (f"{f}: row 5", {"text": "t4", "n": 4, "big": "x"})  # no names: every column
    assert next(iter_records(f))[0].line == 1
    with pytest.raises(DataError, match=r"a\.parquet: no column 'body' \(columns: text, n, big\)"):
        list(iter_records(f, ("body",)))
    with pytest.raises(DataError, match=r"a\.parquet: column 'n' holds int64, not text"):
        list(iter_records(f, text_fields=("n",)))
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"junk\.parquet: not a readable Parquet file"):
        list(iter_records(junk))


def test_text_field_of():
    assert text_field_of({"text": "a"}, "text", "w") == "a"
    assert text_field_of({"text": None}, "text", "w") is None
    with pytest.raises(DataError, match=r"^src row 2: no 'text' field \(fields: 'body'\)"):
        text_field_of({"body": "a"}, "text", "src row 2")
    with pytest.raises(DataError, match=r"^w: expected an object with a 'text' field, got str"):
        text_field_of("a", "text", "w")
    with pytest.raises(DataError, match=r"^w: 'text' holds float, not text"):
        text_field_of({"text": 1.5}, "text", "w")
