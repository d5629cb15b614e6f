"""The backend and kind registries (adapt.export.backends, adapt.export.kinds): what the CLI and the card read."""
from __future__ import annotations

import importlib

import pytest

from adapt.errors import ConfigError
from adapt.export import backends, kinds


def test_backends_are_torch_then_each_graph_module():
    assert backends.names() == ("torch", "onnx", "openvino")
    assert {b.subdir for b in backends.graph_backends().values()} == backends.graph_subdirs() == {"onnx", "openvino"}
    assert backends.graph_backend("onnx").int8_fallback == "int8-weights"
    with pytest.raises(ConfigError, match="use one of torch, onnx, openvino"):
        backends.check("tensorrt")
    with pytest.raises(ConfigError, match=r"use one of onnx, openvino \(or torch\)"):
        backends.graph_backend("torch")


def test_kinds_name_functions_of_the_artifacts_layer():
    assert kinds.names() == ("dense", "sparse")
    for kind in kinds.KINDS.values():
        for operation in ("detect", "reexport", "embed"):
            ref = getattr(kind, operation)
            if ref is None:
                continue
            module, _, name = ref.partition(":")
            assert module.split(".")[1] in ("export", "inference"), ref  # the registry's own layer
            assert callable(getattr(importlib.import_module(module), name)), ref
    with pytest.raises(ConfigError, match="dense or sparse"):
        kinds.get("bm25")


def test_kind_of_a_manifest_and_a_folder(tmp_path):
    assert kinds.of_manifest({}).name == "dense" and kinds.of_manifest({"kind": "sparse"}).name == "sparse"
    assert kinds.of_folder(tmp_path).name == "dense"
    (tmp_path / "config_sentence_transformers.json").write_text('{"model_type": "SparseEncoder"}')
    assert kinds.of_folder(tmp_path).name == "sparse"
