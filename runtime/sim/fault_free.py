"""The fault-free bound: a plan on fewer workers than the job's fault-free plan never trains faster than it.

Fewer workers with the same model can only do the same work slower (a reroute adds work to the survivors, a smaller
grid has fewer replicas), so a simulated plan after failures whose samples/s exceed the fault-free plan's (by more
than ``TOLERANCE``) says that something is timed unlike its fault-free counterpart: a better scheduler for recovered
plans than for the fault-free one, a batch split the fault-free plan could have had too. The simulated backend
reports every plan it configures here (``SimBackend.configure``); the job goes on, and ``faster_than_fault_free``
lists the plans that broke the bound, for a study to count and a test to hold empty
(``tests/test_fault_free_bound.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ftlab.runtime.core.plan import Plan

TOLERANCE = 1e-3
"""Relative: a plan at most 0.1% above the fault-free samples/s ties with it. Fewer members change a little that no
scheduler decides: a ring all-reduce moves 2(n-1)/n of the gradient bytes, less with fewer replicas, so BERT-Large's
256 micro-batches on 29 one-node pipelines (at most 9 a pipeline, as on 30) run 0.001% faster than on 30. The bound
is there for plans timed unlike their fault-free counterpart (a better schedule, a better batch split), not for that."""


@dataclass(frozen=True)
class FasterThanFaultFree:
    """A plan after failures that trains faster than the job's fault-free plan."""

    generation: int
    workers: int
    samples_per_s: float
    fault_free_workers: int
    fault_free_samples_per_s: float


class FaultFreeBound:
    """The first plan configured is the job's fault-free plan (the job starts on its whole cluster); every later plan
    on fewer workers is held to its samples/s."""

    def __init__(self) -> None:
        self.fault_free: tuple[int, float] | None = None
        """(workers, samples/s) of the fault-free plan."""
        self.faster: list[FasterThanFaultFree] = []

    def timed(self, plan: Plan, period_s: float) -> None:
        """``plan`` configured, a step of it taking ``period_s`` with nothing beside it."""
        rate = plan.global_batch / period_s
        if self.fault_free is None:
            self.fault_free = (len(plan.workers), rate)
            return
        workers, fault_free = self.fault_free
        if len(plan.workers) < workers and rate > fault_free * (1 + TOLERANCE):
            self.faster.append(FasterThanFaultFree(plan.generation, len(plan.workers), rate, workers, fault_free))
