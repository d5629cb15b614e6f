"""ONNX int8 that keeps a decoder's vectors (``adapt export --backend onnx --quantize int8``).

Why not onnxruntime's ``quantize_dynamic``: it gives each MatMul input one activation scale per batch.
Decoders carry a few huge values (SmolLM2-135M: the attention sink token and padding rows reach 2000-3400
in some ``down_proj`` inputs, and channels such as 247 and 507 stand at 5-10 where the rest is about 0.3),
so one token sets the scale of the whole batch and every other token rounds to a few levels: its vectors
had cosine 0.04-0.34 to fp32 on the check texts (the demo preset's encoder; min 0.41 on 2,919 news texts
for another trained one). Here, for each MatMul by a constant 2-D weight:

- the activation is quantized per token (one scale a row, computed by the graph on each batch), so an
  outlier token no longer costs the others their precision, and a text's vector no longer depends on
  the batch it came in;
- the weight per output column; both symmetric (onnxruntime's ``MatMulIntegerToFloat``: uint8 around 128
  x int8, times the weight's column scales, then the rows' scales);
- outlier channels are smoothed first (SmoothQuant): channel k of the activation is divided by
  ``s_k = sqrt(max|a_k| / max|W_k|)`` and row k of the weights multiplied by it, ``max|a_k|`` measured
  on :data:`CALIBRATION_TEXTS` and the export's check texts run through the fp32 graph; the product is
  unchanged, the quantization error of both is balanced;
- if the result misses :data:`SEARCH_TARGET` on those texts, the graph's first MatMuls
  stay in float32, in growing shares (:data:`KEEP_FLOAT_SHARES`): errors made early pass through every
  later layer (SmolLM2: the first 2 of 30 layers in float32 did more than all 30 ``down_proj``).

The token embeddings stay float32: a Gather has no product to speed up, and int8 rows cost the demo's
encoder 0.008 of its worst check text's cosine (the search then kept 13 MatMuls in float); SmolLM2-135M's
graph is 222 MB (quantize_dynamic's, int8 embeddings included: 137 MB; float32: 539 MB).

The export then checks the graph against the torch encoder with the floor that ``--quantize`` documents
(:mod:`adapt.export.graphs`); ``benchmarks/tools/embed_backends.py`` measures it on held-out news texts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

SMOOTH_ALPHA = 0.5  # s_k = max|a_k|^alpha / max|W_k|^(1 - alpha)
# the min cosine at which the search stops keeping MatMuls in float: the floor (0.95) and a margin; higher is
# not better: on the demo's encoder the min over 19 texts moved between 0.955 and 0.985 from one share to the
# next while 112 held-out texts stayed at 0.99 or more, and 0.98 would have kept half the graph in float32
SEARCH_TARGET = 0.96
KEEP_FLOAT_SHARES = (0, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)  # of the quantizable MatMuls, first in graph order
# with the export's check texts: what the smoothing is measured on and the search judged by
CALIBRATION_TEXTS = [
    "A", "Search", "What is the capital of France?", "The meeting was moved to Thursday at 3 pm.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "def add(a, b):\n    return a + b", "Prices rose 4.2% in March, the fastest pace since 1991.",
    "Le chat dort sur le canapé.", "Der Zug nach Berlin hat zehn Minuten Verspätung.",
    "She opened the letter, read the first line twice, and put it back in the drawer without a word. " * 2,
    "Error: connection refused (port 5432) - is the server running?", "🙂👍 thanks!!",
]


def _quantizable(graph, weights: dict) -> list:
    from onnx import TensorProto

    return [node for node in graph.node if node.op_type == "MatMul" and node.input[1] in weights
            and len(weights[node.input[1]].dims) == 2 and weights[node.input[1]].data_type == TensorProto.FLOAT]


def smoothing(src: Path, feeds: list[dict], alpha: float = SMOOTH_ALPHA) -> dict[str, np.ndarray]:
    """Per quantizable activation (by tensor name), the SmoothQuant factors measured by running ``feeds``
    (``{"input_ids", "attention_mask"}`` arrays, one unpadded text each) through the fp32 graph ``src``."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    model = onnx.load(str(src))
    weights = {init.name: init for init in model.graph.initializer}
    weight_max: dict[str, np.ndarray] = {}
    for node in _quantizable(model.graph, weights):  # q, k and v share an input: the max over all three
        row_max = np.abs(numpy_helper.to_array(weights[node.input[1]])).max(1)
        weight_max[node.input[0]] = np.maximum(weight_max.get(node.input[0], 0), row_max)
    names = sorted(weight_max)
    del model.graph.output[:]
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    path = src.with_name("calibration.onnx")
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    del model, weights
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    act_max = {n: 0.0 for n in names}
    for feed in feeds:
        for name, value in zip(names, session.run(names, feed)):
            act_max[name] = np.maximum(act_max[name], np.abs(value).reshape(-1, value.shape[-1]).max(0))
    del session
    for stale in (path, path.with_name(path.name + ".data")):
        stale.unlink(missing_ok=True)
    factors = {}
    for name in names:
        s = np.maximum(act_max[name], 1e-5) ** alpha / np.maximum(weight_max[name], 1e-5) ** (1 - alpha)
        factors[name] = (s / np.exp(np.log(s).mean())).astype(np.float32)  # geometric mean 1: scales stay near 1
    return factors


def quantize_int8(src: Path, dst: Path, feeds: list[dict], measure: Callable[[Path], float]) -> dict:
    """Write the int8 graph of ``src`` to ``dst`` (see the module docstring); ``measure(graph)`` returns its
    min cosine to the torch encoder. Returns what was done, for the export record."""
    import onnx

    smooth = smoothing(src, feeds)
    model = onnx.load(str(src), load_external_data=False)
    order = [n.name or n.output[0] for n in _quantizable(model.graph, {i.name: i for i in model.graph.initializer})]
    del model
    best, tries = None, []
    for share in KEEP_FLOAT_SHARES:
        keep = frozenset(order[:int(round(share * len(order)))])
        if best is not None and len(keep) == best["float_matmuls"]:
            continue
        quantized = rewrite(src, dst, keep_float=keep, smooth=smooth)
        cosine = measure(dst)
        tried = {"int8_matmuls": quantized, "float_matmuls": len(keep), "search_min_cosine": round(cosine, 6)}
        tries.append([len(keep), round(cosine, 4)])
        if best is None or cosine > best["search_min_cosine"]:
            best = tried
        if cosine >= SEARCH_TARGET or not quantized:
            break
    if tried is not best:  # none reached the target: the closest one, for the export's check to judge
        rewrite(src, dst, keep_float=frozenset(order[:best["float_matmuls"]]), smooth=smooth)
    return {"method": "per-token int8 activations, per-column int8 weights, smoothed channels",
            "calibration_texts": len(feeds), **best, "tried": tries}  # [float MatMuls, min cosine]


def rewrite(src: Path, dst: Path, keep_float=frozenset(), smooth: dict | None = None) -> int:
    """``src`` with each MatMul by a constant 2-D float weight (but those named in ``keep_float``) in int8,
    activations per token, weights per column, channels divided by ``smooth[activation]`` (weights' rows
    multiplied by it); returns how many MatMuls run in int8."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    opset = max([o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] or [18])
    weights = {init.name: init for init in graph.initializer}
    targets = {n.output[0] for n in _quantizable(graph, weights) if (n.name or n.output[0]) not in keep_float}
    smooth = smooth or {}
    consts = {"int8/last_axis": np.array([-1], np.int64), "int8/tiny": np.array(1e-30, np.float32),
              "int8/inv127": np.array(1 / 127, np.float32), "int8/one": np.array(1.0, np.float32),
              "int8/zero_point": np.array(128, np.uint8)}
    nodes, added, rows = [], [], {}
    folded = _fold_smoothing(graph, weights, targets, smooth, added)
    for node in graph.node:
        if node.op_type != "MatMul" or node.output[0] not in targets:
            nodes.append(node)
            continue
        a, out, name = node.input[0], node.output[0], node.name or node.output[0]
        if a not in rows:  # one quantized copy of each activation: q, k and v share theirs
            p = rows[a] = f"{a}/int8"
            source = a
            if a in smooth and a not in folded:
                added.append(numpy_helper.from_array((1 / smooth[a]).astype(np.float32), p + "/inv_smooth"))
                nodes.append(helper.make_node("Mul", [a, p + "/inv_smooth"], [p + "/smoothed"]))
                source = p + "/smoothed"
            reduce = (helper.make_node("ReduceMax", [p + "/abs", "int8/last_axis"], [p + "/max"], keepdims=1)
                      if opset >= 18 else helper.make_node("ReduceMax", [p + "/abs"], [p + "/max"], axes=[-1], keepdims=1))
            nodes += [helper.make_node("Abs", [source], [p + "/abs"]), reduce,
                      helper.make_node("Max", [p + "/max", "int8/tiny"], [p + "/max_"]),
                      helper.make_node("Mul", [p + "/max_", "int8/inv127"], [p + "/scale"]),
                      helper.make_node("Div", [source, p + "/scale"], [p + "/scaled"]),
                      helper.make_node("QuantizeLinear", [p + "/scaled", "int8/one", "int8/zero_point"], [p + "/q"])]
        p, weight = rows[a], numpy_helper.to_array(weights[node.input[1]]).astype(np.float32)
        if a in smooth:
            weight = weight * smooth[a][:, None]
        scale = (np.maximum(np.abs(weight).max(0), 1e-30) / 127).astype(np.float32)
        added += [numpy_helper.from_array(np.clip(np.round(weight / scale), -127, 127).astype(np.int8), name + "/w_int8"),
                  numpy_helper.from_array(scale, name + "/w_scale")]
        # onnxruntime's fused kernel: integer product, times the (scalar) activation and per-column weight scales
        nodes += [helper.make_node("MatMulIntegerToFloat", [p + "/q", name + "/w_int8", "int8/one", name + "/w_scale",
                                                            "int8/zero_point"], [out + "/cols"], name=name + "/int8",
                                   domain="com.microsoft"),
                  helper.make_node("Mul", [out + "/cols", p + "/scale"], [out])]  # the rows' scales
    used = {i for node in nodes for i in node.input} | {o.name for o in graph.output}
    kept = [init for init in graph.initializer if init.name in used]
    if rows:
        added += [numpy_helper.from_array(v, k) for k, v in consts.items()]
        if not any(o.domain == "com.microsoft" for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    del graph.initializer[:], graph.node[:]
    graph.initializer.extend(kept + added)
    graph.node.extend(nodes)
    size = sum(int(np.prod(i.dims)) * (1 if i.data_type == TensorProto.INT8 else 4) for i in graph.initializer)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.with_name(dst.name + ".data").unlink(missing_ok=True)  # an earlier try's weights
    onnx.save(model, str(dst), save_as_external_data=size > 1.8e9, location=dst.name + ".data")  # protobuf: 2 GB
    return sum(node.op_type == "MatMulIntegerToFloat" for node in nodes)


def _fold_smoothing(graph, weights: dict, targets: set, smooth: dict, added: list) -> set:
    """Fold ``1 / smooth[a]`` into the constant of the Mul that makes ``a`` (a norm's weight) where only
    quantized MatMuls read ``a``: the graph then spends no pass on smoothing it. Returns the folded names."""
    from onnx import numpy_helper

    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            role = {"MatMul": node.output[0], "Shape": "shape"}.get(node.op_type)  # a Shape reads no values
            readers.setdefault(name, []).append(role)
    outputs = {o.name for o in graph.output}
    folded = set()
    for node in graph.node:
        a = node.output[0]
        if node.op_type != "Mul" or a not in smooth or a in outputs or not set(readers.get(a, [None])) - {"shape"} <= targets:
            continue
        for i, name in enumerate(node.input):
            init = weights.get(name)
            if init is not None and int(np.prod(init.dims)) == len(smooth[a]) and init.dims[-1] == len(smooth[a]):
                value = numpy_helper.to_array(init).astype(np.float32) / smooth[a]
                added.append(numpy_helper.from_array(value.astype(np.float32), a + "/int8/smoothed_factor"))
                node.input[i] = a + "/int8/smoothed_factor"
                folded.add(a)
                break
    return folded

