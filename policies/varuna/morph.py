"""Job morphing: the configuration of the live workers the machine predicts fastest, the global batch fixed."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from ftlab.runtime.core.contract import ConfigError, Job, Protection
from ftlab.runtime.core.memory_fit import overfull_bounds
from ftlab.runtime.core.plan import Plan, PlanError, grid_plan
from ftlab.runtime.core.scheduler import one_f_one_b


@dataclass(frozen=True)
class Morph:
    """One configuration and what the machine predicts of it."""

    plan: Plan
    stages: int
    pipelines: int
    micro_batch: int
    step_s: float

    @property
    def samples_per_s(self) -> float:
        return self.plan.global_batch / self.step_s


def micro_batches(job: Job) -> list[int]:
    """The micro-batch sizes considered, largest first: the divisors of the global batch up to ``train.micro_batch``
    (the size the machine's profile is taken at; see ``policy``'s docstring)."""
    t = job.train
    return [m for m in range(t.micro_batch, 0, -1) if t.global_batch % m == 0]


def balanced_split(job: Job, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges whose busiest stage computes least (a micro-batch's forward and backward on the
    machine's profile). Varuna's partitioner cuts the model at the cut-points whose profiled compute balances the
    stages; a language model's head (a vocabulary-wide matmul) costs several blocks, so an even count of layers would
    leave the last stage the slowest and every other stage waiting on it."""
    costs = job.costs
    per_layer = tuple(costs.forward_s(i, i + 1) + costs.backward_s(i, i + 1) for i in range(costs.num_layers))
    return list(_balanced(per_layer, stages))


@functools.cache
def _balanced(costs: tuple[float, ...], stages: int) -> tuple[tuple[int, int], ...]:
    """The linear partition of ``costs`` into ``stages`` non-empty ranges minimising the largest range's sum."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][j]: the least busiest-stage cost of layers [0, j) in k stages; cut[k][j]: where its last stage starts.
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                busiest = max(best[k - 1][i], prefix[j] - prefix[i])
                if busiest < best[k][j]:
                    best[k][j], cut[k][j] = busiest, i
    bounds, stop = [], n
    for k in range(stages, 0, -1):
        bounds.append((cut[k][stop], stop))
        stop = cut[k][stop]
    return tuple(reversed(bounds))


def fits(job: Job, bounds: Sequence[tuple[int, int]], micro_batch: int) -> bool:
    """Every stage of ``bounds`` fits a device at ``micro_batch``: the check the preflight and restarts use."""
    return next(overfull_bounds(job, bounds, micro_batch), None) is None


def protects(protection: Protection, plan: Plan, job: Job) -> bool:
    """Whether ``protection`` can protect ``plan`` (REFT needs two holders of every layer, for one)."""
    try:
        protection.check_plan(plan, job)
    except ConfigError:
        return False
    return True


SAMPLED = 2
"""Micro-batches per pipeline stage beyond which a 1F1B iteration is timed at two shorter lengths and extrapolated."""


def step_s(job: Job, workers: Sequence[int], bounds: Sequence[tuple[int, int]], micro: int) -> float:
    """The machine's time for a step of the grid of ``bounds``'s stages over ``workers`` at ``micro``. Once each
    pipeline runs more than ``2 * SAMPLED`` micro-batches per stage, a 1F1B iteration grows linearly with them (the
    steady state adds one forward and one backward each; fill, drain, reduction and optimizer stay), so it is timed
    at ``SAMPLED`` and ``2 * SAMPLED`` per stage and extrapolated: a paper-scale batch of thousands of micro-batches
    is weighed over every configuration in seconds rather than hours."""
    t, machine = job.train, job.machine()
    stages = len(bounds)
    pipelines = len(workers) // stages

    def timed(global_batch: int) -> float:
        plan = grid_plan(list(workers), stages, len(job.specs), global_batch, micro, bounds=bounds)
        return machine.step_s(plan, one_f_one_b(plan))

    longest = -(-(t.global_batch // micro) // pipelines)  # round-robin: the first pipelines get one more
    few = SAMPLED * stages
    if longest <= 2 * few:
        return timed(t.global_batch)
    short, long_ = timed(few * pipelines * micro), timed(2 * few * pipelines * micro)
    return short + (long_ - short) * (longest - few) / few


def morph(workers: Sequence[int], job: Job, protection: Protection, generation: int, step: int) -> tuple[Morph, list[Morph]]:
    """The fastest configuration over ``workers`` that ``protection`` can protect, and every one weighed. For each
    pipeline depth and micro-batch size that fits memory, as many pipelines as the workers fill and the micro-batches
    feed. Where the protection can protect none, the fastest of all: the preflight check refuses a first plan the
    protection cannot protect, with the protection's own message, and later the protection keeps what it can. Raises
    PlanError, saying what to change, when none fits memory."""
    t = job.train
    weighed: list[Morph] = []
    for stages in range(1, min(len(job.specs), len(workers)) + 1):
        bounds = balanced_split(job, stages)
        for micro in micro_batches(job):
            if not fits(job, bounds, micro):
                continue
            pipelines = min(len(workers) // stages, t.global_batch // micro)
            plan = grid_plan(list(workers[: stages * pipelines]), stages, len(job.specs), t.global_batch, micro,
                             generation, step, bounds)  # fmt: skip
            weighed.append(Morph(plan, stages, pipelines, micro, step_s(job, plan.workers, bounds, micro)))
            if t.global_batch // micro >= len(workers) // stages:
                break  # a smaller micro-batch runs no more pipelines, and is charged as much per micro-batch
    if not weighed:
        raise PlanError(
            f"no configuration of {len(workers)} workers fits {job.model.name} in {job.device_memory_bytes / 2**30:.2f} "
            f"GiB per device at any micro-batch up to train.micro_batch={t.micro_batch}: raise "
            f"cluster.device_memory_gb, add nodes, or set train.activation_checkpointing=true"
        )
    # Fastest first; among equal predictions the one using more workers, then the deeper micro-batch.
    protected = [m for m in weighed if protects(protection, m.plan, job)]
    best = max(protected or weighed, key=lambda m: (m.samples_per_s, len(m.plan.workers), m.micro_batch))
    if protected:
        protection.check_plan(best.plan, job)  # what it derives from a plan (REFT's interval) is for the one chosen
    return best, weighed
