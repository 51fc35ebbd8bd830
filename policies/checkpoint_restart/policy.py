"""Checkpoint-restart, in the way of Varuna's job morphing and TorchElastic.

Checkpoints go to storage every ``checkpoint_every`` steps (the base policy's ``after_step``; atomic, see
``runtime.checkpoint``). On any failure every worker process is ended, fresh ones start on the surviving nodes, the
job morphs to the largest PP x DP grid those nodes allow and resumes from the newest committed checkpoint. The steps
since that checkpoint are lost and recomputed; because the data order is a function of (seed, step) and every layout
computes the same gradient, the recomputed losses repeat the fault-free run's step for step. A node that joins
waits for the next restart (Varuna adds capacity only when it morphs).
"""

from __future__ import annotations

from policies.base import Change, Continue, Job, Policy, Recovery, Restart, Stop
from runtime import checkpoint
from runtime.plan import Plan, PlanError, grid_plan


class CheckpointRestart(Policy):
    def plan(self, job: Job, generation: int = 0, step: int = 0) -> Plan:
        if self.settings.checkpoint_every < 1:
            raise PlanError(
                "policy=checkpoint_restart needs checkpoints to restart from: set policy.checkpoint_every to a "
                "number of steps (e.g. 5)"
            )
        return largest_grid(job.workers, job, generation, step)

    def on_change(self, change: Change, job: Job) -> Recovery:
        if not (change.failed_nodes or change.failed_workers):
            return Continue()
        latest = checkpoint.latest(self.settings.checkpoint_dir)
        step, source = (latest[0], str(latest[1])) if latest else (0, None)
        try:
            plan = largest_grid(job.slots, job, change.plan.generation + 1, step)
        except PlanError as exc:
            return Stop(f"no grid fits the surviving nodes: {exc}")
        return Restart(plan, source)


def largest_grid(workers: list[int], job: Job, generation: int, step: int) -> Plan:
    """The PP x DP grid with the configured stages (fewer if fewer workers survive) and as many replicas as fit."""
    t = job.train
    if not workers:
        raise PlanError("no worker survives")
    stages = min(t.stages, len(workers))
    replicas = min(len(workers) // stages, t.global_batch // t.micro_batch)
    return grid_plan(workers[: stages * replicas], stages, len(job.specs), t.global_batch, t.micro_batch, generation, step)
