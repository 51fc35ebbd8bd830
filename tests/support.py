"""Policies with hand-made layouts, for tests that need a particular plan."""

from __future__ import annotations

from policies.base import Job, NoFaultTolerance
from runtime.plan import Pipeline, Plan, Stage


class HeterogeneousLayout(NoFaultTolerance):
    """One 3-stage and one 2-stage pipeline with different layer splits and unequal micro-batch counts (gpt2-tiny)."""

    def plan(self, job: Job, generation: int = 0, step: int = 0) -> Plan:
        w = job.workers
        layers = len(job.specs)
        micro = job.train.global_batch // job.train.micro_batch
        three = Pipeline((Stage(w[0], 0, 3), Stage(w[1], 3, 6), Stage(w[2], 6, layers)), tuple(range(0, micro - 3)))
        two = Pipeline((Stage(w[3], 0, 4), Stage(w[4], 4, layers)), tuple(range(micro - 3, micro)))
        plan = Plan(generation, layers, job.train.global_batch, job.train.micro_batch, (three, two), step=step)
        plan.validate()
        return plan
