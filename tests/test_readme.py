"""Every command and Python example README.md shows runs as written, on a tiny decoder.

The README's ```bash blocks hold commands only, written with its placeholders (MODEL, OUT, DIR, CLS,
SPARSE and the files corpus.txt, corpus/, pairs.jsonl, docs.jsonl, train.jsonl, texts.txt); ```python blocks
are self-contained examples with the same placeholders as string literals (tags.jsonl: words and their tags). Here MODEL is a tiny random
Llama, OUT a tiny conversion of it, DIR/SPARSE/CLS what the README's own commands make of OUT, and the
files are small real-looking inputs. Every command runs in a fresh folder of its own, so an output
placeholder (after -o) is a new path there. Scaled down, not changed: training commands get a few steps of
short texts appended (--max-steps, --set), benchmark commands --limit; a command the README shows is
otherwise run word for word. ```text blocks (GPU launches, hub ids) are not run.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from adapt.cli import main
from tests.objectives.test_contrastive import toy_sentences
from tests.tiny import CORPUS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SKIPPED_PROGRAMS = ("make", "pip", "python3 -m venv")  # the set-up lines: they are what CI itself runs
FILES = ("corpus.txt", "corpus/", "pairs.jsonl", "docs.jsonl", "train.jsonl", "tags.jsonl", "texts.txt")
FOLDERS = ("MODEL", "OUT", "DIR", "CLS", "SPARSE")
OUTPUT_FLAGS = ("-o", "--out", "--output")
# a few steps of short texts for every training command (appended: the README's own settings still apply)
SMALL_TRAINING = ["--max-steps", "2", "--set", "train.batch_size=4", "--set", "data.seq_len=32",
                  "--set", "contrastive.max_length=16", "--set", "train.eval_every=0", "--set", "export.order_texts=16"]


def blocks(kind: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text(encoding="utf-8")) if lang == kind]


def commands() -> list[str]:
    out = []
    for body in blocks("bash"):
        for line in body.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#") and not line.startswith(SKIPPED_PROGRAMS):
                out.append(line)
    return out


def test_the_readme_has_commands_and_examples_to_run():
    """The parser sees what the README shows (a README rewritten without fences would test nothing)."""
    lines = commands()
    assert len(lines) >= 10 and any(line.startswith("adapt convert") for line in lines)
    assert blocks("python")
    for line in lines:
        assert "..." not in line and not re.search(r"\[[^\]=]*\]", line), f"not runnable as written: {line}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The placeholders' inputs: a tiny decoder, text files, and OUT (a tiny conversion of MODEL)."""
    from tests.tiny import tiny_decoder, tiny_tokenizer

    root = tmp_path_factory.mktemp("readme")
    tokenizer = tiny_tokenizer()
    model_dir = root / "MODEL"
    tiny_decoder("llama", vocab_size=len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    docs = [CORPUS] * 4 + [" ".join(toy_sentences(40)[i:i + 4]) for i in range(0, 40, 4)] + toy_sentences(60)
    (root / "corpus.txt").write_text("\n\n".join(docs), encoding="utf-8")
    (root / "corpus").mkdir()
    (root / "corpus" / "a.txt").write_text("\n\n".join(docs), encoding="utf-8")
    sentences = toy_sentences(40)
    (root / "pairs.jsonl").write_text("".join(
        json.dumps({"query": f"what is item {i}", "positive": s, "negatives": [sentences[(i + 7) % 40]]}) + "\n"
        for i, s in enumerate(sentences)), encoding="utf-8")
    (root / "docs.jsonl").write_text("".join(json.dumps({"id": i, "text": s}) + "\n"
                                             for i, s in enumerate(sentences[:12])), encoding="utf-8")
    (root / "texts.txt").write_text("\n".join(sentences[:6]) + "\n", encoding="utf-8")
    animals, words = ["fox", "dog", "quick", "brown", "lazy"], ["model", "text", "token", "encoder", "query"]
    (root / "train.jsonl").write_text("".join(
        json.dumps({"text": " ".join((animals if i % 2 else words)[(i + k) % 5] for k in range(4)),
                    "label": "animal" if i % 2 else "nlp"}) + "\n" for i in range(40)), encoding="utf-8")
    (root / "tags.jsonl").write_text("".join(json.dumps(
        {"tokens": [(animals if (i + k) % 3 else words)[(i * k) % 5] for k in range(5)],
         "tags": ["ANIMAL" if (i + k) % 3 else "O" for k in range(5)]}) + "\n" for i in range(40)), encoding="utf-8")
    paths = {"MODEL": model_dir, **{name: root / name for name in FILES}}
    ok = _invoke(["convert", str(model_dir), "-o", str(root / "OUT"), "--preset", "tiny", "--data",
                  str(root / "corpus.txt"), "--quiet"])
    assert ok.exit_code == 0, ok.output
    paths["OUT"] = root / "OUT"
    for name, args in (("DIR", ["export", str(root / "OUT"), "-o", str(root / "DIR")]),
                       ("SPARSE", ["export", str(root / "OUT"), "-o", str(root / "SPARSE"), "--kind", "sparse"]),
                       ("CLS", ["finetune", str(root / "OUT"), "--data", str(root / "train.jsonl"), "-o",
                                str(root / "CLS"), "--epochs", "1", "--quiet"])):
        made = _invoke(args)
        if made.exit_code == 0:
            paths[name] = root / name
    return paths


def _invoke(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _substitute(words: list[str], world: dict, scratch: Path) -> list[str]:
    """Placeholders -> paths: after an output flag a new path in ``scratch``, elsewhere the world's input."""
    out, after_output = [], False
    for word in words:
        key = word.rstrip("/")
        name = key if key in FOLDERS else word if word in FILES else key + "/" if key + "/" in FILES else None
        if word.startswith("py:") or name is None and not any(p in word for p in FOLDERS + FILES):
            out.append(word)
        elif after_output:
            out.append(str(scratch / word))
        else:
            for placeholder in sorted(FOLDERS + FILES, key=len, reverse=True):  # e.g. OUT/run/checkpoints
                if word == placeholder or word.startswith(placeholder.rstrip("/") + "/"):
                    if placeholder.rstrip("/") not in world and placeholder not in world:
                        pytest.fail(f"{placeholder} was not made: an earlier README command that makes it failed")
                    base = world.get(placeholder, world.get(placeholder.rstrip("/")))
                    word = str(base) + word[len(placeholder.rstrip("/")):]
                    break
            out.append(word)
        after_output = word in OUTPUT_FLAGS
    return out


def _missing_extra(text: str) -> str | None:
    """Why ``text`` (a command or an example) cannot run in this environment, if an optional extra it needs is
    missing: the README says what each needs (``make test`` installs them all; ``make test-oldest`` has
    sentence-transformers 5.4 and no onnx/openvino extras, so there these are skipped, not passed)."""
    from importlib.util import find_spec

    from adapt.export.sparse import sparse_supported

    if re.search(r"SPARSE|--kind sparse|--top-k|splade", text) and not sparse_supported():
        return "sparse encoders need sentence-transformers >= 6.2 (the README says so)"
    for backend, module in (("onnx", "onnxruntime"), ("openvino", "openvino")):
        if re.search(rf"""backend[ =]+["']?{backend}""", text) and find_spec(module) is None:
            return f"the {backend} extra is not installed (pip install -e '.[{backend}]')"
    return None


def _scaled(words: list[str]) -> list[str]:
    if "convert" in words:
        words = words + SMALL_TRAINING
    if "bench" in words:
        words = words + ["--limit", "8"]
    if "finetune" in words:
        words = words + ["--epochs", "1"]
    return words


@pytest.mark.parametrize("line", commands())
def test_readme_command_runs(line, world, tmp_path, monkeypatch):
    if reason := _missing_extra(line):
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    words = _scaled(_substitute(shlex.split(line), world, tmp_path))
    if words[0] == "adapt" and "$(" not in line:
        result = _invoke(words[1:])
        assert result.exit_code == 0, f"{line}\n-> {' '.join(words)}\n{result.output[-3000:]}"
        return
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(["bash", "-c", shlex.join(words).replace("'$(", "$(").replace(")'", ")")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, f"{line}\n-> {' '.join(words)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


MAKERS = {"OUT": "convert(", "DIR": "export_from_path(", "SPARSE": "export_from_path(", "CLS": "finetune("}


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_example_runs(index, world, tmp_path, monkeypatch):
    """A folder the example makes itself (it calls the function that writes it) is a new path; the others
    are the world's. Training is scaled down as for the commands (the same settings, passed to convert)."""
    import adapt
    import adapt.pipeline.convert as converting

    monkeypatch.chdir(tmp_path)
    code = blocks("python")[index]
    if reason := _missing_extra(code):
        pytest.skip(reason)
    for placeholder in sorted(FOLDERS + FILES, key=len, reverse=True):
        for quote in ('"', "'"):
            literal = f"{quote}{placeholder}{quote}"
            if literal in code:
                made_here = MAKERS.get(placeholder, "\0") in code or placeholder not in world
                target = tmp_path / placeholder if made_here else world[placeholder]
                code = code.replace(literal, repr(str(target)))
    real = converting.convert

    def small(*args, **kwargs):
        kwargs["overrides"] = list(kwargs.get("overrides") or []) + SMALL_TRAINING[3::2]
        kwargs["max_steps"] = 2
        return real(*args, **kwargs)

    monkeypatch.setattr(converting, "convert", small)
    monkeypatch.delattr(adapt, "convert", raising=False)  # resolved anew, to the scaled-down one
    try:
        exec(compile(code, f"README.md python block {index + 1}", "exec"), {"__name__": "readme_example"})
    finally:
        adapt.__dict__.pop("convert", None)


def _ledger_lines(text: str) -> dict[int, list[str]]:
    return {int(cells[0]): cells for cells in (
        [c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
        if re.match(r"^\| \d+ \|", line))}


def test_every_test_figure_the_readme_cites_is_a_ledger_line():
    """'ledger #N' in the README is line N of benchmarks/results/test_ledger.md, and that line's results file
    exists: a test-split figure the README reports was recorded when it was scored."""
    cited = {int(n) for n in re.findall(r"ledger #(\d+)", README.read_text(encoding="utf-8"))}
    lines = _ledger_lines((ROOT / "benchmarks" / "results" / "test_ledger.md").read_text(encoding="utf-8"))
    assert cited, "the README cites no ledger line"
    assert cited <= set(lines), f"the README cites ledger lines {sorted(cited - set(lines))} the ledger lacks"
    for n in cited:
        for name in re.split(r",\s*", lines[n][-1]):
            assert (ROOT / "benchmarks" / "results" / name).is_file(), f"ledger #{n} names {name}, which is not there"


def test_record_test_scoring_appends_the_next_line(tmp_path, monkeypatch):
    import benchmarks.common as common

    ledger = tmp_path / "test_ledger.md"
    ledger.write_text("# Test-split ledger\n\n| # | date | commit | split | models | purpose | results |\n"
                      "|---|---|---|---|---|---|---|\n| 7 | 2026-01-01 | abc | t | m | p | r.md |\n")
    monkeypatch.setattr(common, "LEDGER", ledger)
    assert common.record_test_scoring("finetune (test items)", "a | b", "finalists", "x.md") == 8
    lines = _ledger_lines(ledger.read_text())
    assert sorted(lines) == [7, 8]
    assert lines[8][3:] == ["finetune (test items)", "a / b", "finalists", "x.md"]
