"""adapt: turn a causal decoder LLM into a bidirectional encoder (see README.md and DEVELOPERS.md)."""
import logging

__version__ = "0.1.0"


class _BitsandbytesCpuKernelNotice(logging.Filter):
    """bitsandbytes logs, at import, that its optional CPU kernel (from the `kernels` package, fetched from
    a hub) is missing. peft and sentence-transformers import bitsandbytes whenever they are imported (the
    commands keep it out of runs that do not quantize: adapt.bnb; Python API users still get it), and the
    line reads like an install error; the portable CPU path it falls back to works (tested).
    adapt says so itself when a run asks for quantization on the CPU (adapt.loading)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "gemm_4bit_forward" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_BitsandbytesCpuKernelNotice())
