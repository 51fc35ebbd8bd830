"""Checkpoint-restart, in the way of Varuna's job morphing and TorchElastic.

On any failure every worker process is ended, fresh ones start on the surviving nodes, the job morphs to the largest
PP x DP grid those nodes allow and resumes from the newest saved state its protection holds (a storage checkpoint,
or REFT's in-memory snapshot). The steps since that state are lost and recomputed; because the data order is a
function of (seed, step) and every layout computes the same gradient, the recomputed losses repeat the fault-free
run's step for step. A node that joins waits for the next restart (Varuna adds capacity only when it morphs).
Warned of a preemption, it checkpoints the committed step at once, giving the iteration in flight up
(``heeds_warnings_at_once``, ``policies.warnings``).
"""

from __future__ import annotations

from ftlab.policies.warnings import checkpoint_now
from ftlab.policies.grid import decision, largest_grid, restart
from ftlab.runtime.core.contract import (
    Change, ConfigError, Decision, Heed, Job, Keep, Outcome, Policy, PreemptionWarning, Protection, Roles,
)  # fmt: skip


class CheckpointRestart(Policy):
    roles = Roles(restarts=True, candidate="restart")
    heeds_warnings_at_once = True  # it checkpoints when warned: mid-iteration, not after the kill

    def check(self, protection: Protection) -> None:
        if not protection.keeps_state:
            raise ConfigError(
                "policy=checkpoint_restart restarts from saved state, and protection=none saves none: add "
                "protection=storage (periodic checkpoints to storage) or protection=reft (snapshots in host memory)"
            )

    def plan(self, job: Job, protection: Protection) -> Decision:
        plan = largest_grid(job.workers, job, generation=0, step=job.start_step)
        return decision(plan, "the largest PP x DP grid of train.stages", restore=job.start)

    def on_warning(self, warning: PreemptionWarning, job: Job, protection: Protection) -> Heed:
        return checkpoint_now(warning, job, protection)

    def on_change(self, change: Change, job: Job, protection: Protection) -> Outcome:
        if not change.is_failure:
            return Keep(f"{change.describe()}; they join at the next restart")
        return restart(job, change.generation, protection.restore_source(change), change.describe())
