"""Text sources -> packed token blocks on disk -> deterministic, resumable batches.

Data flows one way through three pieces:

1. :func:`iter_documents` streams :class:`Document` objects from text files (``.txt .text .md .cor``;
   one document per paragraph, or per line in a corpus of one document per line, see
   :func:`lines_are_documents`),
   JSON lines (``.jsonl .jsonlines .ndjson .json``), parquet, any of the text/JSON-lines files
   compressed (``.gz .bz2 .xz``), folders of those (recursively, in sorted order) and hub datasets
   (``hf:NAME[:CONFIG]``, streamed). Files are read by :mod:`adapt.data.readers` (UTF-8, BOMs, compression,
   errors naming ``file:line``); nothing reads a whole file into memory.
2. :func:`build_token_store` tokenizes the documents in batches, joins them with an EOS separator,
   packs the token stream into fixed blocks of ``seq_len`` (no padding; the last partial block is
   dropped) and appends the blocks to ``train.npy`` / ``eval.npy`` (uint32, ``(N, seq_len)``), so
   memory stays O(one batch of documents). A ``meta.json`` fingerprint of the inputs lets a second
   call reuse the store and a changed input rebuild it.

:mod:`adapt.data.batches` then cuts the stored blocks into deterministic, resumable batches.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from adapt.errors import DataError
from adapt.files import atomic_write_json
from adapt.data.readers import file_format, iter_lines, iter_records, supported, text_field_of

log = logging.getLogger(__name__)

DATA_FORMATS = ("text", "jsonl", "parquet")  # the adapt.data.readers formats a corpus may be in
SUPPORTED = supported(DATA_FORMATS)
HUB_PREFIX = "hf:"

MAX_DOC_CHARS = 1_000_000  # a paragraph longer than this is cut at a line boundary (bounded memory)
DOC_BATCH = 512  # documents per tokenizer call
DOC_BATCH_CHARS = 4_000_000  # ... or fewer, when they are long
STORE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Document:
    text: str
    source: str  # the file path, or hf:NAME[:CONFIG]
    line: int  # 1-based: first line of a text paragraph, the JSON line, or the parquet/hub row


# ----------------------------------------------------------------------------------------- sources

def _is_hub(source) -> bool:
    return isinstance(source, str) and source.startswith(HUB_PREFIX) and not Path(source).exists()


def resolve_sources(sources) -> list[Path | str]:
    """Expand folders into their supported files (recursively, sorted) and check every path exists.

    ``sources`` is one path / ``hf:`` spec or a list of them. Hidden files and folders are skipped.
    """
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    out: list[Path | str] = []
    for source in sources:
        if _is_hub(source):
            out.append(source)
            continue
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"data source not found: {source}. Pass a file ({SUPPORTED}), a folder of "
                            f"them, or hf:NAME[:CONFIG] for a hub dataset.")
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file() and file_format(f) in DATA_FORMATS
                           and not any(part.startswith(".") for part in f.relative_to(path).parts))
            if not files:
                raise DataError(f"folder {path} holds no supported data files ({SUPPORTED}).")
            out.extend(files)
        elif file_format(path) not in DATA_FORMATS:
            raise DataError(f"{path}: not a supported data file (its name ends in {''.join(path.suffixes) or 'nothing'}). "
                            f"Supported: {SUPPORTED}.")
        else:
            out.append(path)
    if not out:
        raise DataError("no data sources given.")
    return out


def resolve_data_sources(sources: list[str]) -> list[str]:
    """``gensim:NAME`` names a file of gensim's test data (real text that installs from PyPI)."""
    out = []
    for s in sources:
        if s.startswith("gensim:"):
            try:
                from gensim.test.utils import datapath
            except ImportError:
                raise DataError(f"{s}: pip install gensim==4.4.0 to use gensim's test data") from None
            s = datapath(s.split(":", 1)[1])
        out.append(s)
    return out


SNIFF_CHARS = 1 << 18  # how much of a text file decides whether it holds a document per line
LINE_DOC_MEAN_CHARS = 200  # lines at least this long on average, with no blank line, are documents


def lines_are_documents(path: Path) -> bool:
    """Whether a text file holds one document per line: gensim's ``.cor`` corpora always do; other text
    files when their first 256 KiB has no blank line and its lines average 200+ characters (a corpus
    of one article per line, not a wrapped text)."""
    if path.suffix.lower() == ".cor":
        return True
    count = chars = 0
    blank = False
    for _, line in iter_lines(path):
        if not line.strip():
            blank = True
            continue
        if blank:  # a blank line between texts: paragraphs (trailing blank lines do not count)
            return False
        count, chars = count + 1, chars + len(line)
        if chars >= SNIFF_CHARS:
            break
    return count > 1 and chars / count >= LINE_DOC_MEAN_CHARS


def _iter_text(path: Path) -> Iterator[Document]:
    """One document per paragraph (a run of non-blank lines; blank lines separate documents), or one per
    line where :func:`lines_are_documents` says the file is a corpus of one document per line."""
    if lines_are_documents(path):
        for lineno, line in iter_lines(path):
            if line.strip():
                yield Document(line.strip(), str(path), lineno)
        return
    block: list[str] = []
    start = size = 0
    for lineno, line in iter_lines(path):
        if line.strip():
            if not block:
                start = lineno
            block.append(line)
            size += len(line) + 1
            if size < MAX_DOC_CHARS:
                continue
        if block:
            yield Document("\n".join(block).strip(), str(path), start)
            block, size = [], 0
    if block:
        yield Document("\n".join(block).strip(), str(path), start)


def _iter_records(path: Path, field: str) -> Iterator[Document]:
    """One document per JSON line or parquet row; null or blank texts are skipped."""
    for where, record in iter_records(path, text_fields=(field,)):
        text = record[field]
        if text and text.strip():
            yield Document(text, str(path), where.line)


def _iter_hub(spec: str, field: str, split: str) -> Iterator[Document]:
    name, _, config = spec[len(HUB_PREFIX):].partition(":")

    def rows():
        try:
            import datasets

            yield from datasets.load_dataset(name, config or None, split=split, streaming=True)
        except Exception as e:  # offline, unknown name, bad split...: all user-facing
            raise DataError(f"could not stream hub dataset {spec!r} (split {split!r}): {type(e).__name__}: {e}. "
                            f"The Hugging Face Hub may be unreachable from here, or the name, config or "
                            f"split is wrong. Pass a local file or folder (text, JSON lines, parquet) "
                            f"instead.") from e

    for row, record in enumerate(rows(), 1):
        text = text_field_of(record, field, f"{spec} row {row}")
        if text and text.strip():
            yield Document(text, spec, row)


def iter_documents(sources, *, text_field: str = "text", hub_split: str = "train") -> Iterator[Document]:
    """Stream the documents of ``sources`` (see the module docstring for the formats).

    Text files give one document per paragraph (blank-line separated); JSON lines one per line and
    parquet/hub datasets one per row (field/column ``text_field``; null or blank values are skipped).
    Raises :class:`DataError` for missing paths, unsupported or binary files, invalid UTF-8 (naming
    the file and line), records without text, an unreachable hub, and a corpus with no text at all.
    """
    resolved = resolve_sources(sources)  # every path checked before the first document
    found = 0
    for source in resolved:
        if isinstance(source, str):
            docs = _iter_hub(source, text_field, hub_split)
        else:
            docs = _iter_text(source) if file_format(source) == "text" else _iter_records(source, text_field)
        for doc in docs:
            found += 1
            yield doc
    if not found:
        names = ", ".join(map(str, resolved[:5])) + (" ..." if len(resolved) > 5 else "")
        raise DataError(f"empty corpus: {names} hold no text. Check the files and the text field "
                        f"({text_field!r}).")


# ------------------------------------------------------------------------------------- token store

class _BlockWriter:
    """Appends ``(n, seq_len)`` uint32 blocks to a ``.npy`` file whose header is written last.

    A fixed-size header is reserved up front and filled in on :meth:`close`, so blocks stream to disk
    and the whole array never sits in memory (numpy reads headers padded with spaces).
    """

    HEADER_BYTES = 128

    def __init__(self, path: Path, seq_len: int):
        self.path, self.seq_len, self.rows = path, seq_len, 0
        self.file = open(path, "w+b")
        self.file.write(b"\0" * self.HEADER_BYTES)

    def append(self, blocks: np.ndarray) -> None:  # (n, seq_len)
        self.file.write(np.ascontiguousarray(blocks, dtype="<u4").tobytes())
        self.rows += len(blocks)

    def pop(self) -> np.ndarray:
        """Remove the last block and return it, shape (1, seq_len)."""
        nbytes = self.seq_len * 4
        self.rows -= 1
        self.file.seek(self.HEADER_BYTES + self.rows * nbytes)
        block = np.frombuffer(self.file.read(nbytes), dtype="<u4").reshape(1, self.seq_len)
        self.file.seek(self.HEADER_BYTES + self.rows * nbytes)
        self.file.truncate()
        return block

    def close(self) -> None:
        header = repr({"descr": "<u4", "fortran_order": False, "shape": (self.rows, self.seq_len)}).encode("latin1")
        preamble = np.lib.format.magic(1, 0)
        pad = self.HEADER_BYTES - len(preamble) - 2 - len(header) - 1
        self.file.seek(0)
        self.file.write(preamble + struct.pack("<H", len(header) + pad + 1) + header + b" " * pad + b"\n")
        self.file.close()


@dataclasses.dataclass
class TokenStore:
    """Packed token blocks on disk: ``train`` and ``eval`` are read-only (N, seq_len) uint32 memmaps."""

    path: Path
    train: np.ndarray
    eval: np.ndarray
    meta: dict

    @property
    def seq_len(self) -> int:
        return int(self.train.shape[1])

    @property
    def num_tokens(self) -> int:
        return (len(self.train) + len(self.eval)) * self.seq_len

    @classmethod
    def open(cls, store_dir) -> TokenStore:
        """Open a store built earlier (for example by the main process, from the other processes)."""
        store_dir = Path(store_dir)
        try:
            meta = json.loads((store_dir / "meta.json").read_text(encoding="utf-8"))
            train = np.load(store_dir / "train.npy", mmap_mode="r")
            held = np.load(store_dir / "eval.npy", mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DataError(f"no usable token store in {store_dir} ({e}); build it with build_token_store.") from e
        if (len(train), len(held)) != (meta.get("train_blocks"), meta.get("eval_blocks")):
            raise DataError(f"token store {store_dir} is inconsistent with its meta.json; delete it to rebuild.")
        return cls(store_dir, train, held, meta)


def _tokenizer_fingerprint(tokenizer) -> dict:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # vocab, merges, normalizer, added tokens: all of it
        h.update(backend.to_str().encode("utf-8"))
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode("utf-8"))
    return {"name": str(getattr(tokenizer, "name_or_path", "")), "class": type(tokenizer).__name__,
            "vocab_size": len(tokenizer), "sha256": h.hexdigest()}


def _source_fingerprint(source, hub_split: str) -> dict:
    if isinstance(source, str):  # a hub dataset: only its name can be known without a download
        return {"hub": source, "split": hub_split}
    stat = source.stat()
    return {"path": str(source.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _separator_id(tokenizer) -> int | None:
    for name in ("eos_token_id", "sep_token_id", "bos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    log.warning("the tokenizer has no EOS/SEP/BOS token: documents are packed without a separator")
    return None


def _text_batches(docs: Iterable[Document]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc.text)
        chars += len(doc.text)
        if len(batch) >= DOC_BATCH or chars >= DOC_BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def build_token_store(sources, tokenizer, store_dir, *, seq_len: int, text_field: str = "text",
                      eval_fraction: float = 0.05, max_tokens: int | None = None, seed: int = 0,
                      hub_split: str = "train", show_progress: bool = True) -> TokenStore:
    """Tokenize ``sources`` into ``store_dir`` (or reuse the store there if its inputs are unchanged).

    Documents are tokenized without special tokens and each is followed by the tokenizer's EOS
    (SEP or BOS if it has no EOS). The stream is cut into blocks of ``seq_len``; block ``i`` goes to
    the eval split when ``(i + seed) % k == k - 1`` with ``k = round(1 / eval_fraction)``, and when at
    least two blocks exist, at least one is held out. ``max_tokens`` caps the tokens kept (whole
    blocks). ``eval_fraction=0`` holds nothing out. ``seed`` only shifts which blocks are held out.
    """
    _check_store_args(seq_len, eval_fraction, max_tokens)
    store_dir = Path(store_dir)
    resolved = resolve_sources(sources)
    separator = _separator_id(tokenizer)
    inputs = {"version": STORE_VERSION, "sources": [_source_fingerprint(s, hub_split) for s in resolved],
              "text_field": text_field, "tokenizer": _tokenizer_fingerprint(tokenizer), "separator": separator,
              "seq_len": seq_len, "eval_fraction": eval_fraction, "max_tokens": max_tokens, "seed": seed}
    fingerprint = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode("utf-8")).hexdigest()

    with contextlib.suppress(DataError, OSError, ValueError):
        store = TokenStore.open(store_dir)
        if store.meta.get("fingerprint") == fingerprint:
            log.info("reusing the token store in %s (%d tokens)", store_dir, store.num_tokens)
            return store

    store_dir.mkdir(parents=True, exist_ok=True)
    (store_dir / "meta.json").unlink(missing_ok=True)  # the store is invalid until meta.json is rewritten
    tmp = {name: store_dir / f".{name}.npy.{os.getpid()}.tmp" for name in ("train", "eval")}
    writers = {name: _BlockWriter(path, seq_len) for name, path in tmp.items()}
    try:
        counts = _pack_blocks(iter_documents(resolved, text_field=text_field, hub_split=hub_split), tokenizer,
                              writers, separator=separator, seq_len=seq_len, eval_fraction=eval_fraction,
                              max_tokens=max_tokens, seed=seed, show_progress=show_progress)
        _finish_splits(writers, held_out=eval_fraction > 0)
        for name, path in tmp.items():
            os.replace(path, store_dir / f"{name}.npy")
    finally:
        for name, writer in writers.items():
            if not writer.file.closed:
                writer.file.close()
            tmp[name].unlink(missing_ok=True)

    meta = {"fingerprint": fingerprint, "train_blocks": writers["train"].rows, "eval_blocks": writers["eval"].rows,
            "seq_len": seq_len, "num_tokens": counts["blocks"] * seq_len, "documents": counts["documents"],
            "tokens_seen": counts["tokens_seen"], "inputs": inputs}
    atomic_write_json(store_dir / "meta.json", meta)
    log.info("token store %s: %d train + %d eval blocks of %d tokens from %d documents", store_dir,
             meta["train_blocks"], meta["eval_blocks"], seq_len, counts["documents"])
    return TokenStore.open(store_dir)


def _check_store_args(seq_len, eval_fraction, max_tokens) -> None:
    if not isinstance(seq_len, int) or seq_len < 2:
        raise DataError(f"seq_len must be an integer >= 2, not {seq_len!r}.")
    if not 0 <= eval_fraction <= 0.5:
        raise DataError(f"eval_fraction must be in [0, 0.5], not {eval_fraction!r}.")
    if max_tokens is not None and max_tokens < seq_len:
        raise DataError(f"max_tokens ({max_tokens}) is smaller than one block of seq_len={seq_len}.")


def _pack_blocks(docs, tokenizer, writers: dict, *, separator, seq_len: int, eval_fraction: float,
                 max_tokens: int | None, seed: int, show_progress: bool) -> dict:
    """Tokenize ``docs`` (each followed by ``separator``) into blocks of ``seq_len`` appended to the train and eval
    writers (see :func:`build_token_store`); returns the counts: blocks, documents, tokens_seen."""
    from tqdm.auto import tqdm

    every = max(2, round(1 / eval_fraction)) if eval_fraction > 0 else 0
    max_blocks = max_tokens // seq_len if max_tokens else None
    carry = np.empty(0, dtype=np.uint32)  # tokens after the last full block
    blocks_done = documents = tokens_seen = 0
    sep = np.array([] if separator is None else [separator], dtype=np.uint32)
    progress = tqdm(total=max_blocks * seq_len if max_blocks else None, unit="tok", unit_scale=True,
                    desc="tokenizing", disable=not show_progress)
    try:
        with contextlib.closing(docs):
            for texts in _text_batches(docs):
                ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                                return_token_type_ids=False, verbose=False)["input_ids"]
                documents += len(texts)
                pieces = [carry]
                for seq in ids:
                    pieces += [np.asarray(seq, dtype=np.uint32), sep]
                stream = np.concatenate(pieces)  # (carry + this batch's tokens,)
                tokens_seen += len(stream) - len(carry)
                n = len(stream) // seq_len
                if max_blocks is not None:
                    n = min(n, max_blocks - blocks_done)
                blocks = stream[: n * seq_len].reshape(n, seq_len)  # (n, seq_len)
                carry = stream[n * seq_len:]
                held = ((np.arange(blocks_done, blocks_done + n) + seed) % every == every - 1) if every \
                    else np.zeros(n, dtype=bool)
                writers["train"].append(blocks[~held])
                writers["eval"].append(blocks[held])
                blocks_done += n
                progress.update(n * seq_len)
                if max_blocks is not None and blocks_done >= max_blocks:
                    break
    finally:
        progress.close()
    if blocks_done == 0:
        raise DataError(f"too little text: {tokens_seen} tokens in {documents} documents, fewer than "
                        f"seq_len={seq_len} needed for one block. Add text or lower seq_len.")
    return {"blocks": blocks_done, "documents": documents, "tokens_seen": tokens_seen}


def _finish_splits(writers: dict, *, held_out: bool) -> None:
    """A short corpus still gets a held-out block (when one is asked for), a single block is for training; then
    the writers are closed."""
    if held_out and writers["eval"].rows == 0 and writers["train"].rows >= 2:
        writers["eval"].append(writers["train"].pop())
    if writers["train"].rows == 0:
        writers["train"].append(writers["eval"].pop())  # one block: it is for training
    for writer in writers.values():
        writer.close()
