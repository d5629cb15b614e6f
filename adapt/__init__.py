"""adapt: turn a causal decoder LLM into a bidirectional encoder (see README.md and DEVELOPERS.md).

The few names a user needs, imported on first use (``import adapt`` stays light)::

    from adapt import convert, load_encoder, embed, merge_shards, export_from_path, run_bench, finetune, classify
    from adapt import make_bidirectional, probe
"""
import importlib
import logging

__version__ = "0.1.0"


class _BitsandbytesCpuKernelNotice(logging.Filter):
    """bitsandbytes logs, at import, that its optional CPU kernel (from the `kernels` package, fetched from
    a hub) is missing. peft and sentence-transformers import bitsandbytes whenever they are imported (the
    commands keep it out of runs that do not quantize: adapt.model.quantization; Python API users still get it), and the
    line reads like an install error; the portable CPU path it falls back to works (tested).
    adapt says so itself when a run asks for quantization on the CPU (adapt.model.loading)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit_forward" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_BitsandbytesCpuKernelNotice())


# public name -> (module, name there): the Python API the README documents
API = {
    "convert": ("adapt.pipeline.convert", "convert"),
    "load_encoder": ("adapt.inference.encoder", "load_encoder"),
    "embed": ("adapt.inference.embed", "embed"),
    "merge_shards": ("adapt.inference.embed", "merge_shards"),
    "export_from_path": ("adapt.pipeline.reexport", "export_from_path"),
    "run_bench": ("adapt.bench.runner", "run_bench"),
    "finetune": ("adapt.pipeline.finetune", "finetune"),
    "classify": ("adapt.pipeline.finetune", "classify"),
    "make_bidirectional": ("adapt.model.bidirectional", "make_bidirectional"),
    "probe": ("adapt.model.bidirectional", "probe"),
}
__all__ = ["__version__", *API]


def __getattr__(name: str):
    if name not in API:
        raise AttributeError(f"module 'adapt' has no attribute {name!r}")
    module, attr = API[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # resolved once
    return value
