"""Embedding in numbered shards, over one process or many, resumable after a crash.

    torchrun --nproc_per_node 2 -m adapt embed ENC -i docs.jsonl -o vectors/       # CPU or one process per GPU
    accelerate launch --multi_gpu --num_processes 2 -m adapt embed ENC -i docs.jsonl -o vectors.npy
    adapt embed --merge vectors/ -o vectors.npy                                    # join the shards in input order

The input is cut into global shards of ``shard_size`` consecutive texts: shard ``k`` holds texts
``k*S .. (k+1)*S - 1`` and process ``rank`` embeds the shards with ``k % world == rank``. Every
process streams the whole input (reading is cheap next to encoding) and keeps only its own shards in
memory, one at a time, so inputs larger than memory work and every process knows the total count.

A shard folder holds, per shard, ``shard-KKKKKK.npy`` (float32 ``(rows, dim)``) and then
``shard-KKKKKK.json`` (rows, first text index, tokens, sha256 of the vectors and of the texts, the
run key); both are written under a temporary dot-name and renamed, the ``.json`` last, so a shard
exists for a reader only once it is complete. After every shard is there (a barrier), process 0
writes ``manifest.json`` (model, settings, counts, checksums of every shard) last of all.

A rerun of the same command skips every shard whose ``.json`` exists: a ``kill -9`` loses at most
the shards in flight. The run key (encoder fingerprint, backend, prompt, normalization, length,
shard size) must match, and a skipped shard's texts must hash as they did, or the rerun refuses:
the folder holds vectors of another model, other settings or another input.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterable

import numpy as np

from adapt.errors import ConfigError, DataError
from adapt.files import atomic_write_json, read_json

MANIFEST = "manifest.json"
FORMAT = 1


def shard_name(k: int) -> str:
    return f"shard-{k:06d}"


# ----------------------------------------------------------------------------------- processes

@dataclass
class Processes:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def processes() -> Processes:
    """This process's rank among those ``torchrun`` / ``accelerate launch`` started (env vars), or 0 of 1."""
    env = os.environ
    return Processes(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def start_group(procs: Processes) -> bool:
    """Join the process group (gloo: a barrier and a gather are all it is used for); True when this call made it."""
    import torch.distributed as dist

    if procs.world == 1 or not dist.is_available() or dist.is_initialized():
        return False
    # a long input embeds for hours while a process that finished early waits at the barrier
    dist.init_process_group("gloo", timeout=timedelta(days=7))
    return True


def barrier(procs: Processes) -> None:
    import torch.distributed as dist

    if procs.world > 1 and dist.is_initialized():
        dist.barrier()


def gather(procs: Processes, obj) -> list:
    import torch.distributed as dist

    if procs.world == 1 or not dist.is_initialized():
        return [obj]
    out = [None] * procs.world
    dist.all_gather_object(out, obj)
    return out


def end_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------- the folder

def run_key(encoder, *, backend: str, prompt: str, normalize: bool | None, shard_size: int) -> dict:
    """What decides the vectors in a shard: a rerun must match it to reuse shards."""
    settings = {"fingerprint": encoder.fingerprint, "backend": backend, "prompt": prompt,
                "normalize": encoder.normalize if normalize is None else bool(normalize),
                "max_length": encoder.max_length, "pooling": encoder.pooling, "shard_size": shard_size}
    settings["key"] = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return settings


def texts_digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def file_digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def done_shard(folder: Path, k: int) -> dict | None:
    """The record of finished shard ``k`` (its ``.json``, written after its vectors), or None."""
    record = read_json(folder / f"{shard_name(k)}.json")
    return record if record.get("rows") is not None and (folder / record.get("file", "")).is_file() else None


def _clean_temporaries(folder: Path, procs: Processes) -> None:
    """Remove what a killed run left half-written (dot-names, never read): this rank's shards' temporary files
    and the temporary folders ``atomic_write_json`` writes in; rank 0 also the manifest's."""
    for path in folder.glob(".*.tmp"):
        if path.name.startswith(".shard-"):
            try:
                k = int(path.name.split("-")[1].split(".")[0])
            except (IndexError, ValueError):
                continue
            if k % procs.world != procs.rank:
                continue
        elif not (path.name.startswith(f".{MANIFEST}.") and procs.rank == 0):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def write_shard(folder: Path, k: int, first: int, vectors: np.ndarray, record: dict) -> dict:
    """Shard ``k``'s vectors, then its record, each under a temporary name renamed into place."""
    name = shard_name(k)
    tmp = folder / f".{name}.npy.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(vectors, dtype=np.float32))
        f.flush()
        os.fsync(f.fileno())
    record = {"format": FORMAT, "shard": k, "file": f"{name}.npy", "first": first, "rows": int(len(vectors)),
              "dim": int(vectors.shape[1]), "sha256": file_digest(tmp), **record}
    os.replace(tmp, folder / record["file"])
    atomic_write_json(folder / f"{name}.json", record)
    return record


def pending_rows(folder, n: int, shard_size: int, procs: Processes) -> int:
    """Texts this process has still to embed (its shards without a record), for a progress bar."""
    folder = Path(folder)
    count = -(-n // shard_size)
    return sum(min(shard_size, n - k * shard_size) for k in range(procs.rank, count, procs.world)
               if done_shard(folder, k) is None)


@dataclass
class ShardRun:
    """What one process did: texts and tokens embedded now, shards skipped, seconds."""
    n: int = 0                # texts in the whole input
    embedded: int = 0         # texts this process embedded in this run
    tokens: int = 0
    skipped_shards: int = 0
    written_shards: int = 0
    truncated: int = 0
    empty: int = 0
    seconds: float = 0.0


def embed_shards(encoder, texts: Iterable[str], folder, *, procs: Processes, key: dict, shard_size: int,
                 batch_size: int, prompt: str, normalize: bool | None, progress=None) -> ShardRun:
    """Embed this process's shards of ``texts`` into ``folder`` (see the module docstring).

    ``progress``: called with the number of texts of each batch done (a progress bar's update).
    """
    if shard_size < 1:
        raise ConfigError(f"shard_size must be at least 1, not {shard_size}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _clean_temporaries(folder, procs)
    run, start = ShardRun(), time.perf_counter()
    buffer: list[str] = []
    k = 0

    def finish(k: int, shard_texts: list[str]) -> None:
        if k % procs.world != procs.rank:
            return
        digest = texts_digest(shard_texts)
        record = done_shard(folder, k)
        if record is not None:
            if record.get("key") != key["key"]:
                raise ConfigError(f"{folder} holds shards of another encoder or other settings ({shard_name(k)}: "
                                  f"key {record.get('key')}, this run {key['key']}); embed into a new folder, or "
                                  "remove it first")
            if record.get("texts_sha256") != digest or record["rows"] != len(shard_texts):
                raise DataError(f"{folder}/{shard_name(k)}.json: the input's texts {k * shard_size}.."
                                f"{k * shard_size + len(shard_texts) - 1} changed since this shard was written; "
                                "embed into a new folder, or remove it first")
            run.skipped_shards += 1
            return
        vectors, stats = encoder.encode_with_stats(shard_texts, batch_size=batch_size, prompt=prompt,
                                                   normalize=normalize, on_batch=progress)
        write_shard(folder, k, k * shard_size, vectors,
                    {"key": key["key"], "tokens": stats.tokens, "truncated": stats.truncated, "empty": stats.empty,
                     "texts_sha256": digest})
        run.embedded += stats.n
        run.tokens += stats.tokens
        run.truncated += stats.truncated
        run.empty += stats.empty
        run.written_shards += 1

    for text in texts:
        if k % procs.world == procs.rank:
            buffer.append(text)
        run.n += 1
        if run.n % shard_size == 0:
            finish(k, buffer)
            buffer, k = [], k + 1
    if run.n % shard_size:
        finish(k, buffer)
    run.seconds = time.perf_counter() - start
    return run


def write_manifest(folder, *, n: int, shard_size: int, key: dict, extra: dict) -> dict:
    """Check every shard of an ``n``-text input is there, and write ``manifest.json`` (last)."""
    folder = Path(folder)
    count = -(-n // shard_size)
    records = [done_shard(folder, k) for k in range(count)]
    missing = [shard_name(k) for k, r in enumerate(records) if r is None]
    if missing:
        raise DataError(f"{folder}: {len(missing)} of {count} shards are missing ({', '.join(missing[:5])}"
                        f"{', ...' if len(missing) > 5 else ''}); rerun the same command to embed them")
    dims = {r["dim"] for r in records}
    manifest = {"adapt_embeddings": FORMAT, **extra, "settings": key, "n": n, "dim": dims.pop() if dims else None,
                "dtype": "float32", "shard_size": shard_size,
                "tokens": sum(r.get("tokens", 0) for r in records),
                "truncated": sum(r.get("truncated", 0) for r in records),
                "empty": sum(r.get("empty", 0) for r in records),
                "shards": [{k: r[k] for k in ("file", "first", "rows", "sha256", "texts_sha256")} for r in records]}
    atomic_write_json(folder / MANIFEST, manifest)
    return manifest


def read_manifest(folder) -> dict:
    """The manifest of a finished shard folder; a clear error when the folder is not one, or not finished."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: no such shard folder")
    manifest = read_json(folder / MANIFEST)
    if not manifest.get("adapt_embeddings"):
        done = len(list(folder.glob("shard-*.json")))
        raise DataError(f"{folder} has no {MANIFEST}: the run that writes it has not finished ({done} shards "
                        "done); rerun the same embed command to finish it")
    return manifest


def iter_shards(folder, manifest: dict, *, verify: bool = True):
    """Each shard's vectors in input order (memory-mapped), checked against the manifest's checksums."""
    folder = Path(folder)
    expected = 0
    for shard in manifest["shards"]:
        path = folder / shard["file"]
        if not path.is_file():
            raise DataError(f"{path}: missing (listed in {folder / MANIFEST})")
        if verify and file_digest(path) != shard["sha256"]:
            raise DataError(f"{path}: its checksum differs from the manifest's: the file was changed or damaged")
        if shard["first"] != expected:
            raise DataError(f"{folder / MANIFEST}: {shard['file']} starts at text {shard['first']}, not {expected}")
        vectors = np.load(path, mmap_mode="r")
        expected += len(vectors)
        yield vectors
