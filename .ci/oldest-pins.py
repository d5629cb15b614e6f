#!/usr/bin/env python3
"""The oldest releases pyproject.toml admits, as pip constraints: `make test-oldest` installs them.

Each package in OLDEST is pinned to the lower bound of its range in pyproject.toml (dependencies and
extras), so raising a bound there moves the test with it. `--check` (run by the oldest venv's
Python) fails unless the installed versions are exactly those pins.
"""
import re
import sys
import tomllib
from pathlib import Path

# The stack whose new releases change behaviour under us; the others resolve to what pip picks.
OLDEST = ("transformers", "peft", "sentence-transformers", "accelerate", "datasets", "mteb")


def pins(pyproject: Path) -> dict[str, str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    found = {}
    for spec in specs:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*([^;]*)", spec)
        name = m.group(1).lower().replace("_", "-")
        low = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", m.group(2))
        if name in OLDEST and low:
            found[name] = max(found.get(name, low.group(1)), low.group(1), key=_key)
    missing = set(OLDEST) - set(found)
    if missing:
        sys.exit(f"pyproject.toml gives no lower bound for {sorted(missing)}")
    return found


def _key(version: str) -> tuple:
    """'5.2' and '5.2.0' compare equal, as pip's == does."""
    parts = [int(p) if p.isdigit() else p for p in version.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def main() -> None:
    wanted = pins(Path(__file__).resolve().parent.parent / "pyproject.toml")
    if sys.argv[1:] == ["--check"]:
        from importlib.metadata import version

        wrong = {name: version(name) for name, v in wanted.items() if _key(version(name)) != _key(v)}
        if wrong:
            sys.exit(f"not the oldest releases: installed {wrong}, pyproject's lower bounds {wanted}")
        print("oldest releases installed:", ", ".join(f"{n}=={version(n)}" for n in wanted))
        return
    print("\n".join(f"{name}=={v}" for name, v in wanted.items()))


if __name__ == "__main__":
    main()
