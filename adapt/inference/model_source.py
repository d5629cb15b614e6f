"""What :func:`adapt.inference.encoder.load_encoder` loads: the source resolved (a folder, a hub id, a GGUF file, a
``py:`` package), the settings a sentence-transformers folder says (or a raw decoder's), and the transformers model
and tokenizer."""
from __future__ import annotations

from pathlib import Path

from adapt.errors import ConfigError, ModelLoadError
from adapt.export.folder import read_st_settings
from adapt.model.bidirectional import prepare_config
from adapt.model.families import preferred_attention
from adapt.model.loading import looks_like_hub_id, resolve_source
from adapt.model.pooling import sink_prompts
from adapt.model.quantization import check_quantized_weights, dequantized_gguf


def resolve_encoder_source(source) -> tuple[object, str | None, Path]:
    """(source, its GGUF file or None, its path): a ``py:`` package or a GGUF file resolved to a folder and file;
    a source that is neither a folder, a file nor a hub id is refused."""
    gguf_file = None
    local = Path(str(source)).expanduser()
    if not str(source).startswith("py:") and not local.exists() and not looks_like_hub_id(source):
        raise ModelLoadError(f"{source}: no such file or folder (and not a hub id like org/name)")
    if isinstance(source, str) and source.startswith("py:") or str(source).lower().endswith(".gguf") or (
            Path(source).is_dir() and not (Path(source) / "config.json").exists() and any(Path(source).glob("*.gguf"))):
        resolved = resolve_source(str(source))
        source, gguf_file = resolved.path, resolved.gguf_file
    path = Path(source)
    if path.exists() and not path.is_dir():
        raise ModelLoadError(f"{source} is a file, not a model folder or a .gguf file")
    return source, gguf_file, path


def folder_settings(source, path: Path, gguf_file, sink_prompt) -> tuple[dict, str]:
    """(settings, transformers model folder): a sentence-transformers folder's pooling, prompts and limits
    (:func:`adapt.export.folder.read_st_settings`), or a raw decoder's (its sink prompt, if any)."""
    st = read_st_settings(path) if path.is_dir() and not gguf_file else None
    if st and st["unsupported"]:
        raise ModelLoadError(f"{source} uses sentence-transformers parts adapt's encoder does not implement "
                             f"({', '.join(st['unsupported'])}); load it with SentenceTransformer instead")
    model_dir = str(st["transformer_path"]) if st else str(source)
    if path.is_dir() and not gguf_file and not (Path(model_dir) / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} is not an encoder or decoder folder: it has no config.json")
    if st and sink_prompt:
        raise ConfigError(f"{source} is an exported encoder: its prompts and pooling are the ones it was trained "
                          "with; a sink prompt applies to a raw decoder only")
    if not st:
        prompts, default_name, include = sink_prompts({}, sink_prompt or "")
        st = {"prompts": prompts, "default_prompt_name": default_name, "include_prompt": include,
              "do_lower_case": False}
    return st, model_dir


def load_model(source, path: Path, model_dir: str, gguf_file, st: dict, *, bidirectional, torch_dtype,
                trust_remote_code):
    """(model, tokenizer, config) from ``model_dir`` with transformers, quietly; any failure is a
    :class:`ModelLoadError` saying why."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # a decoder's unused LM head is expected, not worth a report
    hf_logging.disable_progress_bar()  # nor are per-tensor loading bars in `adapt embed` output
    try:
        config = AutoConfig.from_pretrained(model_dir, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
        check_quantized_weights(config, source)
        if bidirectional is True:
            prepare_config(config)
        elif bidirectional is False:
            config.is_causal = True
        attn = st.get("attn_implementation") or preferred_attention(config)
        model = AutoModel.from_pretrained(model_dir, config=config, dtype=torch_dtype, attn_implementation=attn,
                                          gguf_file=gguf_file, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
        if gguf_file:
            dequantized_gguf(model, torch_dtype)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - every failure here is "this is not a model we can load"
        where = "" if path.exists() or gguf_file else " (no such local folder, so it was tried as a hub id)"
        raise ModelLoadError(f"cannot load an encoder from {source}{where}: {type(err).__name__}: {err}") from err
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return model, tokenizer, config
