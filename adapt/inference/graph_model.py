"""Run an encoder's ONNX or OpenVINO graph behind the interface of a transformers model.

An exported folder may hold, besides its torch weights, the graph that sentence-transformers'
backends load with no custom code, under the names they look for (each backend's ``GRAPH_FILE`` in
:mod:`adapt.export.backends`; written by :mod:`adapt.export.graphs`, recorded in ``adapt_export.json`` under
``backend``). The graph takes ``input_ids`` and ``attention_mask`` and returns ``last_hidden_state``.
:class:`BackendModel` runs it (the backend module's ``open``: onnxruntime or OpenVINO, CPU) so that :mod:`adapt.inference.encoder`
tokenizes, batches and pools exactly as it does for torch, and the probe runs on it unchanged.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from adapt.export.backends import graph_backend, held_graph
from adapt.export.dense import MANIFEST
from adapt.files import read_json


def folder_backend(folder) -> dict | None:
    """The backend an exported folder holds (``{"name", "file", "quantize", ...}``), or None (torch only)."""
    return held_graph(read_json(Path(folder) / MANIFEST), folder)


class BackendModel:
    """An exported graph, called like a transformers base model: ``model(input_ids=, attention_mask=)
    .last_hidden_state`` (a float32 CPU tensor). ``config`` is the folder's transformers config."""

    training = False

    def __init__(self, graph: Path, backend: str, config, *, threads: int | None = None):
        self.graph, self.backend, self.config = Path(graph), backend, config
        self._run = graph_backend(backend).open(Path(graph), threads or torch.get_num_threads())

    def __call__(self, input_ids, attention_mask, position_ids=None, **_):
        hidden = self._run(input_ids.cpu().numpy().astype(np.int64), attention_mask.cpu().numpy().astype(np.int64))
        hidden = torch.from_numpy(np.asarray(hidden, dtype=np.float32))
        return SimpleNamespace(last_hidden_state=hidden, hidden_states=None)

    # what adapt.inference.encoder and adapt.model.bidirectional.probe ask of a model
    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self

    def parameters(self):
        yield torch.zeros((), dtype=torch.float32)

    def to(self, *args, **kwargs):
        return self
