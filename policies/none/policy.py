"""No fault tolerance: the baseline of the baseline, and the protection that keeps nothing."""

from __future__ import annotations

from ftlab.policies.grid import decision, grid
from ftlab.runtime.core.contract import Action, Change, Decision, Job, Keep, Outcome, Policy, Protection, Roles, Stop
from ftlab.runtime.core.plan import Plan


class NoRecovery(Policy):
    """``policy=none``: train on the PP x DP grid of ``train.stages`` and stop cleanly at the first failure."""

    roles = Roles(recovers=False)

    def plan(self, job: Job, protection: Protection) -> Decision:
        plan = grid(job.workers, job, generation=0, step=job.start_step)
        return decision(plan, "the PP x DP grid of train.stages", restore=job.start)

    def on_change(self, change: Change, job: Job, protection: Protection) -> Outcome:
        if not change.is_failure:
            return Keep(f"policy=none does not grow a running job: {change.describe()}")
        return Stop(
            f"{change.describe()} and policy=none does not recover; choose policy=checkpoint_restart "
            f"protection=storage, or policy=oobleck, to survive failures"
        )


class NoProtection(Protection):
    """``protection=none``: nothing is saved between failures."""

    keeps_state = False

    def after_commit(self, step: int, plan: Plan) -> list[Action]:
        return []
