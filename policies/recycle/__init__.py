"""ReCycle (SOSP'24): keep training through failures by rerouting micro-batches to data-parallel peers.

``plan_recycle`` is the entry point: a healthy PP x DP grid, its failed workers and per-stage costs in, a rerouted
plan with every worker's program and the predicted iteration time out. The parts: ``normalization`` (Algorithm 1,
how failures should spread over stages), ``problem`` (rerouting, the operations and their dependencies, programs),
``heuristic`` (list scheduling), ``milp`` (the adaptive-schedule MILP), ``planner`` (choosing and checking).
"""

from ftlab.policies.recycle.normalization import Normalization, NormalizationError, normalize_failures
from ftlab.policies.recycle.planner import ReCyclePlan, plan_recycle
from ftlab.policies.recycle.problem import ReCycleError, StageCosts

__all__ = [
    "Normalization",
    "NormalizationError",
    "ReCycleError",
    "ReCyclePlan",
    "StageCosts",
    "normalize_failures",
    "plan_recycle",
]
