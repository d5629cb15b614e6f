"""What a sentence-transformers folder says: its modules read into the settings adapt's fast encoder runs
(pooling, linear ``Dense`` layers, normalization, prompts, limits), and the dimension-order rotation an export
carries (``export.order_dims``, :mod:`adapt.export.dim_order`) so that a re-export keeps it; and the fingerprint that
identifies a loaded encoder's vectors (its weights and settings)."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from adapt.errors import ModelLoadError
from adapt.files import read_json
from adapt.model.pooling import POOLINGS, pooling_name

log = logging.getLogger(__name__)


def read_st_settings(folder) -> dict | None:
    """The pooling, normalization, prompts and limits of a sentence-transformers folder (None if it is not one).

    ``unsupported`` lists modules or pooling modes adapt's fast encoder does not implement.
    """
    folder = Path(folder)
    try:
        modules = json.loads((folder / "modules.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    out = {"transformer_path": None, "pooling": "mean", "include_prompt": True, "normalize": False, "prompts": {},
           "matryoshka_dims": [], "projections": [],
           "default_prompt_name": None, "max_seq_length": None, "do_lower_case": False,
           "attn_implementation": None, "unsupported": []}
    for module in modules:
        kind, path = module.get("type", "").rsplit(".", 1)[-1], folder / module.get("path", "")
        if kind == "Transformer" and out["transformer_path"] is None:
            out["transformer_path"] = path
            cfg = read_json(path / "sentence_bert_config.json")
            out["max_seq_length"] = cfg.get("max_seq_length")
            out["do_lower_case"] = bool(cfg.get("do_lower_case", False))
            out["attn_implementation"] = (cfg.get("model_kwargs") or cfg.get("model_args") or {}).get(
                "attn_implementation")
        elif kind == "Pooling":
            cfg = read_json(path / "config.json")
            mode = cfg.get("pooling_mode") or [m for k, m in _LEGACY_MODES.items() if cfg.get(k)] or "mean"
            mode = mode[0] if isinstance(mode, list) and len(mode) == 1 else mode
            if isinstance(mode, (list, tuple)) or mode not in POOLINGS.values():
                out["unsupported"].append(f"pooling mode {mode}")
            else:
                out["pooling"] = pooling_name(mode)
            out["include_prompt"] = cfg.get("include_prompt", True)
        elif kind == "Normalize":
            out["normalize"] = True
        elif kind == "Dense" and not out["normalize"] and _is_linear(read_json(path / "config.json")):
            out["projections"].append(path)
        else:
            out["unsupported"].append(f"module {kind}" + (" (with an activation, or after Normalize)"
                                                          if kind == "Dense" else ""))
    st_cfg = read_json(folder / "config_sentence_transformers.json")
    out["prompts"] = dict(st_cfg.get("prompts") or {})
    out["default_prompt_name"] = st_cfg.get("default_prompt_name")
    out["matryoshka_dims"] = [d for d in st_cfg.get("matryoshka_dims") or [] if isinstance(d, int)]
    if out["transformer_path"] is None:
        out["unsupported"].append("no Transformer module")
    return out


_IDENTITY = ("torch.nn.modules.linear.Identity", "torch.nn.Identity")


def _is_linear(dense_config: dict) -> bool:
    """Whether a ``Dense`` module's config is a plain linear map (no activation) on the sentence embedding."""
    return (dense_config.get("activation_function") in _IDENTITY and not dense_config.get("use_residual")
            and dense_config.get("module_input_name", "sentence_embedding") == "sentence_embedding"
            and dense_config.get("module_output_name", "sentence_embedding") in (None, "sentence_embedding"))


def load_projection(folder):
    """A linear ``Dense`` module folder -> (weight (out, in), bias (out,) or None), float32 tensors."""
    import torch
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        if (folder / "model.safetensors").is_file():
            state = load_file(str(folder / "model.safetensors"))
        else:
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        weight = state["linear.weight"].float()
    except (OSError, KeyError, RuntimeError) as err:
        raise ModelLoadError(f"{folder}: cannot read the Dense layer's weights ({type(err).__name__}: {err})") from err
    bias = state.get("linear.bias")
    return weight, None if bias is None else bias.float()


def previous_rotation(model_dir: Path, previous: dict, pooling: str | None):
    """The dimension-order rotation (``export.order_dims``) an export in ``model_dir`` carries, to carry it
    over; None without one, or when ``pooling`` changes (its axes were fitted to the old pooling's vectors)."""
    if not previous.get("order_dims"):
        return None
    if pooling and pooling_name(pooling) != pooling_name(previous.get("pooling") or "mean"):
        log.warning("%s: its dimension order was fitted to %s pooling; exported with %s pooling, the dimensions "
                    "are left as pooled", model_dir, previous.get("pooling"), pooling)
        return None
    folders = (read_st_settings(model_dir) or {}).get("projections") or []
    if len(folders) != 1:
        raise ModelLoadError(f"{model_dir}: its adapt_export.json records a dimension order, but it has "
                             f"{len(folders)} linear Dense layers, not 1: re-export it from its run or checkpoint")
    return load_projection(folders[0])[0]


_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


# ---- what identifies an encoder's vectors (adapt.inference.encoder; the benchmark's embedding cache keys on it) ----

def resolve_max_length(max_length, st: dict, tokenizer, config) -> int:
    """As asked, else the folder's ``max_seq_length``, else the tokenizer's; never past the model's positions."""
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    max_length = max_length or st.get("max_seq_length") or min(tokenizer.model_max_length, 1_000_000)
    max_length = 512 if max_length == 1_000_000 else int(max_length)
    if positions and max_length > positions:
        log.warning("max_length %s is beyond the model's %s positions: texts are cut there", max_length, positions)
    return min(max_length, positions or max_length)


def projection_key(st: dict) -> dict:
    """What a folder's Dense layers add to its :func:`fingerprint`: (folder, file, size, mtime) of their weights; nothing
    for a folder without any, so an encoder's fingerprint (and its cached embeddings) is what it was before."""
    folders = st.get("projections") or []
    if not folders:
        return {}
    return {"projections": [(str(Path(f).resolve()), p.name, p.stat().st_size, p.stat().st_mtime_ns)
                            for f in folders for p in sorted(Path(f).glob("*")) if p.suffix in (".safetensors", ".bin")]}


def fingerprint(source, model_dir: Path, **settings) -> str:
    """A stable id of what decides the vectors: the source, its weight files (name, size, mtime) and settings."""
    source = str(Path(source).resolve()) if isinstance(source, Path) else source
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.glob("*")
                     if p.suffix in (".safetensors", ".bin", ".gguf", ".onnx", ".onnx_data", ".data", ".xml")) \
        if model_dir.is_dir() else []
    blob = json.dumps({"source": source, "weights": weights, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def folder_kind(folder) -> str | None:
    """What a local model folder holds, from its files alone (nothing is loaded): "sparse encoder" (a
    SparseEncoder), "embedding encoder" (a sentence-transformers folder), "classifier" (a transformers
    ``*ForSequenceClassification``), "token classifier", "decoder" (a ``*ForCausalLM``, converted or not),
    "model" (another transformers model: a config with a ``model_type``), or None (no model there)."""
    folder = Path(folder)
    st_type = read_json(folder / "config_sentence_transformers.json").get("model_type")
    modules = read_json(folder / "modules.json") if (folder / "modules.json").is_file() else []
    if st_type == "SparseEncoder" or any(str(m.get("type", "")).endswith(("SpladePooling", "SparseAutoEncoder"))
                                         for m in modules if isinstance(m, dict)):
        return "sparse encoder"
    if modules:
        return "embedding encoder"
    config = read_json(folder / "config.json")
    architectures = " ".join(config.get("architectures") or [])
    for suffix, kind in (("ForSequenceClassification", "classifier"), ("ForTokenClassification", "token classifier"),
                         ("ForCausalLM", "decoder")):
        if suffix in architectures:
            return kind
    return "model" if config.get("model_type") else None
