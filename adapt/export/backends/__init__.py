"""The backends an exported encoder runs on, registered once: torch, and one module per graph backend.

``torch`` (:data:`TORCH`) is the folder's own weights, run by transformers; it needs no module. A graph backend
is one module of this package (``onnx``, ``openvino``) that defines::

    NAME = "onnx"                     # --backend NAME, the record's "name", SentenceTransformer(DIR, backend=NAME)
    GRAPH_FILE = "onnx/model.onnx"    # where the graph lies in the folder (its first part: the subfolder it owns)
    INT8_FALLBACK = "int8-weights"    # the --quantize to suggest when int8 falls below the floor (None: none)
    ST_NEEDS = "..."                  # model card: what sentence-transformers needs to run the graph
    ST_KWARGS = ""                    # model card: more SentenceTransformer(...) arguments it takes

    def write(fp32: Path, graph: Path, quantize: str | None, calibration) -> dict | None:
        '''Write the graph at ``graph`` from the traced float32 ONNX graph ``fp32`` (``quantize`` None, "int8" or
        "int8-weights"); ``calibration()`` gives (feeds, measure) for :func:`adapt.export.int8.quantize_int8`.
        Returns a record to keep (an int8 search's) or None.'''

    def open(graph: Path, threads: int):
        '''A function (input_ids, attention_mask) -> last_hidden_state, int64 and float32 numpy arrays, on the CPU.'''

Adding a backend is adding such a module: ``adapt export --backend``, ``adapt embed --backend``,
:func:`adapt.inference.encoder.load_encoder`, :mod:`adapt.export.graphs` and the model card find it here.
Its imports of runtimes (onnxruntime, openvino) go inside its functions, so listing the backends stays cheap.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from adapt.errors import ConfigError

TORCH = "torch"


@dataclass(frozen=True)
class GraphBackend:
    name: str
    graph_file: str
    int8_fallback: str | None
    st_needs: str
    st_kwargs: str
    write: Callable
    open: Callable

    @property
    def subdir(self) -> str:
        """The folder's subfolder this backend owns (``onnx``, ``openvino``)."""
        return self.graph_file.split("/")[0]


@functools.cache
def graph_backends() -> dict[str, GraphBackend]:
    """Every graph backend of this package, by name, in module order."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found[module.NAME] = GraphBackend(module.NAME, module.GRAPH_FILE, module.INT8_FALLBACK, module.ST_NEEDS,
                                          module.ST_KWARGS, module.write, module.open)
    return found


def names() -> tuple[str, ...]:
    """Every backend: torch first, then the graph backends."""
    return (TORCH, *graph_backends())


def check(backend: str | None) -> str | None:
    """``backend`` when it is None or a known backend, else the :class:`ConfigError` naming them."""
    if backend not in (None, *names()):
        raise ConfigError(f"unknown backend {backend!r}; use one of {', '.join(names())}")
    return backend


def graph_backend(name: str) -> GraphBackend:
    """The graph backend ``name``; torch or an unknown name is a :class:`ConfigError`."""
    if name not in graph_backends():
        raise ConfigError(f"unknown backend {name!r}; use one of {', '.join(graph_backends())} (or {TORCH})")
    return graph_backends()[name]


def graph_subdirs() -> set[str]:
    """The subfolders graph backends own in an exported folder."""
    return {b.subdir for b in graph_backends().values()}


def held_graph(manifest: dict, folder) -> dict | None:
    """The graph record an export manifest names (``manifest["backend"]``) when its file is in ``folder``, else None."""
    info = manifest.get("backend")
    if isinstance(info, dict) and info.get("name") in graph_backends() and (Path(folder) / info.get("file", "")).is_file():
        return info
    return None
