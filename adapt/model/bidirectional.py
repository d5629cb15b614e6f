"""Make a decoder's attention bidirectional, and prove it.

Uses transformers' supported ``config.is_causal = False`` path (masks become bidirectional, SDPA
gets ``is_causal=False``), which is saved in ``config.json`` and honoured on reload by plain
transformers. This is the only module that knows about transformers' attention internals.

The probe is the proof: changing the LAST token of a sequence must change the hidden state of the
FIRST token, without padding, with right padding and with left padding. A model that stays causal
is an error naming its family, never a silent fallback.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch

from adapt.model.families import facts_for
from adapt.errors import NotBidirectionalError

_SLIDING_LAYER = "sliding_attention"


def _configs(config):
    """The config and any nested text config (multimodal wrappers keep the decoder there)."""
    yield config
    sub = getattr(config, "text_config", None)
    if sub is not None and sub is not config:
        yield sub


def _unwrap(model):
    """The transformers model inside a peft or DDP wrapper."""
    model = getattr(model, "module", model)  # DDP / FSDP
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def sliding_window_of(config) -> int | None:
    """The active sliding window size (None when every layer has full attention)."""
    for cfg in _configs(config):
        window = getattr(cfg, "sliding_window", None)
        if not window:
            continue
        if getattr(cfg, "use_sliding_window", True) is False:
            continue
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None and _SLIDING_LAYER not in layer_types:
            continue
        return int(window)
    return None


def prepare_config(config, *, sliding_window: str = "full") -> None:
    """Set a config (before or after the model is built) to bidirectional attention.

    ``sliding_window="full"`` turns local layers into full attention (the default: an encoder should
    see the whole text); ``"keep"`` keeps the window, which then becomes symmetric around each token.
    """
    if sliding_window not in ("full", "keep"):
        raise ValueError(f"sliding_window must be 'full' or 'keep', not {sliding_window!r}")
    for cfg in _configs(config):
        cfg.is_causal = False
        if sliding_window == "full" and sliding_window_of(cfg) is not None:
            layer_types = getattr(cfg, "layer_types", None)
            if layer_types is not None:
                # Families with per-layer types still build the sliding mask from the window size,
                # so the size stays and the layers become full attention.
                cfg.layer_types = ["full_attention" if t == _SLIDING_LAYER else t for t in layer_types]
            else:
                cfg.sliding_window = None
            if hasattr(cfg, "use_sliding_window"):
                cfg.use_sliding_window = False


def make_bidirectional(model, *, sliding_window: str = "full"):
    """Turn ``model`` (transformers, peft-wrapped or DDP-wrapped) bidirectional in place; returns it."""
    inner = _unwrap(model)
    prepare_config(inner.config, sliding_window=sliding_window)
    if sliding_window == "full":
        # Attention modules built before the change cache their window; clear it so kernels that
        # read it (flash attention) agree with the masks.
        for module in inner.modules():
            if getattr(module, "sliding_window", None) and hasattr(module, "layer_type"):
                module.sliding_window = None
            if getattr(module, "is_sliding", False):
                module.is_sliding = False
    return model


def is_decoder_only(config) -> bool:
    """A decoder-only family (Llama, Qwen, GPT-2, ...), whose attention is causal unless told otherwise;
    encoder families that transformers can also run as decoders (BERT, RoBERTa, ...) are not."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    model_type = getattr(config, "model_type", "")
    return (model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not getattr(config, "is_encoder_decoder", False))


def attends_causally(model_or_config) -> bool:
    """True for a decoder-only model that was never made bidirectional (what ``adapt embed`` refuses)."""
    config = getattr(_unwrap(model_or_config), "config", model_or_config)
    return is_decoder_only(config) and not is_bidirectional(config)


def is_bidirectional(model_or_config) -> bool:
    config = getattr(_unwrap(model_or_config), "config", model_or_config)
    return getattr(config, "is_causal", True) is False


@contextlib.contextmanager
def causal_attention(model, causal: bool = True):
    """Temporarily give ``model`` causal attention (for CLM batches in a mixed run)."""
    configs = list(_configs(_unwrap(model).config))
    saved = [getattr(cfg, "is_causal", True) for cfg in configs]
    try:
        for cfg in configs:
            cfg.is_causal = causal
        yield model
    finally:
        for cfg, value in zip(configs, saved):
            cfg.is_causal = value


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 on the first real token (needed by absolute-position families)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class ProbeReport:
    family: str
    unpadded: float
    right_padded: float
    left_padded: float
    threshold: float

    @property
    def bidirectional(self) -> bool:
        return min(self.unpadded, self.right_padded, self.left_padded) > self.threshold

    def to_dict(self) -> dict:
        return {**asdict(self), "bidirectional": self.bidirectional}


def _first_hidden(model, ids, mask, first, absolute) -> torch.Tensor:
    kwargs = {"input_ids": ids, "attention_mask": mask, "output_hidden_states": True}
    if absolute:
        kwargs["position_ids"] = position_ids_from_mask(mask)
    out = model(**kwargs)
    hidden = out.hidden_states[-1] if getattr(out, "hidden_states", None) else out.last_hidden_state
    return hidden[torch.arange(ids.shape[0]), first].float()  # (B, H)


@torch.no_grad()
def probe(model, *, seq_len: int = 16, pad: int = 4, threshold: float = 1e-4, seed: int = 0) -> ProbeReport:
    """Change the last real token and measure how much the first token's hidden state moves.

    Returns the relative change (max abs difference over the hidden-state scale) for three layouts.
    A causal model gives 0 (up to kernel noise), a bidirectional one clearly more than ``threshold``.
    """
    inner = _unwrap(model)
    config = inner.config
    window = sliding_window_of(config)
    if window:  # the late token must lie outside the window to tell a window from full attention
        seq_len = max(seq_len, window + 4)
    vocab = config.get_text_config().vocab_size
    pad_id = getattr(config, "pad_token_id", None)
    pad_id = 0 if pad_id is None or pad_id >= vocab else int(pad_id)
    device = next(inner.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    low = min(16, vocab // 4)
    ids = torch.randint(low, vocab, (2, seq_len), generator=gen)
    changed_last = (ids[:, -1] + 1 - low) % (vocab - low) + low
    absolute = facts_for(config).absolute_positions
    was_training = inner.training
    inner.eval()

    def measure(ids_a, mask, first, last):
        ids_b = ids_a.clone()
        ids_b[:, last] = changed_last
        ids_a, ids_b, mask_d = ids_a.to(device), ids_b.to(device), mask.to(device)
        a = _first_hidden(model, ids_a, mask_d, first, absolute)
        b = _first_hidden(model, ids_b, mask_d, first, absolute)
        scale = a.abs().mean().clamp(min=1e-6)
        return float(((a - b).abs().max() / scale).cpu())

    try:
        n = seq_len
        ones = torch.ones(2, n, dtype=torch.long)
        unpadded = measure(ids, ones, 0, n - 1)
        padded = torch.full((2, n + pad), pad_id)
        padded[:, :n] = ids
        mask = torch.zeros(2, n + pad, dtype=torch.long)
        mask[:, :n] = 1
        right = measure(padded, mask, 0, n - 1)
        left_ids = torch.full((2, n + pad), pad_id)
        left_ids[:, pad:] = ids
        left_mask = mask.flip(-1)
        left = measure(left_ids, left_mask, pad, n + pad - 1)
    finally:
        inner.train(was_training)
    return ProbeReport(config.model_type, unpadded, right, left, threshold)


def assert_bidirectional(model, *, where: str = "") -> ProbeReport:
    """Run :func:`probe` and raise :class:`NotBidirectionalError` if any layout stayed causal."""
    report = probe(model)
    if not report.bidirectional:
        family = report.family
        raise NotBidirectionalError(
            f"{where + ': ' if where else ''}the '{family}' model is still causal: changing the last token "
            f"moved the first token's hidden state by {report.unpadded:.2g} (unpadded), "
            f"{report.right_padded:.2g} (right padding), {report.left_padded:.2g} (left padding). "
            f"transformers may not honour config.is_causal=False for '{family}' with attention "
            f"'{getattr(_unwrap(model).config, '_attn_implementation', '?')}'; try --set model.attn_implementation=eager, "
            "or add the family's facts to adapt/model/families.py."
        )
    return report
