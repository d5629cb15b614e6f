"""The kinds of encoder adapt writes, registered once: ``dense`` (an embedding encoder, sentence-transformers'
``SentenceTransformer``) and ``sparse`` (a SPLADE ``SparseEncoder`` of the LM head).

An entry says everything that differs between them: what its model card says (:func:`adapt.export.dense.render_card`),
which export and embed options apply to it, how a folder of it is told apart (``detect``), re-exported
(``reexport``: ``adapt export``) and embedded (``embed``: what ``adapt embed`` writes). ``adapt export --kind``, the
model card, ``adapt export`` and ``adapt embed`` read it. The operations are named ``"module:function"`` and
imported when used: the writers render their card from this registry, so it cannot import them; every module
named is of the export and inference layer (``tests/export/test_registries.py`` checks it).

A new kind is one more entry here, with its functions::

    detect(folder) -> bool                   whether a folder is of this kind (None: the fallback kind, dense)
    reexport(model_dir, out_dir, *, max_seq_length, prompts, dtype, card, **options)  -> Path
    embed(source, texts, input_path, output_path, *, sharded, procs, **embed options) -> summary

where ``options`` are the entry's ``options`` among pooling, normalize, order_dims, data (dense) and top_k (sparse).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from adapt.errors import ConfigError

DENSE = "dense"
SPARSE = "sparse"


@dataclass(frozen=True)
class Kind:
    name: str
    help: str                      # adapt export --kind's help
    st_class: str                  # the sentence-transformers class that loads the folder
    noun: str                      # the model card's "A bidirectional {noun} converted by adapt"
    pipeline_tag: str
    tags: str
    usage: tuple[str, ...]         # more lines of the card's Python example
    note: str                      # the card's sentence after the example
    setting: Callable[[dict], str]  # the card's kind-specific row of the Encoder table, from the manifest
    options: frozenset[str]        # the export options that apply: pooling normalize order_dims data backend top_k
    embed_refusal: str             # why adapt embed refuses --shards, --normalize or --backend (kinds without them)
    detect: str | None
    reexport: str
    embed: str

    def run(self, operation: str, *args, **kwargs):
        """Call the entry's ``operation`` (detect, reexport, embed)."""
        module, _, name = getattr(self, operation).partition(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)


KINDS = {kind.name: kind for kind in (
    Kind(DENSE, help="an embedding encoder", st_class="SentenceTransformer", noun="text encoder",
         pipeline_tag="sentence-similarity", tags="feature-extraction", usage=(),
         note="The backbone alone loads with `transformers.AutoModel.from_pretrained`.",
         setting=lambda manifest: f"| normalized | {manifest['normalize']} |",
         options=frozenset({"pooling", "normalize", "order_dims", "data", "backend", "shards"}),
         embed_refusal="",
         detect=None, reexport="adapt.export.dense_folder:reexport_dense", embed="adapt.inference.embed:embed_dense"),
    Kind(SPARSE, help="a SPLADE SparseEncoder of the LM head the run trained", st_class="SparseEncoder",
         noun="sparse (SPLADE) text encoder", pipeline_tag="feature-extraction", tags="sparse-encoder, splade",
         usage=("model.decode(vectors[0], top_k=10)  # the heaviest vocabulary terms and their weights",),
         note="Each vector holds one weight per vocabulary term (max over tokens of log1p(relu(LM-head logits)); dot "
              "product similarity).",
         setting=lambda manifest: f"| active terms kept (top_k) | {manifest.get('top_k') or 'all'} |",
         options=frozenset({"top_k"}),
         embed_refusal="its vectors go to one .jsonl or .parquet file (no shards, --normalize or --backend)",
         detect="adapt.export.sparse:is_sparse_folder", reexport="adapt.export.sparse:reexport_sparse",
         embed="adapt.inference.sparse:embed_sparse_folder"),
)}


def names() -> tuple[str, ...]:
    return tuple(KINDS)


def get(name: str) -> Kind:
    if name not in KINDS:
        raise ConfigError(f"unknown export kind {name!r}: {' or '.join(KINDS)}")
    return KINDS[name]


def of_manifest(manifest: dict) -> Kind:
    """The kind an export manifest (``adapt_export.json``) records; dense when it records none."""
    return KINDS.get(manifest.get("kind"), KINDS[DENSE])


def of_folder(folder) -> Kind:
    """The kind of the encoder in ``folder`` (the first whose ``detect`` says so), else dense."""
    return next((kind for kind in KINDS.values() if kind.detect and kind.run("detect", folder)), KINDS[DENSE])


def help_text() -> str:
    """``adapt export --kind``'s help: each kind and what it is."""
    return "; ".join(f"{kind.name}: {kind.help}" for kind in KINDS.values())
