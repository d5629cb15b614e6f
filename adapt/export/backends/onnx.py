"""The ONNX backend: ``onnx/model.onnx``, run by onnxruntime; ``SentenceTransformer(DIR, backend="onnx")``.

int8: int8 weights and per-token int8 activations (:mod:`adapt.export.int8`); int8-weights: MatMulNBits, 8 bits in
blocks of 32. See :mod:`adapt.export.backends` for what a backend module defines.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

NAME = "onnx"
GRAPH_FILE = "onnx/model.onnx"
INT8_FALLBACK = "int8-weights"
ST_NEEDS = ("optimum-onnx, which does not install with transformers 5 yet (0.1.0 needs transformers < 4.58); "
            "until then `adapt embed` runs this graph.")
ST_KWARGS = ""


def write(fp32: Path, graph: Path, quantize: str | None, calibration) -> dict | None:
    graph.parent.mkdir(parents=True, exist_ok=True)
    if quantize == "int8":
        from adapt.export.int8 import quantize_int8

        return quantize_int8(fp32, graph, *calibration())
    if quantize:
        _quantize_weights(fp32, graph)
    else:
        for item in fp32.parent.iterdir():
            os.replace(item, graph.parent / item.name)
    return None


def _quantize_weights(src: Path, dst: Path) -> None:
    """int8-weights: MatMulNBits, 8 bits in blocks of 32 (activations stay float32)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root = logging.getLogger()
    level, root.level = root.level, max(root.level, logging.ERROR)  # its "pre-process first" hint, its per-node lines
    try:
        quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), bits=8, block_size=32, is_symmetric=True)
        quantizer.process()
        quantizer.model.save_model_to_file(str(dst), use_external_data_format=False)
    finally:
        root.level = level


def open(graph: Path, threads: int):  # noqa: A001 - the name every backend module defines
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    # idle workers would spin for a while after each run, taking cores from whatever runs next
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])

    def run(ids, mask):
        return session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": mask})[0]

    return run
