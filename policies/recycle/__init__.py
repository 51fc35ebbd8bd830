"""ReCycle (SOSP'24): keep training through failures by rerouting micro-batches to data-parallel peers.

``plan_recycle`` is the entry point: a healthy PP x DP grid, its failed workers and per-stage costs in, a rerouted
plan with every worker's program and the predicted iteration time out. The parts: ``normalization`` (Algorithm 1,
how failures should spread over stages), ``problem`` (rerouting, the operations and their dependencies, programs),
``heuristic`` (list scheduling), ``milp`` (the adaptive-schedule MILP), ``planner`` (choosing and checking).

The names below load on first use: the policy catalog imports this package for its config alone, and the planner
brings Pyomo, which a refused or unrelated job must not wait for.
"""

import importlib
from typing import Any

_HOMES = {
    "Normalization": "normalization",
    "NormalizationError": "normalization",
    "normalize_failures": "normalization",
    "ReCyclePlan": "planner",
    "plan_recycle": "planner",
    "ReCycleError": "problem",
    "StageCosts": "problem",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:  # noqa: ANN401 - whichever name was asked for
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
