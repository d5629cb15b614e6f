"""adapt.data.token_store: sources and their errors, packing into a token store, reuse, deterministic batches."""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os

import numpy as np
import pytest

from adapt.data import token_store as data
from adapt.data.batches import BatchIterator, batch_iterator
from adapt.data.token_store import TokenStore, build_token_store, iter_documents
from adapt.errors import DataError
from tests.tiny import CORPUS

SENTENCES = [s.strip() + "." for s in CORPUS.split(".") if s.strip()][:8]


def texts(source, **kw):
    return [d.text for d in iter_documents(source, **kw)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------ sources

def test_text_file_gives_one_document_per_paragraph_with_its_first_line(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("first line\nsame paragraph\n\n\nsecond\n  \nthird\n", encoding="utf-8")
    docs = list(iter_documents(f))
    assert [(d.text, d.line) for d in docs] == [("first line\nsame paragraph", 1), ("second", 5), ("third", 7)]
    assert all(d.source == str(f) for d in docs)


def test_a_corpus_of_one_document_per_line_gives_one_document_per_line(tmp_path):
    """gensim's .cor corpora and text files of long lines with no blank line hold one document per line;
    a wrapped text (short lines) stays one paragraph."""
    article = "word " * 60
    (tmp_path / "news.cor").write_text("short one\nshort two\n", encoding="utf-8")
    (tmp_path / "articles.txt").write_text(f"{article}a\n{article}b\n\n", encoding="utf-8")
    (tmp_path / "wrapped.txt").write_text("a wrapped text\nof short lines\n", encoding="utf-8")
    assert [(d.text, d.line) for d in iter_documents(tmp_path / "news.cor")] == [("short one", 1), ("short two", 2)]
    assert [d.text[-1] for d in iter_documents(tmp_path / "articles.txt")] == ["a", "b"]
    assert texts(tmp_path / "wrapped.txt") == ["a wrapped text\nof short lines"]
    # a blank line anywhere in the sniffed start means paragraphs, however long the lines
    (tmp_path / "paras.txt").write_text(f"{article}a\n{article}b\n\n{article}c\n", encoding="utf-8")
    assert len(list(iter_documents(tmp_path / "paras.txt"))) == 2


def test_markdown_and_text_extensions_and_bom(tmp_path):
    (tmp_path / "a.md").write_bytes("\ufeff# Title\n".encode("utf-8"))
    (tmp_path / "b.text").write_text("body", encoding="utf-8")
    assert texts([tmp_path / "a.md", tmp_path / "b.text"]) == ["# Title", "body"]


def test_long_paragraph_is_cut_at_a_line_boundary(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MAX_DOC_CHARS", 20)
    f = tmp_path / "a.txt"
    f.write_text("\n".join(f"line {i:02d} abcdef" for i in range(5)) + "\n", encoding="utf-8")
    docs = list(iter_documents(f))
    assert len(docs) > 1 and "\n".join(d.text for d in docs) == f.read_text().strip()
    assert docs[1].line == 3  # each piece still names the line it starts on


def test_jsonl_text_field_skips_null_and_blank(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": "one", "id": 1}, {"text": None}, {"text": "  "},
                                           {"body": "x", "text": "two"}])
    (tmp_path / "a.jsonl").write_text(f.read_text() + "\n", encoding="utf-8")  # a trailing blank line
    assert [(d.text, d.line) for d in iter_documents(f)] == [("one", 1), ("two", 4)]
    assert texts(write_jsonl(tmp_path / "b.ndjson", [{"body": "x"}]), text_field="body") == ["x"]


def test_jsonl_missing_field_names_file_line_and_fields(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": "ok"}, {"text": "ok"}, {"content": "no text field"}])
    with pytest.raises(DataError, match=r"a\.jsonl:3: no 'text' field \(fields: 'content'\)"):
        list(iter_documents(f))


@pytest.mark.parametrize("line, message", [('{"text": 5}', "holds int, not text"),
                                           ('["text"]', "expected a JSON object"),
                                           ('{"text": "unterminated', "not valid JSON")])
def test_jsonl_bad_records_name_the_line(tmp_path, line, message):
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"a\.jsonl:2: .*{message}"):
        list(iter_documents(f))


def test_parquet_is_read_in_row_batches(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [f"row {i}" for i in range(2500)]
    rows[7] = None
    f = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": rows, "n": list(range(2500))}), f, row_group_size=300)

    def no_whole_reads(*a, **k):
        raise AssertionError("parquet must be streamed in row batches")

    monkeypatch.setattr(pq, "read_table", no_whole_reads)
    monkeypatch.setattr(pq.ParquetFile, "read", no_whole_reads)
    docs = list(iter_documents(f))
    assert [d.text for d in docs] == [r for r in rows if r]
    assert docs[7].line == 9  # rows are 1-based and the null row 8 was skipped
    with pytest.raises(DataError, match="no column 'body'.*columns: text, n"):
        list(iter_documents(f, text_field="body"))
    with pytest.raises(DataError, match="column 'n' holds int64, not text"):
        list(iter_documents(f, text_field="n"))


@pytest.mark.parametrize("suffix, opener", [(".gz", gzip.open), (".bz2", bz2.open), (".xz", lzma.open)])
def test_compressed_text_and_jsonl(tmp_path, suffix, opener):
    with opener(tmp_path / f"a.txt{suffix}", "wt", encoding="utf-8") as f:
        f.write("alpha\n\nbeta\n")
    with opener(tmp_path / f"b.jsonl{suffix}", "wt", encoding="utf-8") as f:
        f.write('{"text": "gamma"}\n')
    assert texts(tmp_path) == ["alpha", "beta", "gamma"]


def test_folder_is_recursive_sorted_and_skips_other_and_hidden_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("from b/z", encoding="utf-8")
    (tmp_path / "a.txt").write_text("from a", encoding="utf-8")
    write_jsonl(tmp_path / "b" / "c.jsonl", [{"text": "from b/c"}])
    (tmp_path / "model.safetensors").write_bytes(b"\0\1\2")
    (tmp_path / ".hidden.txt").write_text("hidden", encoding="utf-8")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x.txt").write_text("hidden", encoding="utf-8")
    assert texts(tmp_path) == ["from a", "from b/c", "from b/z"]


def test_folder_without_data_files(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"1")
    with pytest.raises(DataError, match="holds no supported data files"):
        list(iter_documents(tmp_path))


def test_invalid_utf8_names_file_and_line_and_suggests_converting(tmp_path):
    f = tmp_path / "latin.txt"
    f.write_bytes("ok\n\nstill ok\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.txt:4: not valid UTF-8.*0xe9.*Convert the file to UTF-8"):
        list(iter_documents(f))
    g = tmp_path / "latin.jsonl.gz"
    with gzip.open(g, "wb") as out:
        out.write(b'{"text": "a"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin\.jsonl\.gz:2: not valid UTF-8"):
        list(iter_documents(g))


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match="data source not found: .*nope.txt"):
        list(iter_documents([tmp_path / "nope.txt"]))


def test_missing_path_is_reported_before_any_document(tmp_path):
    (tmp_path / "a.txt").write_text("text", encoding="utf-8")
    docs = iter_documents([tmp_path / "a.txt", tmp_path / "nope.txt"])
    with pytest.raises(DataError, match="not found"):
        next(docs)


def test_empty_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n   \n", encoding="utf-8")
    write_jsonl(tmp_path / "b.jsonl", [{"text": ""}])
    with pytest.raises(DataError, match="empty corpus"):
        list(iter_documents(tmp_path))


def test_binary_files_are_refused(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\0\0\0\0\0\0\0{}")
    with pytest.raises(DataError, match="not a supported data file"):
        list(iter_documents(weights))
    fake = tmp_path / "fake.txt"
    fake.write_bytes(b"text\n\x00\x01\x02binary\n")
    with pytest.raises(DataError, match=r"fake\.txt:2: holds a NUL byte.*binary"):
        list(iter_documents(fake))
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        list(iter_documents(not_parquet))
    broken = tmp_path / "broken.txt.gz"
    broken.write_bytes(b"not gzip")
    with pytest.raises(DataError, match="cannot read it"):
        list(iter_documents(broken))


def test_hub_dataset_offline_is_a_data_error():
    # conftest sets HF_DATASETS_OFFLINE=1; with no network the message is the same in spirit
    with pytest.raises(DataError, match="hub dataset 'hf:wikitext:wikitext-2-raw-v1'.*unreachable.*local file"):
        list(iter_documents("hf:wikitext:wikitext-2-raw-v1"))


def test_hub_rows_are_checked_like_local_records(monkeypatch):
    import datasets

    calls = []

    def fake_load(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        return iter([{"text": "a"}, {"content": "b"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    docs = iter_documents("hf:org/name:cfg", hub_split="validation")
    assert next(docs).text == "a"
    with pytest.raises(DataError, match="hf:org/name:cfg row 2: no 'text' field"):
        next(docs)
    assert calls == [("org/name", "cfg", "validation", True)]


# -------------------------------------------------------------------------------------- token store

def corpus_dir(tmp_path, n_docs=40):
    root = tmp_path / "corpus"
    root.mkdir(exist_ok=True)
    docs = [f"{SENTENCES[i % len(SENTENCES)]} Document number {i}." for i in range(n_docs)]
    half = n_docs // 2
    (root / "a.txt").write_text("\n\n".join(docs[:half]) + "\n", encoding="utf-8")
    write_jsonl(root / "b.jsonl", [{"text": d} for d in docs[half:]])
    return root, docs


def expected_stream(tokenizer, docs):
    out = []
    for d in docs:
        out += tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return np.array(out, dtype=np.uint32)


def unsplit(store, every, seed):
    """Put train and eval blocks back in stream order using the documented hold-out rule."""
    n = len(store.train) + len(store.eval)
    held = [(i + seed) % every == every - 1 for i in range(n)] if every else [False] * n
    train, ev = iter(store.train), iter(store.eval)
    return np.concatenate([next(ev) if h else next(train) for h in held])


@pytest.mark.parametrize("seed", [0, 3])
def test_packing_is_exact_across_tokenizer_batches(tmp_path, tokenizer, monkeypatch, seed):
    monkeypatch.setattr(data, "DOC_BATCH", 3)  # many batches: tokens carry over batch boundaries
    root, docs = corpus_dir(tmp_path)
    store = build_token_store(root, tokenizer, tmp_path / "store", seq_len=16, eval_fraction=0.25, seed=seed,
                              show_progress=False)
    stream = expected_stream(tokenizer, docs)
    n = len(stream) // 16
    assert (len(store.train) + len(store.eval), store.seq_len) == (n, 16)
    assert store.num_tokens == n * 16 == store.meta["num_tokens"]
    assert np.array_equal(unsplit(store, 4, seed), stream[: n * 16])
    assert store.train.dtype == np.uint32 and store.train.shape[1] == 16
    assert store.meta["documents"] == len(docs) and store.meta["tokens_seen"] == len(stream)


def test_store_arrays_are_read_only_memmaps(tmp_path, tokenizer):
    root, _ = corpus_dir(tmp_path)
    store = build_token_store(root, tokenizer, tmp_path / "store", seq_len=16, show_progress=False)
    assert isinstance(store.train, np.memmap) and isinstance(store.eval, np.memmap)
    with pytest.raises(ValueError):
        store.train[0, 0] = 1
    again = TokenStore.open(tmp_path / "store")
    assert np.array_equal(again.train, store.train) and again.meta == store.meta
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]  # no temp files left


@pytest.mark.parametrize("fraction", [0.05, 0.1, 0.25, 0.5])
def test_eval_split_size(tmp_path, tokenizer, fraction):
    root, docs = corpus_dir(tmp_path, n_docs=60)
    store = build_token_store(root, tokenizer, tmp_path / "store", seq_len=8, eval_fraction=fraction,
                              show_progress=False)
    n = len(store.train) + len(store.eval)
    every = round(1 / fraction)
    assert len(store.eval) == max(1, n // every)
    assert abs(len(store.eval) / n - fraction) < 1 / n + 1 / every


def test_small_corpora_still_hold_out_a_block_and_train_on_one(tmp_path, tokenizer):
    f = tmp_path / "a.txt"
    stream_len = len(expected_stream(tokenizer, [SENTENCES[0]]))
    f.write_text(SENTENCES[0], encoding="utf-8")
    two = build_token_store(f, tokenizer, tmp_path / "two", seq_len=stream_len // 2, eval_fraction=0.05,
                            show_progress=False)
    assert (len(two.train), len(two.eval)) == (1, 1)
    for seed in range(3):  # whichever block the rule picks, a single block is for training
        one = build_token_store(f, tokenizer, tmp_path / f"one{seed}", seq_len=stream_len, eval_fraction=0.5,
                                seed=seed, show_progress=False)
        assert (len(one.train), len(one.eval)) == (1, 0)
    none = build_token_store(f, tokenizer, tmp_path / "none", seq_len=4, eval_fraction=0, show_progress=False)
    assert len(none.eval) == 0 and len(none.train) == stream_len // 4


def test_max_tokens_caps_whole_blocks(tmp_path, tokenizer):
    root, docs = corpus_dir(tmp_path)
    store = build_token_store(root, tokenizer, tmp_path / "store", seq_len=16, max_tokens=100, eval_fraction=0,
                              show_progress=False)
    assert store.num_tokens == 96
    assert np.array_equal(store.train.reshape(-1), expected_stream(tokenizer, docs)[:96])


def test_too_little_text_says_how_much_was_found(tmp_path, tokenizer):
    f = tmp_path / "a.txt"
    f.write_text("short", encoding="utf-8")
    n = len(expected_stream(tokenizer, ["short"]))
    with pytest.raises(DataError, match=rf"too little text: {n} tokens in 1 documents.*seq_len=512"):
        build_token_store(f, tokenizer, tmp_path / "store", seq_len=512, show_progress=False)
    assert not (tmp_path / "store" / "meta.json").exists()
    assert not [p for p in (tmp_path / "store").iterdir()]  # temp files cleaned up


def test_store_is_reused_when_inputs_are_unchanged_and_rebuilt_otherwise(tmp_path, tokenizer, monkeypatch):
    root, docs = corpus_dir(tmp_path)
    kw = dict(seq_len=16, show_progress=False)
    first = build_token_store(root, tokenizer, tmp_path / "store", **kw)
    train_file = tmp_path / "store" / "train.npy"
    stamp = os.stat(train_file).st_mtime_ns, os.stat(train_file).st_ino

    def no_docs(*a, **k):
        raise AssertionError("a reused store must not read the corpus")

    with monkeypatch.context() as m:
        m.setattr(data, "iter_documents", no_docs)
        again = build_token_store(root, tokenizer, tmp_path / "store", **kw)
    assert (os.stat(train_file).st_mtime_ns, os.stat(train_file).st_ino) == stamp
    assert again.meta == first.meta

    seq = build_token_store(root, tokenizer, tmp_path / "store", seq_len=8, show_progress=False)
    assert seq.seq_len == 8 and seq.meta["fingerprint"] != first.meta["fingerprint"]

    with open(root / "a.txt", "a", encoding="utf-8") as f:
        f.write("\n" + " ".join(SENTENCES) * 3 + "\n")
    grown = build_token_store(root, tokenizer, tmp_path / "store", seq_len=8, show_progress=False)
    assert grown.num_tokens > seq.num_tokens

    other_tok = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<s>",
                                    pad_token="<pad>")
    switched = build_token_store(root, other_tok, tmp_path / "store", seq_len=8, show_progress=False)
    assert switched.meta["fingerprint"] != grown.meta["fingerprint"]
    assert other_tok.eos_token_id in np.asarray(switched.train).ravel()
    assert tokenizer.eos_token_id not in np.asarray(switched.train).ravel()


def test_store_with_missing_array_is_rebuilt(tmp_path, tokenizer):
    root, _ = corpus_dir(tmp_path)
    first = build_token_store(root, tokenizer, tmp_path / "store", seq_len=16, show_progress=False)
    (tmp_path / "store" / "eval.npy").unlink()
    again = build_token_store(root, tokenizer, tmp_path / "store", seq_len=16, show_progress=False)
    assert np.array_equal(again.eval, first.eval) and len(again.eval) >= 1


# ------------------------------------------------------------------------------------------ batches

def blocks(n=10, t=3):
    return np.arange(n * t, dtype=np.uint32).reshape(n, t)  # row i starts with 3 * i


def rows(batch):
    return [int(r[0]) // 3 for r in batch]


def test_batches_are_deterministic_and_cover_each_epoch():
    b = blocks(12)
    a = [rows(x) for _, x in zip(range(9), batch_iterator(b, 4, seed=7))]
    assert a == [rows(x) for _, x in zip(range(9), batch_iterator(b, 4, seed=7))]
    assert a != [rows(x) for _, x in zip(range(9), batch_iterator(b, 4, seed=8))]
    for epoch in range(3):  # every block once per epoch, in a new order each epoch
        assert sorted(sum(a[3 * epoch:3 * epoch + 3], [])) == list(range(12))
    assert sum(a[0:3], []) != sum(a[3:6], [])
    assert sum(a[0:3], []) == np.random.default_rng([7, 0]).permutation(12).tolist()


def test_resume_yields_exactly_what_an_uninterrupted_run_would():
    b = blocks(10)
    full = [x for _, x in zip(range(20), batch_iterator(b, 3, seed=1))]
    for start in (0, 2, 3, 7, 13):
        it = batch_iterator(b, 3, seed=1, start_step=start)
        resumed = [x for _, x in zip(range(20 - start), it)]
        assert all(np.array_equal(x, y) for x, y in zip(resumed, full[start:]))
        assert it.step == 20
    assert BatchIterator(b, 3, seed=1).steps_per_epoch == 3  # drop_last: 10 // 3


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_disjoint_slices_of_the_global_batch(world_size):
    b = blocks(24)
    single = batch_iterator(b, 2 * world_size, seed=5)
    ranks = [batch_iterator(b, 2, seed=5, rank=r, world_size=world_size) for r in range(world_size)]
    for _ in range(10):
        parts = [rows(next(it)) for it in ranks]
        assert all(len(p) == 2 for p in parts)
        flat = sum(parts, [])
        assert len(set(flat)) == len(flat)
        assert flat == rows(next(single))


def test_drop_last_false_keeps_the_short_batch():
    b = blocks(10)
    it = batch_iterator(b, 4, seed=0, drop_last=False)
    epoch = [rows(next(it)) for _ in range(3)]
    assert [len(x) for x in epoch] == [4, 4, 2] and sorted(sum(epoch, [])) == list(range(10))


def test_too_few_blocks_for_a_batch():
    with pytest.raises(DataError, match="only 3 blocks, fewer than one global batch of 4"):
        batch_iterator(blocks(3), 2, seed=0, world_size=2)
    with pytest.raises(ValueError):
        batch_iterator(blocks(3), 1, seed=0, rank=2, world_size=2)
