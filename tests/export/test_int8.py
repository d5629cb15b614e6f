"""ONNX int8 (``adapt export --backend onnx --quantize int8``): per-token activations, smoothed channels, and
the int8 floor: a quantized graph too far from the torch encoder is refused and leaves nothing behind."""
import json

import numpy as np
import pytest
import torch

from adapt.errors import ModelLoadError
from adapt.export import graphs
from adapt.export.dense import export_encoder
from adapt.export.graphs import INT8_MIN_COSINE, add_backend, cosines
from adapt.inference.encoder import load_encoder
from adapt.model.bidirectional import make_bidirectional
from adapt.pipeline.reexport import export_from_path
from tests.tiny import CORPUS, tiny_decoder, tiny_tokenizer

pytest.importorskip("onnxruntime", reason="the onnx extra is not installed (make test installs it)")
TEXTS = ["Retrieval", "a", CORPUS[:300], "The quick brown fox jumps over the lazy dog."] + \
        [CORPUS[i:i + 5 + (11 * i) % 70] for i in range(0, 600, 40)]


def _encoder(tmp_path, name="enc", outlier: float = 0.0):
    """A tiny bidirectional llama; ``outlier``: channel 3 of every layer's attention input scaled by it and
    the q/k/v weights' row 3 divided by it - the same function in float, an outlier channel for int8
    (what SmolLM2's hidden states hold: channels at 5-10 where the rest is about 0.3)."""
    tok = tiny_tokenizer()
    model = make_bidirectional(tiny_decoder("llama", vocab_size=len(tok)))
    if outlier:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.input_layernorm.weight[3] *= outlier
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.weight[:, 3] /= outlier
    return export_encoder(model, tok, tmp_path / name, max_seq_length=64)


def _graph_cosines(folder, texts, batch_size=4):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = load_encoder(folder, backend="torch").encode(texts, batch_size=batch_size)
        return cosines(expected, load_encoder(folder).encode(texts, batch_size=batch_size))


def test_int8_is_per_token_smoothed_and_recorded(tmp_path):
    folder = _encoder(tmp_path)
    record = add_backend(folder, "onnx", quantize="int8")
    assert record["parity"]["min_cosine"] >= INT8_MIN_COSINE and record["int8"]["int8_matmuls"] > 0
    assert record["int8"]["float_matmuls"] == 0 and record["int8"]["search_min_cosine"] >= 0.96, record["int8"]
    import onnx

    ops = {node.op_type for node in onnx.load(str(folder / "onnx/model.onnx")).graph.node}
    assert "MatMulIntegerToFloat" in ops and "DynamicQuantizeLinear" not in ops and "QuantizeLinear" in ops
    assert json.loads((folder / "adapt_export.json").read_text())["backend"]["int8"] == record["int8"]
    assert _graph_cosines(folder, TEXTS).min() >= INT8_MIN_COSINE  # texts the export never saw
    # per-token scales: a text's vector no longer depends on the batch it comes in (onnxruntime's dynamic
    # int8 gave a batch one scale: a long text's values changed a short one's vector)
    graph = load_encoder(folder)
    alone = graph.encode(["Retrieval"], batch_size=1)
    batched = graph.encode(["Retrieval", CORPUS[:300], "a b c"], batch_size=3)[:1]
    assert float(cosines(alone, batched)[0]) > 0.99999


def test_outlier_channels_are_smoothed(tmp_path):
    """An outlier channel of 300x: onnxruntime's dynamic int8 loses the other channels, the smoothed per-token
    int8 keeps them."""
    folder = _encoder(tmp_path, outlier=300.0)
    record = add_backend(folder, "onnx", quantize="int8")
    assert record["parity"]["min_cosine"] >= INT8_MIN_COSINE, record
    assert _graph_cosines(folder, TEXTS).min() >= INT8_MIN_COSINE
    from onnxruntime.quantization import QuantType, quantize_dynamic

    plain = tmp_path / "plain.onnx"  # the same graph in float32, quantized as the export did before
    graphs._export_onnx(folder, tmp_path / "fp32" / "model.onnx")
    quantize_dynamic(str(tmp_path / "fp32" / "model.onnx"), str(plain), weight_type=QuantType.QInt8, per_channel=True)
    (folder / "onnx" / "model.onnx").unlink()
    plain.rename(folder / "onnx" / "model.onnx")
    assert _graph_cosines(folder, TEXTS).min() < INT8_MIN_COSINE  # what the floor would now refuse


def test_int8_below_the_floor_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    folder = _encoder(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    names = sorted(p.name for p in folder.iterdir())
    monkeypatch.setattr(graphs, "INT8_MIN_COSINE", 1.5)  # no graph reaches it
    with pytest.raises(ModelLoadError, match=r"onnx int8 export of the 'llama' model is too far from the torch "
                                             r"encoder: min cosine .* below the int8 floor of 1\.5; nothing was "
                                             r"written\. Export it with --quantize int8-weights or no --quantize"):
        add_backend(folder, "onnx", quantize="int8")
    assert sorted(p.name for p in folder.iterdir()) == names  # no graph, no scratch folder
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
    # adapt export -o NEW: the folder is not made at all
    with pytest.raises(ModelLoadError, match=r"int8-weights export .* below the int8 floor of 1\.5"):
        export_from_path(folder, tmp_path / "new", backend="onnx", quantize="int8-weights")
    assert not (tmp_path / "new").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["enc"]


def test_cosines_of_empty_vectors():
    """An empty text under a sink prompt pools nothing: two zero vectors agree, a zero and a non-zero do not."""
    a = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 1.0]], np.float32)
    b = np.array([[0.0, 0.0], [0.0, 0.0], [2.0, 0.0], [2.0, 2.0]], np.float32)
    assert cosines(a, b).tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0])
