"""Run an encoder's ONNX or OpenVINO graph behind the interface of a transformers model.

An exported folder may hold, besides its torch weights, the graph that sentence-transformers'
backends load with no custom code, under the names they look for (written by
:mod:`adapt.export.graphs`, recorded in ``adapt_export.json`` under ``backend``)::

    onnx/model.onnx                       SentenceTransformer(folder, backend="onnx")
    openvino/openvino_model.xml + .bin    SentenceTransformer(folder, backend="openvino")

The graph takes ``input_ids`` and ``attention_mask`` and returns ``last_hidden_state``.
:class:`BackendModel` runs it (onnxruntime or OpenVINO, CPU) so that :mod:`adapt.inference.encoder`
tokenizes, batches and pools exactly as it does for torch, and the probe runs on it unchanged.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from adapt.errors import ConfigError
from adapt.export.dense import MANIFEST
from adapt.files import read_json

BACKENDS = ("torch", "onnx", "openvino")
GRAPH_FILES = {"onnx": "onnx/model.onnx", "openvino": "openvino/openvino_model.xml"}


def folder_backend(folder) -> dict | None:
    """The backend an exported folder holds (``{"name", "file", "quantize", ...}``), or None (torch only)."""
    info = read_json(Path(folder) / MANIFEST).get("backend")
    if isinstance(info, dict) and info.get("name") in GRAPH_FILES and (Path(folder) / info.get("file", "")).is_file():
        return info
    return None


class BackendModel:
    """An exported graph, called like a transformers base model: ``model(input_ids=, attention_mask=)
    .last_hidden_state`` (a float32 CPU tensor). ``config`` is the folder's transformers config."""

    training = False

    def __init__(self, graph: Path, backend: str, config, *, threads: int | None = None):
        self.graph, self.backend, self.config = Path(graph), backend, config
        threads = threads or torch.get_num_threads()
        if backend == "onnx":
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.log_severity_level = 3
            # idle workers would spin for a while after each run, taking cores from whatever runs next
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self.session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
            self._run = self._run_onnx
        elif backend == "openvino":
            import openvino as ov

            core = ov.Core()
            # f32: on CPUs with bf16 units OpenVINO would otherwise compute in bf16 (cosine 0.88 vs torch seen)
            self.compiled = core.compile_model(str(graph), "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                                   "INFERENCE_PRECISION_HINT": "f32"})
            self._run = self._run_openvino
        else:
            raise ConfigError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")

    def _run_onnx(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self.session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": mask})[0]

    def _run_openvino(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        result = self.compiled({"input_ids": ids, "attention_mask": mask})
        return result[self.compiled.output("last_hidden_state")]

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
