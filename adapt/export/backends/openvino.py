"""The OpenVINO backend: ``openvino/openvino_model.xml`` + ``.bin``, converted from the ONNX graph;
``SentenceTransformer(DIR, backend="openvino")``. int8 and int8-weights: NNCF's int8 weight compression.
See :mod:`adapt.export.backends` for what a backend module defines.
"""
from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

NAME = "openvino"
GRAPH_FILE = "openvino/openvino_model.xml"
INT8_FALLBACK = None
ST_NEEDS = ("`pip install \"optimum-intel[openvino]\"` (2.2.0 needs transformers < 5.6). `ov_config` keeps "
            "the computation in float32: OpenVINO otherwise runs bfloat16 on CPUs with bfloat16 units.")
ST_KWARGS = ', model_kwargs={"ov_config": {"INFERENCE_PRECISION_HINT": "f32"}}'


def write(fp32: Path, graph: Path, quantize: str | None, calibration) -> dict | None:
    import openvino as ov

    model = ov.convert_model(str(fp32))
    if quantize:  # int8 and int8-weights: NNCF compresses the weights
        import nncf

        logging.getLogger("nncf").setLevel(logging.ERROR)
        with contextlib.redirect_stdout(io.StringIO()):  # its progress bar
            model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    graph.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(graph), compress_to_fp16=False)
    return None


def open(graph: Path, threads: int):  # noqa: A001 - the name every backend module defines
    import openvino as ov

    core = ov.Core()
    # f32: on CPUs with bf16 units OpenVINO would otherwise compute in bf16 (cosine 0.88 vs torch seen)
    compiled = core.compile_model(str(graph), "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                      "INFERENCE_PRECISION_HINT": "f32"})
    output = compiled.output("last_hidden_state")

    def run(ids, mask):
        return compiled({"input_ids": ids, "attention_mask": mask})[output]

    return run
