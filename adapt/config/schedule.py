"""Which masked-LM objective each training step uses: one name, a mixture, or phases.

A pure module (numpy only), so that ``adapt.config.settings`` can validate ``objective.schedule`` without
importing the training layer; :mod:`adapt.objectives.masked` runs the schedule.
"""
from __future__ import annotations

import copy
import math

import numpy as np

from adapt.errors import ConfigError

OBJECTIVES = ("mlm", "mntp", "clm")


def check_objective(name) -> str:
    if name not in OBJECTIVES:
        raise ConfigError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}.")
    return name


def _weights(spec, where: str) -> dict[str, float]:
    """``"mlm"`` -> {"mlm": 1.0}; ``{"mlm": 3, "clm": 1}`` checked and kept as given."""
    if isinstance(spec, str):
        return {check_objective(spec): 1.0}
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"{where}: expected an objective name or a mixture like {{mlm: 0.75, clm: 0.25}}, "
                          f"got {spec!r}.")
    for name, weight in spec.items():
        check_objective(name)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"{where}: the weight of {name!r} must be a positive number, not {weight!r}.")
    return dict(spec)


class ObjectiveSchedule:
    """Which objective each training step uses.

    A spec is one of:

    - an objective name: ``"mlm"``;
    - a mixture: ``{"mlm": 0.75, "clm": 0.25}``: each step draws one objective with these weights
      (normalised), deterministically from ``(seed, step)``, so a resumed run draws the same ones;
    - phases: ``[{"objective": "clm", "until": 0.5}, {"objective": "mlm"}]``: each phase's
      objective (a name or a mixture) runs up to ``until``, a fraction of the run in (0, 1] (a float)
      or an absolute step (an int). The last phase runs to the end: omit its ``until`` or set 1.0.
    """

    def __init__(self, spec, seed: int = 0):
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"schedule seed must be a non-negative integer, not {seed!r}.")
        self.seed = seed
        self._spec = copy.deepcopy(list(spec) if isinstance(spec, tuple) else spec)  # for to_spec()
        if not isinstance(spec, (list, tuple)):
            self._phases = [(_weights(spec, "objective"), None)]  # [(weights, until)]
            return
        if not spec:
            raise ConfigError("objective phases: the list is empty.")
        self._phases = []
        for i, phase in enumerate(spec):
            where = f"objective phase {i + 1}"
            if not isinstance(phase, dict) or "objective" not in phase or set(phase) - {"objective", "until"}:
                raise ConfigError(f"{where}: expected {{objective: ..., until: ...}}, got {phase!r}.")
            until = phase.get("until")
            last = i == len(spec) - 1
            if last and not (until is None or type(until) is float and until == 1.0):
                raise ConfigError(f"{where}: the last phase runs to the end of training; omit its `until` or set "
                                  f"it to 1.0 (got {until!r}).")
            if not last:
                if isinstance(until, bool) or not (isinstance(until, float) and 0 < until < 1
                                                   or isinstance(until, int) and until >= 1):
                    raise ConfigError(f"{where}: `until` must be a fraction of the run in (0, 1) (a float) or a "
                                      f"step >= 1 (an int), not {until!r}.")
            self._phases.append((_weights(phase["objective"], where), until))
        for i in range(1, len(self._phases) - 1):
            prev, cur = self._phases[i - 1][1], self._phases[i][1]
            if type(prev) is type(cur) and cur <= prev:
                raise ConfigError(f"objective phases must end in increasing order: phase {i + 1} ends at {cur!r}, "
                                  f"not after phase {i}'s {prev!r}.")

    @property
    def objectives(self) -> frozenset[str]:
        """Every objective this schedule can choose."""
        return frozenset(name for weights, _ in self._phases for name in weights)

    def _ends(self, total_steps: int) -> list[int]:
        """The step at which each phase ends (exclusive) in a run of ``total_steps``."""
        ends = [total_steps if u is None or isinstance(u, float) and u == 1.0
                else round(u * total_steps) if isinstance(u, float) else u for _, u in self._phases]
        if any(b < a for a, b in zip(ends, ends[1:])):
            raise ConfigError(f"objective phases end at steps {ends} in a run of {total_steps} steps: not in "
                              f"increasing order (fractions and absolute steps are mixed).")
        return ends

    def objective_at(self, step: int, total_steps: int) -> str:
        """The objective of ``step`` (0-based) in a run of ``total_steps``; a pure function of its inputs."""
        if step < 0 or total_steps < 1:
            raise ValueError(f"bad step {step} / total_steps {total_steps}")
        ends = self._ends(total_steps) if len(self._phases) > 1 else [total_steps]
        phase = next((i for i, end in enumerate(ends) if step < end), len(ends) - 1)
        weights = self._phases[phase][0]
        if len(weights) == 1:
            return next(iter(weights))
        names = list(weights)
        p = np.array([weights[n] for n in names], dtype=np.float64)
        draw = np.random.default_rng([self.seed, step]).random()
        return names[min(int(np.searchsorted(np.cumsum(p / p.sum()), draw, side="right")), len(names) - 1)]

    def to_spec(self):
        """The spec this schedule was built from (YAML-ready); ``ObjectiveSchedule(s.to_spec())`` is equal."""
        return copy.deepcopy(self._spec)

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjectiveSchedule) and (self.to_spec(), self.seed) == (other.to_spec(), other.seed)

    def __repr__(self) -> str:
        return f"ObjectiveSchedule({self.to_spec()!r}, seed={self.seed})"
