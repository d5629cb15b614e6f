"""Load a causal decoder and its tokenizer from a folder, a hub id, a GGUF file or an installed package.

The config is switched to bidirectional attention BEFORE the model is built (so attention modules
are created for full attention), the family's preferred attention implementation is used, pickle
weights are refused unless allowed, and remote code is off unless asked.
"""
from __future__ import annotations

import importlib.util
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from adapt.model.families import facts_for, preferred_attention
from adapt.model.bidirectional import is_decoder_only, prepare_config
from adapt.model.quantization import check_quantized_weights, dequantized_gguf, quantizes, require_bitsandbytes
from adapt.config.settings import ModelConfig, TuningConfig
from adapt.errors import ConfigError, ModelLoadError
from adapt.model.lm_head import has_saved_lm_head, restore_lm_head
from adapt.config.run_folder import LM_HEAD

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16, "fp32": torch.float32,
                  "float": torch.float32, **DTYPES}


def parse_dtype(dtype) -> torch.dtype | None:
    """``"bf16"``/``"fp16"``/``"fp32"`` (or a torch dtype) -> torch dtype; ``None``/``"auto"`` -> None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower()
    if name == "auto":
        return None
    if name not in _DTYPE_ALIASES:
        raise ConfigError(f"unknown dtype {dtype!r}: choose bf16, fp16, fp32 or auto")
    return _DTYPE_ALIASES[name]


@dataclass
class Source:
    """Where the weights are: a transformers folder or hub id, plus a GGUF file name inside it."""
    path: str
    gguf_file: str | None = None

    @property
    def is_local(self) -> bool:
        return Path(self.path).exists()


HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def looks_like_hub_id(source) -> bool:
    """``org/name`` or ``name`` (what the hub resolves), as opposed to a local path (``./x``, ``a/b/c``, ``/x``)."""
    text = str(source)
    return bool(HUB_ID.fullmatch(text)) and not text.startswith(".")


def resolve_source(source: str, gguf_file: str | None = None) -> Source:
    """Turn the user's MODEL argument into a :class:`Source`; errors say what to pass instead."""
    if not source:
        raise ModelLoadError("no model given: pass a folder, a hub id (org/name), a .gguf file or py:PACKAGE")
    if source.startswith("py:"):
        spec = importlib.util.find_spec(source[3:])
        if spec is None or spec.origin is None:
            raise ModelLoadError(f"{source}: no installed Python package {source[3:]!r}; pip install it first")
        source = str(Path(spec.origin).parent)
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{source} is a file but not a .gguf file: pass the model's folder instead")
        return Source(str(path.parent), path.name)
    if path.is_dir():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if gguf_file is None and not (path / "config.json").exists():
            if len(ggufs) == 1:
                gguf_file = ggufs[0]
            elif len(ggufs) > 1:
                raise ModelLoadError(f"{source} holds several GGUF files {ggufs}: choose one with --set model.gguf_file=NAME")
            else:
                raise ModelLoadError(f"{source} has no config.json and no .gguf file: it is not a transformers model folder")
        return Source(str(path), gguf_file)
    if looks_like_hub_id(source):
        return Source(source, gguf_file)  # a hub id: resolved by transformers, needs a network
    raise ModelLoadError(f"{source}: no such file or folder (and not a hub id like org/name)")


def _hub_kwargs(cfg: ModelConfig) -> dict:
    return {"trust_remote_code": cfg.trust_remote_code, "revision": cfg.revision}


def load_config(cfg: ModelConfig, source: Source | None = None):
    """The model's config, checked to be a causal decoder that transformers can build."""
    from transformers import AutoConfig

    source = source or resolve_source(cfg.source, cfg.gguf_file)
    try:
        config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file, **_hub_kwargs(cfg))
    except OSError as e:
        where = "folder" if source.is_local else "hub id (no network? pass a local folder or .gguf file)"
        raise ModelLoadError(f"cannot load a model config from {source.path!r} as a {where}: {e}") from None
    except ValueError as e:
        raise ModelLoadError(f"{source.path}: {e}") from None
    check_quantized_weights(config, source.path)
    model_type = getattr(config, "model_type", "")
    # Families with a masked-LM head in transformers (BERT, RoBERTa, ...) are encoders that can
    # also be run as decoders; they are already bidirectional and are not what adapt converts.
    if not is_decoder_only(config):
        raise ModelLoadError(
            f"{cfg.source!r} is a {model_type or 'unknown'!r} model, not a causal decoder: adapt converts "
            "decoder-only language models (Llama, Qwen, Mistral, Gemma, GPT-2, ...). An encoder such as BERT "
            "is already bidirectional; use it as it is.")
    return config


def _check_weights(source: Source, cfg: ModelConfig) -> None:
    if not source.is_local or source.gguf_file:
        return
    folder = Path(source.path)
    has_safe = any(folder.glob("*.safetensors"))
    has_pickle = any(folder.glob("*.bin")) or any(folder.glob("*.pt"))
    if not has_safe and has_pickle and not cfg.allow_pickle:
        raise ModelLoadError(
            f"{folder} has only pickle weights (.bin/.pt), which can run code when loaded. Convert them to "
            "safetensors, or pass --set model.allow_pickle=true if you trust the source.")
    if not has_safe and not has_pickle:
        raise ModelLoadError(f"{folder} has a config.json but no weights (*.safetensors)")


def quantization_config(tuning: TuningConfig | None):
    if not quantizes(tuning):
        return None
    require_bitsandbytes("tuning.method=qlora")
    from transformers import BitsAndBytesConfig

    if tuning.quant_bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=tuning.quant_type,
                              bnb_4bit_use_double_quant=tuning.double_quant,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def load_tokenizer(cfg: ModelConfig, source: Source | None = None):
    from transformers import AutoTokenizer

    source = source or resolve_source(cfg.source, cfg.gguf_file)
    try:
        tok = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file, **_hub_kwargs(cfg))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {source.path!r}: {e}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok


def keep_4bit_trainable(model) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for its CPU inference kernel. It repacks on the
    first eval-mode forward without grad (the bidirectionality probe, an evaluation), and that kernel
    has no backward: the gradient through every frozen 4-bit layer would then be silently lost."""
    n = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu, n = False, n + 1
    return n


def _glibc():
    """glibc through ctypes, or None where the C library is another (macOS, musl, Windows)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 - AttributeError where these glibc calls are missing
        return libc
    except (OSError, AttributeError):
        return None


def release_load_memory(model) -> None:
    """After a quantized load on the CPU: own the weights that were not quantized, and give freed heap back.

    transformers memory-maps the safetensors file; the embeddings, norms and head of a 4/8-bit model
    would keep that whole mapping (every page of it was read to quantize) resident for the life of the
    model: 0.65 GB of RSS for a 0.5B model. Copying those few tensors lets the mapping go. glibc also
    keeps the heap pages the quantization freed; ``malloc_trim`` returns them (measured in
    benchmarks/tools/train_throughput.py: RSS after a 0.5B QLoRA load 1.54 GB -> 0.86 GB).
    """
    for param in model.parameters():
        if param.device.type == "cpu" and type(param).__name__ not in ("Params4bit", "Int8Params"):
            param.data = param.data.clone()
    import gc

    gc.collect()
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


LEAN_MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _set_mmap_threshold(nbytes: int) -> bool:
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, nbytes))


def _trains_on_cpu(device_map) -> bool:
    if device_map is not None:
        places = device_map.values() if isinstance(device_map, dict) else [device_map]
        return all(str(p) == "cpu" for p in places)
    xpu = getattr(torch, "xpu", None)
    return not (torch.cuda.is_available() or (xpu is not None and xpu.is_available()))


def lean_cpu_malloc(tuning: TuningConfig | None, device_map=None) -> bool:
    """Fix glibc's mmap threshold at 128 KiB before a CPU load when ``tuning.cpu_malloc`` asks; True if set.

    glibc raises its threshold to the largest block freed so far, so once a few weight-sized blocks
    have been freed, later ones come from the heap and stay there, counted in RSS. bitsandbytes on the
    CPU makes such blocks for every weight it quantizes while loading and dequantizes for every 4-bit
    matmul while training. A fixed threshold returns them to the OS when freed. Measured in
    benchmarks/tools/train_throughput.py (0.5B QLoRA, one step): a lower and steadier training peak and
    no load spikes (without it, the load's anonymous RSS reached 2.6 GB for a 0.9 GB checkpoint), for a
    slower step. Process-wide, and set
    before the load so that the load benefits; a ``MALLOC_MMAP_THRESHOLD_`` already in the environment
    is the user's choice and is left alone.
    """
    import os

    if tuning is None or "MALLOC_MMAP_THRESHOLD_" in os.environ or not _trains_on_cpu(device_map):
        return False
    mode = tuning.cpu_malloc
    if mode == "auto":
        mode = "lean" if tuning.method == "qlora" else "glibc"
    if mode != "lean":
        return False
    ok = _set_mmap_threshold(LEAN_MMAP_THRESHOLD)
    if ok:
        log.info("training on the CPU: glibc's mmap threshold fixed at %d KiB (tuning.cpu_malloc=%s; "
                 "tuning.cpu_malloc=glibc keeps glibc's default)", LEAN_MMAP_THRESHOLD // 1024, tuning.cpu_malloc)
    return ok


def load_decoder(cfg: ModelConfig, tuning: TuningConfig | None = None, *, bidirectional: bool = True,
                 device_map=None, require_head: bool = False):
    """Load ``(model, tokenizer)``; the model is a ``*ForCausalLM`` made bidirectional unless told not to.

    A folder whose weights lack the LM head (an encoder adapt exported keeps only the backbone) gets the
    head its run trained back (:func:`restore_lm_head`); ``require_head``: an error when there is none.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    source = resolve_source(cfg.source, cfg.gguf_file)
    config = load_config(cfg, source)
    _check_weights(source, cfg)
    facts = facts_for(config)
    if bidirectional:
        prepare_config(config, sliding_window=cfg.sliding_window)
    attn = cfg.attn_implementation or facts.attn_implementations[0]
    kwargs = dict(config=config, attn_implementation=attn, gguf_file=source.gguf_file,
                  use_safetensors=None if (cfg.allow_pickle or source.gguf_file) else True, **_hub_kwargs(cfg))
    if cfg.dtype != "auto":
        kwargs["dtype"] = DTYPES[cfg.dtype]
    qconfig = quantization_config(tuning)
    if qconfig is not None:
        if source.gguf_file:
            raise ModelLoadError("QLoRA needs unquantized weights to quantize; a GGUF file is already quantized. "
                                 "Use --tuning lora, or convert the GGUF to a safetensors folder first.")
        kwargs["quantization_config"] = qconfig
        kwargs.setdefault("dtype", torch.bfloat16)
    if device_map is not None:
        kwargs["device_map"] = device_map
    lean_cpu_malloc(tuning, device_map)
    verbosity = hf_logging.get_verbosity()
    if source.is_local and has_saved_lm_head(source.path):
        hf_logging.set_verbosity_error()  # "lm_head newly initialized" is not so: its run's head is put back below
    try:
        model, info = AutoModelForCausalLM.from_pretrained(source.path, output_loading_info=True, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load weights from {source.path!r}: {e}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    head = restore_lm_head(model, source.path, info.get("missing_keys") or ()) if source.is_local else "loaded"
    if head == "missing" and require_head:
        raise ModelLoadError(f"{source.path} holds no trained LM head (an encoder export keeps only the backbone) and "
                             f"no run of it saved one: use the converted run folder itself (OUT, which keeps "
                             f"run/{LM_HEAD} or checkpoints) or one of its checkpoints")
    if qconfig is not None:
        keep_4bit_trainable(model)
        release_load_memory(model)
        if _trains_on_cpu(device_map):
            log.info("quantized on the CPU: bitsandbytes runs its portable CPU path (its faster kernel comes "
                     "from the `kernels` package, which fetches code from a hub)")
    if source.gguf_file:
        dequantized_gguf(model, torch.float32 if cfg.dtype == "auto" else None)
    tokenizer = load_tokenizer(cfg, source)
    return model, tokenizer


CLASSIFIER_HEADS = ("sequence", "token")  # *ForSequenceClassification (one label a text), *ForTokenClassification


def load_sequence_classifier(model_dir, labels: list[str], *, dtype: torch.dtype = torch.float32,
                             head: str = "sequence", bidirectional: bool = True):
    """``(model, tokenizer)``: a ``*ForSequenceClassification`` (``head="token"``: ``*ForTokenClassification``)
    on the backbone in ``model_dir`` (a model folder or hub id), with a new head for ``labels`` (names, in id
    order); bidirectional unless ``bidirectional=False`` (a decoder kept causal: the baseline transformers'
    own class is).

    The family's preferred attention is used, the tokenizer pads on the right with a pad token (EOS or
    UNK when it has none), and ``config.pad_token_id`` is that token, as the class's last-token pooling
    needs. An encoder folder's transformer path is resolved by the caller (:mod:`adapt.export.dense` sits above).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if head not in CLASSIFIER_HEADS:
        raise ConfigError(f"head must be one of {', '.join(CLASSIFIER_HEADS)}, not {head!r}")
    auto = AutoModelForSequenceClassification if head == "sequence" else AutoModelForTokenClassification
    id2label = dict(enumerate(labels))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the new head is expected to be freshly initialised
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        tokenizer.padding_side = "right"
        config = AutoConfig.from_pretrained(str(model_dir), num_labels=len(labels), id2label=id2label,
                                            label2id={v: k for k, v in id2label.items()})
        config.pad_token_id = tokenizer.pad_token_id
        check_quantized_weights(config, model_dir)
        if bidirectional:
            prepare_config(config)
        model = auto.from_pretrained(str(model_dir), config=config, attn_implementation=preferred_attention(config),
                                     dtype=dtype)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001
        raise ModelLoadError(f"cannot load a {head} classifier base from {model_dir}: {type(err).__name__}: {err}") from err
    finally:
        hf_logging.set_verbosity(verbosity)
    return model, tokenizer


# ---- mask token policy -------------------------------------------------------------------------

MASK_POLICIES = ("auto", "tokenizer", "reserved", "add", "underscore", "eos")


@dataclass
class MaskToken:
    token: str
    id: int
    policy: str   # which rule chose it
    added: bool   # a new token was added and the embeddings resized


def _reserved_candidates(tokenizer, config) -> list[str]:
    vocab = tokenizer.get_vocab()
    named = [t for t in facts_for(config).mask_token_candidates if t in vocab]
    used = {tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token, tokenizer.unk_token}
    special = [t for t in getattr(tokenizer, "all_special_tokens", []) if t not in used]
    special += [t for t in getattr(tokenizer, "added_tokens_encoder", {}) if t not in used]
    generic = sorted({t for t in special if re.search(r"reserved|unused", t, re.I)}, key=lambda t: vocab.get(t, 0))
    return named + [t for t in generic if t not in named]


def setup_mask_token(model, tokenizer, policy: str = "auto") -> MaskToken:
    """Choose the mask token by ``policy`` (see ModelConfig.mask_token) and set it on the tokenizer.

    ``auto``: the tokenizer's own mask token, else an unused reserved special token, else add
    ``<mask>`` and resize the embeddings. ``underscore`` and ``eos`` are LLM2Vec's choices. Any other
    string is taken as a literal token that must exist in the vocabulary.
    """
    vocab = tokenizer.get_vocab()
    chosen, rule = None, policy
    if policy in ("auto", "tokenizer") and tokenizer.mask_token is not None:
        chosen, rule = tokenizer.mask_token, "tokenizer"
    elif policy == "tokenizer":
        raise ModelLoadError("the tokenizer has no mask token: use --set model.mask_token=auto (or add, reserved)")
    if chosen is None and policy in ("auto", "reserved"):
        candidates = _reserved_candidates(tokenizer, model.config)
        if candidates:
            chosen, rule = candidates[0], "reserved"
        elif policy == "reserved":
            raise ModelLoadError("the tokenizer has no unused reserved special token: use --set model.mask_token=add")
    if chosen is None and policy == "underscore":
        ids = tokenizer.encode("_", add_special_tokens=False)
        if len(ids) != 1:
            raise ModelLoadError("'_' is not a single token for this tokenizer: choose another mask_token policy")
        chosen = tokenizer.convert_ids_to_tokens(ids[0])
    if chosen is None and policy == "eos":
        if tokenizer.eos_token is None:
            raise ModelLoadError("the tokenizer has no EOS token: choose another mask_token policy")
        chosen = tokenizer.eos_token
    if chosen is None and policy not in MASK_POLICIES:
        if policy not in vocab:
            raise ModelLoadError(f"mask token {policy!r} is not in the vocabulary; use one of {MASK_POLICIES}")
        chosen, rule = policy, "literal"
    added = False
    if chosen is None:  # auto or add: a new token
        chosen, rule = "<mask>", "add"
        if chosen not in vocab:
            tokenizer.add_special_tokens({"mask_token": chosen})
            added = True
    if rule in ("underscore", "eos"):
        # Shared with a real token: do not register it as the tokenizer's mask_token (it would be
        # stripped from decoded text); the objective gets the id directly.
        pass
    else:
        tokenizer.mask_token = chosen
    token_id = tokenizer.convert_tokens_to_ids(chosen)
    if added or token_id >= model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        added = True
    return MaskToken(chosen, int(token_id), rule, added)
