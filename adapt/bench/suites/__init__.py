"""Benchmark task families, one module each, behind one registry.

A module of this package that offers suites declares::

    SUITES = {"quick": ("what it is, for --help", ["lee-similarity", ...])}   # suite name -> (help, task names)
    RANK = 0                                                                    # its place in listings
    TASK_NAMES = {...}; def load_task(name) -> Task                            # tasks it builds by name

``adapt bench --suite NAME`` and task names find them here; a module with ``SUITES`` and no
``TASK_NAMES`` (``mteb``) names tasks that another resolver loads (MTEB by name). Adding a task family
is adding such a module. Modules without ``SUITES`` are the families' shared parts (``package_data``,
``folders``, the standard suite's builders).
"""
from __future__ import annotations

import functools
import importlib
import pkgutil


@functools.lru_cache(maxsize=None)
def _suite_modules() -> tuple:
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "SUITES"):
            found.append(module)
    return tuple(sorted(found, key=lambda m: (getattr(m, "RANK", 5), m.__name__)))


def suites() -> dict[str, list[str]]:
    """Suite name -> its task names, in listing order."""
    out: dict[str, list[str]] = {}
    for module in _suite_modules():
        for name, (_, tasks) in module.SUITES.items():
            if name in out:
                raise RuntimeError(f"suite {name!r} is declared by two modules")
            out[name] = list(tasks)
    return out


def suite_help() -> dict[str, str]:
    return {name: text for module in _suite_modules() for name, (text, _) in module.SUITES.items()}


def task_loader(name: str):
    """The ``load_task`` of the module that builds task ``name``, or None."""
    for module in _suite_modules():
        if name in getattr(module, "TASK_NAMES", ()):
            return module.load_task
    return None


def named_tasks() -> dict[str, list[str]]:
    """Suite name -> task names, for the suites whose tasks are built here (for error messages)."""
    return {name: tasks for module in _suite_modules() if hasattr(module, "TASK_NAMES")
            for name, (_, tasks) in module.SUITES.items()}
