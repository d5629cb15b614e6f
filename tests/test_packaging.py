"""The package as users install it: a wheel ships every module and the presets (as adapt/presets/),
installs no top-level `cli` module, and runs `adapt presets` and a tiny conversion from a fresh venv
outside the checkout; an editable install finds the checkout's presets/.

The fresh venvs get torch, transformers, ... from the running interpreter's site-packages through a
path line in a .pth file (nothing is downloaded or reinstalled). A path line does not run the .pth
files of that folder, so the editable install of adapt there (a finder that a .pth activates) stays
off; the tests check that `adapt` comes from the fresh venv.
"""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.tiny import CORPUS

ROOT = Path(__file__).resolve().parent.parent


def _source_copy(dest: Path) -> Path:
    """The files a build reads, copied, so that no build/ or egg-info lands in (or comes from) the checkout."""
    for name in ("pyproject.toml", "README.md", "cli.py"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("adapt", "presets"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _fresh_venv(path: Path) -> tuple[Path, Path]:
    """A venv without pip whose .pth puts this interpreter's site-packages (the dependencies) after its own."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "adapt_test_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python, Path(purelib)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(cmd: list, cwd: Path, timeout: int = 300) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = _source_copy(tmp_path_factory.mktemp("src"))
    dist = tmp_path_factory.mktemp("dist")
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(dist), str(src))
    return next(dist.glob("adapt-*.whl"))


def test_wheel_holds_every_module_and_preset_and_no_top_level_cli(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "adapt").rglob("*.py") if "__pycache__" not in p.parts}
    presets = {"adapt/" + p.relative_to(ROOT).as_posix() for p in (ROOT / "presets").rglob("*.yaml")}
    assert modules - names == set(), "a subpackage of adapt is missing from pyproject's `packages`"
    assert {"adapt/presets/tiny.yaml", "adapt/presets/demo.yaml", "adapt/presets/accelerate/ddp.yaml"} <= presets
    assert presets - names == set()
    assert {n.split("/")[0] for n in names} == {"adapt", wheel.name.rsplit("-", 3)[0] + ".dist-info"}
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "adapt = adapt.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_wheel_install_lists_presets_and_converts_outside_the_checkout(wheel, tiny_model_dir, tmp_path):
    python, purelib = _fresh_venv(tmp_path / "venv")
    _pip("--python", str(python), "install", "--no-deps", "--no-index", str(wheel))
    work = tmp_path / "work"  # outside the checkout: neither adapt/ nor cli.py nor presets/ is on the path
    work.mkdir()
    adapt_cmd = python.parent / "adapt"

    where = _run([python, "-c", "import adapt, importlib.util, sys; print(adapt.__file__); "
                  "print(importlib.util.find_spec('cli')); print([m for m in sys.modules if 'editable' in m])"], work)
    adapt_file, cli_spec, editable = where.splitlines()
    assert Path(adapt_file).is_relative_to(purelib), adapt_file
    assert cli_spec == "None" and editable == "[]", where

    listed = _run([adapt_cmd, "presets"], work)
    assert {"tiny", "demo", "llm2vec-mntp"} <= {line.split()[0] for line in listed.splitlines()}
    ddp = Path(_run([adapt_cmd, "presets", "--path", "accelerate/ddp"], work).strip())
    assert ddp.is_file() and ddp.is_relative_to(purelib / "adapt" / "presets")
    assert "Usage: python -m adapt" in _run([python, "-m", "adapt", "--help"], work)

    corpus = work / "corpus.txt"
    corpus.write_text(CORPUS * 4)
    out = work / "out"
    log = _run([adapt_cmd, "convert", tiny_model_dir, "-o", out, "--preset", "tiny", "--data", corpus, "--quiet"], work)
    assert "probe after reload" in log
    assert (out / "config.json").is_file() and (out / "modules.json").is_file()
    assert (out / "run" / "config.yaml").is_file()


def test_editable_install_finds_the_checkout_presets(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _source_copy(src)
    python, purelib = _fresh_venv(tmp_path / "venv")
    _pip("--python", str(python), "install", "--no-deps", "--no-build-isolation", "--no-index", "-e", str(src))
    work = tmp_path / "work"
    work.mkdir()
    adapt_cmd = python.parent / "adapt"
    assert Path(_run([adapt_cmd, "presets", "--path", "tiny"], work).strip()) == src / "presets" / "tiny.yaml"
    assert "cpu-2proc" in Path(_run([adapt_cmd, "presets", "--path", "accelerate/cpu-2proc"], work).strip()).name
    assert _run([python, "-c", "import adapt; print(adapt.__file__)"], work).strip() == str(src / "adapt" / "__init__.py")
