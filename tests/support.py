"""Policies with hand-made layouts, for tests that need a particular plan."""

from __future__ import annotations

from ftlab.policies.grid import decision
from ftlab.policies.none.policy import NoRecovery
from ftlab.runtime.contract import Decision, Job, Protection
from ftlab.runtime.plan import Pipeline, Plan, Stage


class HeterogeneousLayout(NoRecovery):
    """One 3-stage and one 2-stage pipeline with different layer splits and unequal micro-batch counts (gpt2-tiny)."""

    def plan(self, job: Job, protection: Protection) -> Decision:
        w = job.workers
        layers = len(job.specs)
        micro = job.train.global_batch // job.train.micro_batch
        three = Pipeline((Stage(w[0], 0, 3), Stage(w[1], 3, 6), Stage(w[2], 6, layers)), tuple(range(0, micro - 3)))
        two = Pipeline((Stage(w[3], 0, 4), Stage(w[4], 4, layers)), tuple(range(micro - 3, micro)))
        plan = Plan(0, layers, job.train.global_batch, job.train.micro_batch, (three, two), step=job.start_step)
        plan.validate()
        return decision(plan, "a 3-stage and a 2-stage pipeline")
