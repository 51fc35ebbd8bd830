"""The PP x DP grid every simple policy trains on, as a Decision."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ftlab.runtime.core.contract import Decision, Job, Outcome, Source, Stop
from ftlab.runtime.core.memory_fit import first_overfull
from ftlab.runtime.core.plan import Plan, PlanError, grid_plan
from ftlab.runtime.core.scheduler import one_f_one_b


def grid(workers: Sequence[int], job: Job, generation: int, step: int) -> Plan:
    """``train.stages`` stages over ``workers``, as many replicas as they allow."""
    t = job.train
    return grid_plan(list(workers), t.stages, len(job.specs), t.global_batch, t.micro_batch, generation, step)


def largest_grid(workers: Sequence[int], job: Job, generation: int, step: int) -> Plan:
    """The grid with the configured stages (fewer if fewer workers survive) and as many replicas as fit."""
    t = job.train
    if not workers:
        raise PlanError("no worker survives")
    stages = min(t.stages, len(workers))
    replicas = min(len(workers) // stages, t.global_batch // t.micro_batch)
    return grid_plan(list(workers[: stages * replicas]), stages, len(job.specs), t.global_batch, t.micro_batch, generation, step)


def restart_grid(job: Job, generation: int, source: Source | None) -> tuple[Plan, str]:
    """The largest grid over every live slot (the workers a restart starts), at ``source``'s step, and where its
    state comes from, for the decision's reason. Raises PlanError when no grid fits the slots or their devices."""
    plan = largest_grid(job.slots, job, generation, source.step if source else 0)
    check_fits(plan, job)
    return plan, f"{source.kind} of step {source.step}" if source else "scratch (nothing saved yet)"


def check_fits(plan: Plan, job: Job) -> None:
    """Raise PlanError when a stage of ``plan`` does not fit its device: a restart on fewer workers than
    ``train.stages`` gives each stage more layers than the first plan (the one the preflight check passed) had."""
    overfull = first_overfull(plan, job)
    if overfull is not None:
        stages = len(plan.pipelines[0].stages)
        raise PlanError(f"{overfull.describe(job.model.name)}, in a {stages}-stage layout (train.stages="
                        f"{job.train.stages}, live workers: {len(job.slots)}): to restart on fewer workers, raise "
                        f"cluster.device_memory_gb or set train.activation_checkpointing=true")  # fmt: skip


def restart(job: Job, generation: int, source: Source | None, why: str) -> Outcome:
    """Restart every live slot on the largest grid from ``source`` (``restart_grid``), or stop when no grid fits;
    ``why`` opens the reason."""
    try:
        plan, where = restart_grid(job, generation, source)
    except PlanError as exc:
        return Stop(f"{why}: no grid fits the surviving nodes: {exc}")
    return decision(plan, f"{why}: restart {len(plan.workers)} workers from {where}", restore=source, restart=True)


def decision(plan: Plan, reason: str, restore: Source | None = None, restart: bool = False, **details: Any) -> Decision:
    """A plan run with the default 1F1B programs."""
    return Decision(plan, one_f_one_b(plan), restart=restart, restore=restore, reason=reason, details=details)
