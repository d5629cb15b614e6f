"""Write an exported encoder's ONNX or OpenVINO graph, checked: ``adapt export OUT -o DIR --backend onnx``.

``add_backend(folder, BACKEND, quantize=None|"int8"|"int8-weights")`` adds to an exported encoder folder the
graph of a backend of :mod:`adapt.export.backends` (ONNX, OpenVINO), as :mod:`adapt.inference.graph_model` runs it. The graph takes ``input_ids`` and ``attention_mask`` (what
the tokenizer gives: positions of absolute-position families such as GPT-2 are computed inside it)
and returns ``last_hidden_state``; pooling and normalization stay in the folder's sentence-transformers
modules. It is traced by ``torch.onnx.export`` (the torch.export path, dynamic batch and length) from
the folder's own weights, then each backend module's ``write`` makes its graph of it: ``int8`` is, for ONNX,
int8 weights with int8 activations quantized per token (:mod:`adapt.export.int8`: outlier channels smoothed, the
first MatMuls kept in float32 where needed) or, for OpenVINO, NNCF's int8 weight compression; OpenVINO reads the
ONNX graph.

Why not optimum's exporters: optimum-onnx 0.1.0 needs transformers < 4.58 and optimum-intel 2.2.0
< 5.6, while adapt supports transformers 5.5.1 to 5.x. The files are those optimum loads, though:
``SentenceTransformer(folder, backend="openvino")`` runs this graph with no custom code where
optimum-intel installs (verified with transformers 5.5.4, optimum-intel 2.2.0, sentence-transformers
6.3.0: ``tests/export/test_st_openvino.py``).

Every export checks itself before it is moved into place (``adapt_export.json`` last): the probe
runs on the exported graph (a late token must change the first token's output, with and without
padding), and its vectors are compared with the torch encoder's: fp32 must reach a cosine of
0.9999 on every text; int8 and int8-weights at least ``INT8_MIN_COSINE`` (0.95, the int8 floor), and
the record keeps the smallest and mean cosine. A graph below its floor is refused, and nothing of it is
left in the folder. A family whose graph cannot be traced is refused with its name.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from adapt.model.families import facts_for, preferred_attention
from adapt.export.backends import TORCH, graph_backend, graph_subdirs
from adapt.inference.graph_model import BackendModel
from adapt.model.bidirectional import position_ids_from_mask, probe
from adapt.errors import ConfigError, ModelLoadError, NotBidirectionalError
from adapt.inference.encoder import backend_encoder, load_encoder
from adapt.export.dense import MANIFEST, render_card
from adapt.files import atomic_write_json, atomic_write_text, read_json

# int8: ONNX int8 weights and per-token int8 activations (adapt.export.int8: fastest), OpenVINO int8 weights;
# int8-weights: int8 weights only (ONNX MatMulNBits, blocks of 32), slower
QUANTIZE = (None, "int8", "int8-weights")
# TorchScript tracing is 5-10x faster here and traced every tiny family; torch.export is the fallback
# (under transformers 5.5.4 the TorchScript trace of the SDPA mask fails: IndexError in masking_utils.sdpa_mask)
EXPORTERS = ("torchscript", "dynamo")
FP32_MIN_COSINE = 0.9999
# the int8 floor: a quantized graph (either backend, int8 or int8-weights) whose vectors fall below this cosine
# to the torch encoder's on any of CHECK_TEXTS is refused (--quantize documents it)
INT8_MIN_COSINE = 0.95
CHECK_TEXTS = ["The quick brown fox jumps over the lazy dog.", "An encoder reads the whole sentence at once.",
               "Retrieval", "", "Masked language modeling hides some tokens and asks the model to predict them. " * 3,
               "Stock markets fell sharply on Monday after the central bank raised interest rates again.",
               "é, ü, 東京 and emoji 🙂 are text too."]


class _Graph(torch.nn.Module):
    """What is exported: (input_ids, attention_mask) -> last_hidden_state, positions from the mask if needed."""

    def __init__(self, model, absolute: bool):
        super().__init__()
        self.model, self.absolute = model, absolute

    def forward(self, input_ids, attention_mask):
        kwargs = {"position_ids": position_ids_from_mask(attention_mask)} if self.absolute else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True, **kwargs).last_hidden_state


def _export_onnx(model_dir: Path, path: Path) -> str:
    """Trace the folder's encoder into ``path``; returns the exporter that succeeded."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, config=config, dtype=torch.float32,
                                      attn_implementation=preferred_attention(config)).eval()
    graph = _Graph(model, facts_for(config).absolute_positions).eval()
    ids = torch.randint(3, max(4, min(config.vocab_size, 1000)), (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    names = dict(input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"])
    errors = []
    quiet = logging.getLogger("torch.onnx")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        for exporter in EXPORTERS:
            try:
                with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
                    warnings.simplefilter("ignore")
                    if exporter == "torchscript":
                        axes = {"batch": 0, "sequence": 1}
                        axes = {k: {i: a for a, i in axes.items()} for k in ("input_ids", "attention_mask",
                                                                             "last_hidden_state")}
                        torch.onnx.export(graph, (ids, mask), str(path), dynamo=False, opset_version=18,
                                          dynamic_axes=axes, **names)
                    else:
                        batch, seq = torch.export.Dim("batch"), torch.export.Dim("sequence")
                        big = sum(p.numel() for p in model.parameters()) * 4 > 1.8e9  # protobuf's 2 GB limit
                        torch.onnx.export(graph, (ids, mask), str(path), dynamo=True, external_data=big,
                                          dynamic_shapes={"input_ids": {0: batch, 1: seq},
                                                          "attention_mask": {0: batch, 1: seq}}, **names)
                return exporter
            except Exception as err:  # noqa: BLE001 - the next exporter may trace what this one cannot
                errors.append(f"{exporter}: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}")
                for stale in path.parent.iterdir():
                    stale.unlink()
    finally:
        quiet.level = level
    raise ModelLoadError(f"cannot export the '{config.model_type}' family to ONNX: torch.onnx.export failed "
                         f"({'; '.join(errors)}); use the torch backend for this model")


def check_backend(folder: Path, graph: Path, backend: str, quantize: str | None, torch_encoder) -> dict:
    """Probe the exported graph and compare its vectors with the torch encoder's (see the module docstring)."""
    encoder = backend_encoder(folder, torch_encoder, BackendModel(graph, backend, torch_encoder.model.config))
    report = probe(encoder.model)
    family = report.family
    if not report.bidirectional:
        raise NotBidirectionalError(f"the {backend} export of the '{family}' model is causal: changing the last "
                                    f"token moved the first token's output by {report.unpadded:.2g} (unpadded), "
                                    f"{report.right_padded:.2g} (right padding); refusing to write it")
    cos = _parity(torch_encoder, encoder, CHECK_TEXTS)
    worst = int(cos.argmin())
    parity = {"texts": len(CHECK_TEXTS), "min_cosine": round(float(cos.min()), 6),
              "mean_cosine": round(float(cos.mean()), 6)}
    if quantize is None and parity["min_cosine"] < FP32_MIN_COSINE:
        raise ModelLoadError(f"the {backend} export of the '{family}' model disagrees with the torch encoder: "
                             f"min cosine {parity['min_cosine']} < {FP32_MIN_COSINE}; refusing to write it")
    if quantize and parity["min_cosine"] < INT8_MIN_COSINE:
        fallback = graph_backend(backend).int8_fallback
        other = f"--quantize {fallback} or " if quantize == "int8" and fallback else ""
        raise ModelLoadError(f"the {backend} {quantize} export of the '{family}' model is too far from the torch "
                             f"encoder: min cosine {parity['min_cosine']} (on {CHECK_TEXTS[worst][:40]!r}) is below "
                             f"the int8 floor of {INT8_MIN_COSINE}; nothing was written. Export it with {other}"
                             f"no --quantize (float32, the same vectors)")
    return {"probe": report.to_dict(), "parity": parity}


def cosines(expected: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Row-wise cosines; two zero vectors agree (1: an empty text under a sink prompt pools nothing), one: 0."""
    norms = np.linalg.norm(expected, axis=1) * np.linalg.norm(got, axis=1)
    both_zero = ~expected.any(1) & ~got.any(1)
    cos = (expected * got).sum(1) / np.where(norms > 0, norms, 1)
    return np.where(norms > 0, cos, np.where(both_zero, 1.0, 0.0))


def _parity(torch_encoder, encoder, texts: list[str]) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = torch_encoder.encode(texts, batch_size=3)
        got = encoder.encode(texts, batch_size=3)
    return np.nan_to_num(cosines(expected, got), nan=-1.0)  # a NaN vector fails any floor


def _int8_calibration(folder: Path, backend: str, torch_encoder):
    """(feeds, measure) for :func:`adapt.export.int8.quantize_int8`: its calibration texts and the check texts
    (the floor applies to those) as this encoder tokenizes them, prompt included; ``measure(graph)`` is the
    smallest cosine of ``backend``'s ``graph`` to the torch encoder on them."""
    from adapt.export.int8 import CALIBRATION_TEXTS

    texts = CALIBRATION_TEXTS + CHECK_TEXTS
    ids, _ = torch_encoder.tokenize([t for t in texts if t], prompt=torch_encoder.resolve_prompt())
    feeds = [{"input_ids": np.array([row], np.int64), "attention_mask": np.ones((1, len(row)), np.int64)}
             for row in ids if row]

    def measure(graph: Path) -> float:
        encoder = backend_encoder(folder, torch_encoder, BackendModel(graph, backend, torch_encoder.model.config))
        return float(_parity(torch_encoder, encoder, texts).min())

    return feeds, measure


def add_backend(folder, backend: str, quantize: str | None = None, *, name: str | None = None) -> dict:
    """Add the ``backend`` graph (optionally int8) to the exported encoder ``folder``, checked; returns its record.

    The graph is written and checked in a scratch folder inside ``folder`` and renamed into place; the
    sentence-transformers config loses ``model_kwargs`` (torch-only options; config.json still pins
    the attention for torch loads), the model card (titled ``name``, default the folder's name) says
    how to load the graph, and ``adapt_export.json`` gets the record, last.
    """
    spec = graph_backend(backend)
    if quantize not in QUANTIZE:
        raise ConfigError(f"unknown quantization {quantize!r}; use int8 or int8-weights (or none)")
    folder = Path(folder)
    manifest = read_json(folder / MANIFEST)
    if not manifest.get("adapt_export"):
        raise ModelLoadError(f"{folder} is not an encoder adapt exported (no {MANIFEST})")
    torch_encoder = load_encoder(folder, backend=TORCH, dtype="float32", device="cpu")
    scratch = Path(tempfile.mkdtemp(prefix=".backend.", dir=folder))
    try:
        onnx_fp32 = scratch / "fp32" / "model.onnx"
        exporter = _export_onnx(folder, onnx_fp32)
        graph = scratch / spec.graph_file
        int8 = spec.write(onnx_fp32, graph, quantize, lambda: _int8_calibration(folder, backend, torch_encoder))
        record = {"name": backend, "file": spec.graph_file, "quantize": quantize, "exporter": exporter,
                  **check_backend(folder, graph, backend, quantize, torch_encoder), **({"int8": int8} if int8 else {})}
        for old in graph_subdirs():  # one backend per folder: the one adapt embed runs
            _remove(folder / old)
        os.replace(scratch / spec.subdir, folder / spec.subdir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    st_path = folder / "sentence_bert_config.json"
    st_config = read_json(st_path)
    if st_config.pop("model_kwargs", None) is not None:
        atomic_write_json(st_path, st_config)
    manifest["backend"] = record
    manifest["files"] = sorted(set(manifest.get("files", [])) - graph_subdirs() | {spec.subdir})
    atomic_write_text(folder / "README.md", render_card(name or folder.name, manifest))
    atomic_write_json(folder / MANIFEST, manifest)
    return record


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def describe(record: dict) -> str:
    parity = record.get("parity", {})
    return (f"{record['name']}{' ' + record['quantize'] if record.get('quantize') else ''}: probe bidirectional, cosine vs torch "
            f"min {parity.get('min_cosine')} mean {parity.get('mean_cosine')} on {parity.get('texts')} texts")

