"""The settings of ``policy=recycle``."""

from __future__ import annotations

from dataclasses import dataclass

SOLVERS = ("list", "milp")


@dataclass
class ReCycleConfig:
    _target_: str = "ftlab.policies.recycle.policy.ReCycle"
    name: str = "recycle"
    solver: str = "list"
    """How the programs after a failure are scheduled: ``list`` (the list scheduler, online, milliseconds) or
    ``milp`` (the adaptive-schedule MILP, warm-started from the list schedule, within ``milp_time_limit_s``; skipped
    when the list schedule already meets the lower bound). Either is cached per failure pattern."""
    milp_time_limit_s: float = 20.0
    normalize: bool = True
    """Failure normalization (Algorithm 1): when several failures crowd one stage, move survivors between stages
    (they receive their new stage's layers from a peer) so the rerouted work spreads over stages."""
    staggered_optimizer: bool = False
    """Each worker steps its optimizer as soon as its own gradients are reduced, before the commit, and undoes the
    step if the iteration is aborted (``runtime.core.instructions.OptimizerStep.early``)."""
    memory_limit: int = 0
    """Micro-batches whose activations a worker may hold at once in the planner's schedules (rerouted, or the
    fault-free grid's); 0: what the device memory allows (``cluster.device_memory_gb``), at most twice the number of
    stages."""


SCHEMAS = {"policy": ReCycleConfig}
