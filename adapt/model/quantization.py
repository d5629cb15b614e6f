"""bitsandbytes only where quantization is asked for.

peft and sentence-transformers import bitsandbytes on every run, quantized or not (and transformers
looks for it): time at start-up, and a notice about a missing CPU kernel. The commands call
:func:`hide_bitsandbytes` once they know nothing they run quantizes (``adapt convert`` once its
configuration is resolved; embed, bench, export, probe, finetune and classify at start); QLoRA
(:func:`adapt.model.loading.quantization_config`) and weights saved quantized by bitsandbytes then fail
with a clear error instead. ``ADAPT_ALLOW_BNB=1`` turns the switch off. Python API users are
unaffected unless they call it.
"""
from __future__ import annotations

import logging
import os
import sys

from adapt.config.settings import TuningConfig
from adapt.errors import ConfigError

log = logging.getLogger(__name__)

BITSANDBYTES = "bitsandbytes"
ALLOW_BNB_ENV = "ADAPT_ALLOW_BNB"


def hide_bitsandbytes() -> bool:
    """Keep bitsandbytes out of this process. With ``sys.modules["bitsandbytes"]`` set to None,
    ``import bitsandbytes`` raises ModuleNotFoundError and ``importlib.util.find_spec`` returns None
    (Python's documented rule), so peft, transformers and sentence-transformers take their paths for a
    machine without it. One-way: they cache "not installed", so a later request for quantization raises
    :class:`ConfigError` (:func:`require_bitsandbytes`). Returns True when it hid it; False when
    ``ADAPT_ALLOW_BNB=1`` is set or bitsandbytes is imported already.
    """
    if os.environ.get(ALLOW_BNB_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    if sys.modules.get(BITSANDBYTES, False) is not False:  # imported (nothing to gain), or hidden already
        return bitsandbytes_hidden()
    sys.modules[BITSANDBYTES] = None
    log.info("bitsandbytes kept out of this process (no quantization asked for; %s=1 allows it)", ALLOW_BNB_ENV)
    return True


def bitsandbytes_hidden() -> bool:
    return BITSANDBYTES in sys.modules and sys.modules[BITSANDBYTES] is None


def require_bitsandbytes(what: str) -> None:
    """A clear error when ``what`` needs bitsandbytes and :func:`hide_bitsandbytes` kept it out of this process."""
    if bitsandbytes_hidden():
        raise ConfigError(f"{what} needs bitsandbytes, which this process kept out because it started without "
                          f"quantization; run it in a fresh process (a new command), or set {ALLOW_BNB_ENV}=1")


def check_quantized_weights(config, source) -> None:
    """Weights saved quantized by bitsandbytes (``quantization_config`` in config.json) need it to load."""
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if str(getattr(method, "value", method)) == BITSANDBYTES:
        require_bitsandbytes(f"{source} (saved quantized with bitsandbytes)")


def quantizes(tuning: TuningConfig | None) -> bool:
    """Does this tuning quantize the model (QLoRA: bitsandbytes)?"""
    return tuning is not None and tuning.method == "qlora"


def dequantized_gguf(model, dtype=None):
    """``model`` loaded from a GGUF file, which transformers dequantizes on load, made a plain model: the quantizer
    marker dropped (so ``save_pretrained`` writes plain safetensors and nothing treats it as quantized), and cast to
    ``dtype`` when given. Returns ``model``."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    if dtype is not None:
        model.to(dtype)
    return model
