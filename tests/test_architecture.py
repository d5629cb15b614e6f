"""Imports point one way: files and layout -> model primitives -> objectives -> the loop -> artifacts
-> the pipeline -> commands. No cycles, and no module reaches for another's private names.

Every import counts, those inside functions too: an import moved into a function still ties the
two modules together. DEVELOPERS.md shows the same layers.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "adapt"

# Bottom to top; a module may import modules of its own layer or of layers below it. A layer names
# top-level modules and subpackages of adapt (a subpackage's modules are all in its layer).
LAYERS = [
    ("errors and files", {"errors", "files"}),
    ("configuration", {"config"}),
    ("model and data", {"model", "data"}),
    ("objectives", {"objectives"}),
    ("the training loop", {"training"}),
    ("artifacts: export and inference", {"export", "inference"}),
    ("the pipeline", {"pipeline"}),
    ("commands", {"cli", "__main__", "bench"}),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


# Inside a subpackage its modules have layers of their own, bottom to top ("" is the package's __init__).
SUBLAYERS = {
    "bench": [
        ("numbers, sources and files", {"metrics", "stats", "sources", "cache", "report"}),
        ("tasks", {"tasks"}),
        ("task families and baselines", {"suites", "bm25", "sparse"}),
        ("models, sizes and verdicts", {"models", "dims", "verdict"}),
        ("the runner", {"runner", "finetuned"}),
        ("the package", {""}),
    ],
}


def _layer(module: str) -> tuple[int, int]:
    """(layer of the package, layer inside it): ``adapt.bench.stats`` is (commands, numbers...); a module of a
    package without SUBLAYERS is (its layer, 0)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    for i, (_, names) in enumerate(LAYERS):
        if top in names:
            break
    else:
        raise AssertionError(f"{module} is in no layer of tests/test_architecture.py: add it to LAYERS")
    if top not in SUBLAYERS:
        return i, 0
    inner = parts[2] if len(parts) > 2 else ""
    for j, (_, names) in enumerate(SUBLAYERS[top]):
        if inner in names:
            return i, j
    raise AssertionError(f"{module} is in no layer of adapt.{top}: add it to SUBLAYERS in tests/test_architecture.py")


def _layer_name(module: str) -> str:
    i, j = _layer(module)
    top = module.split(".")[1] if "." in module else ""
    return LAYERS[i][0] + (f" / {SUBLAYERS[top][j][0]}" if top in SUBLAYERS else "")


def _points_up(module: str, target: str) -> bool:
    """Whether ``module`` importing ``target`` points up: across packages by the packages' layers, inside one
    package by its SUBLAYERS."""
    (i, j), (ti, tj) = _layer(module), _layer(target)
    same_package = module.split(".")[:2] == target.split(".")[:2]
    return tj > j if same_package else ti > i


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported adapt module, imported name or None, line) for every import of ``module``."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "adapt"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "adapt":
            assert node.level == 0, f"{module}:{node.lineno}: use absolute imports"
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub, None, node.lineno) if sub in MODULES else (node.module, alias.name, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    return {m: {target for target, _, _ in _imports(m) if target != m} for m in MODULES}


def test_every_module_is_in_a_layer():
    for module in MODULES:
        if module != "adapt":
            _layer(module)


def test_imports_point_down_the_layers():
    bad = []
    for module in MODULES:
        if module == "adapt":
            continue
        for target, _, line in _imports(module):
            if target in MODULES and target != "adapt" and _points_up(module, target):
                bad.append(f"{module}:{line} ({_layer_name(module)}) imports {target} ({_layer_name(target)})")
    assert not bad, "imports that point up the layers:\n" + "\n".join(bad)


def test_the_layer_check_sees_inside_packages():
    """adapt.bench's modules are checked against each other, not only as one 'commands' layer."""
    assert _points_up("adapt.bench.tasks", "adapt.bench.runner")
    assert _points_up("adapt.bench.stats", "adapt.bench.tasks")
    assert not _points_up("adapt.bench.runner", "adapt.bench.tasks")
    assert _points_up("adapt.model.loading", "adapt.bench.stats") and not _points_up("adapt.bench.stats", "adapt.model.loading")
    assert not _points_up("adapt.objectives.masked", "adapt.objectives")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_names():
    bad = []
    for module in MODULES:
        for target, name, line in _imports(module):
            if name is not None and name.startswith("_") and not name.startswith("__") and target != module:
                bad.append(f"{module}:{line} imports {target}.{name}")
        source = MODULES[module].read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):  # adapt.x._private through a module object
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                chain = ast.unparse(node.value)
                if chain.startswith("adapt.") and chain in MODULES and chain != module:
                    bad.append(f"{module}:{node.lineno} uses {chain}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_sizes_stay_readable(module):
    """A module a reader takes in at once: 450 lines at most (STYLE.md: 100 to 300 is the norm)."""
    lines = len(MODULES[module].read_text(encoding="utf-8").splitlines())
    assert lines <= 450, f"{module} has {lines} lines: split it by concern"
