"""Batch distribution (Oobleck, SOSP'23, Eq. 6): how many micro-batches each pipeline runs per iteration.

A pipeline's iteration time is affine in its micro-batches, ``a + b * N`` (``PipelineTemplate.iteration_time``:
the paper's T1 + T2 + T3 with the actual N instead of 4 S; Eq. 6's ``N T`` is the case a = 0). The global batch
B is fixed: the counts must add up to B / b, and every pipeline gets at least one micro-batch.

Two forms, both with Pyomo:
- ``minmax`` (default): minimise the slowest pipeline's time, a MILP for HiGHS. Pipelines of one template are
  interchangeable and the optimum gives them counts that differ by at most one, so the model has three variables
  per template (a base count, how many get one more, whether any do), not one per pipeline: its size does not
  grow with the cluster. A tiny second term prefers giving micro-batches to faster pipelines among equal optima.
- ``variance``: Eq. 6 itself, the variance of the pipelines' times, one integer per pipeline: a convex MIQP
  for SCIP. Exact but slower; meant for a few pipelines.

When B is not a multiple of b, or gives fewer micro-batches than pipelines, no distribution exists; as the paper
does, we do not change B but say which global batch to use.

Where this differs from the paper, it is never slower. Eq. 6 gives every pipeline of one template the same count
(its constraint sums N_b,i b x_i over the templates) and minimises the variance of the pipelines' times; ``minmax``
lets pipelines of one template differ by one micro-batch and minimises the slowest pipeline, which is the job's
iteration time. Neither escapes integer counts at a fixed b: B / b micro-batches over k equal pipelines take as long
as ceil(B / (b k)) of them. With the paper's batches (Table 1: 512 micro-batches over at most 30 pipelines) losing
one pipeline of 30 costs about what it removes (17.1 to 17.7 micro-batches a pipeline, rounded up to 18 either way),
but with 2 micro-batches a pipeline (64 over 32 one-GPU pipelines) losing one makes two pipelines run 3 and the job
a third slower, and it stays there until fewer than 22 pipelines are left. That loss is Oobleck's at such a batch
(where Eq. 6 has no solution at all: 31 equal counts cannot add up to 64), not a rounding of ours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pyomo.environ as pyo
from pyomo.opt import TerminationCondition

from ftlab.policies.oobleck.templates import PipelineTemplate

MILP_SOLVER = "appsi_highs"
MINLP_SOLVER = "scip_direct"
TIE_BREAK = 1e-6


class BatchError(ValueError):
    """The global batch cannot be split; ``suggested`` is the nearest global batch that can."""

    def __init__(self, message: str, suggested: int) -> None:
        super().__init__(message)
        self.suggested = suggested


@dataclass(frozen=True)
class BatchSplit:
    microbatches: tuple[int, ...]
    """Per pipeline, in the order given."""
    iteration_s: float
    """The slowest pipeline's time: the iteration time of the whole job."""


def nearest_feasible_batch(global_batch: int, micro_batch: int, num_pipelines: int) -> int:
    """The global batch closest to ``global_batch`` (the smaller on a tie) that splits into micro-batches of
    ``micro_batch``, at least one per pipeline."""
    lowest = micro_batch * num_pipelines
    below = max(lowest, global_batch // micro_batch * micro_batch)
    above = max(lowest, -(-global_batch // micro_batch) * micro_batch)
    return below if global_batch - below <= above - global_batch else above


def microbatch_count(global_batch: int, micro_batch: int, num_pipelines: int) -> int:
    """B / b, or a BatchError naming the global batch to use instead."""
    if micro_batch > 0 and global_batch % micro_batch == 0 and global_batch // micro_batch >= num_pipelines:
        return global_batch // micro_batch
    if micro_batch <= 0:
        raise ValueError(f"micro-batch size must be positive, got {micro_batch}")
    suggested = nearest_feasible_batch(global_batch, micro_batch, num_pipelines)
    raise BatchError(
        f"global batch {global_batch} cannot be split into micro-batches of {micro_batch} across {num_pipelines} "
        f"pipelines (a whole number of micro-batches, at least one per pipeline): use global batch {suggested}",
        suggested,
    )


def _solve(model: pyo.ConcreteModel, solver: str) -> None:
    result = pyo.SolverFactory(solver).solve(model, load_solutions=False)
    if result.solver.termination_condition != TerminationCondition.optimal:
        raise RuntimeError(f"{solver} found no optimal batch distribution: {result.solver.termination_condition}")
    model.solutions.load_from(result)


def _minmax(pipelines: Sequence[PipelineTemplate], total: int) -> tuple[int, ...]:
    groups: dict[PipelineTemplate, list[int]] = {}
    for i, template in enumerate(pipelines):
        groups.setdefault(template, []).append(i)
    kinds = list(groups)
    size = {j: len(groups[t]) for j, t in enumerate(kinds)}
    a = {j: t.fixed_s for j, t in enumerate(kinds)}
    b = {j: t.per_microbatch_s for j, t in enumerate(kinds)}
    js = list(size)

    m = pyo.ConcreteModel()
    m.base = pyo.Var(js, domain=pyo.PositiveIntegers, bounds=(1, total))
    m.extra = pyo.Var(js, domain=pyo.NonNegativeIntegers, bounds=lambda _, j: (0, size[j] - 1))
    m.some = pyo.Var(js, domain=pyo.Binary)
    m.slowest = pyo.Var(domain=pyo.Reals)
    m.batch = pyo.Constraint(expr=sum(size[j] * m.base[j] + m.extra[j] for j in js) == total)
    m.extra_needs_some = pyo.Constraint(js, rule=lambda m, j: m.extra[j] <= (size[j] - 1) * m.some[j])
    m.bound = pyo.Constraint(js, rule=lambda m, j: m.slowest >= a[j] + b[j] * (m.base[j] + m.some[j]))
    # Busy time of all pipelines, scaled to at most a millionth of one micro-batch: a tie-break only.
    busy = sum(b[j] * (size[j] * m.base[j] + m.extra[j]) for j in js)
    m.objective = pyo.Objective(expr=m.slowest + TIE_BREAK / total * busy)
    _solve(m, MILP_SOLVER)
    counts = [0] * len(pipelines)
    for j, template in enumerate(kinds):
        base, extra = round(pyo.value(m.base[j])), round(pyo.value(m.extra[j]))
        for rank, i in enumerate(groups[template]):
            counts[i] = base + (1 if rank < extra else 0)
    return tuple(counts)


def _variance(pipelines: Sequence[PipelineTemplate], total: int) -> tuple[int, ...]:
    index = range(len(pipelines))
    m = pyo.ConcreteModel()
    m.n = pyo.Var(index, domain=pyo.PositiveIntegers, bounds=(1, total))
    m.batch = pyo.Constraint(expr=sum(m.n[i] for i in index) == total)
    times = [p.fixed_s + p.per_microbatch_s * m.n[i] for i, p in enumerate(pipelines)]
    mean = sum(times) / len(pipelines)
    m.objective = pyo.Objective(expr=sum((t - mean) ** 2 for t in times))
    _solve(m, MINLP_SOLVER)
    return tuple(round(pyo.value(m.n[i])) for i in index)


_KEPT: dict[tuple[tuple, int], tuple[int, ...]] = {}
_KEEP = 4096


def _minmax_kept(shape: tuple, total: int, solve: Callable[[], tuple[int, ...]]) -> tuple[int, ...]:
    """The min-max split, kept by its inputs: a cluster that loses and regains nodes asks the same few questions
    hundreds of times, and each solve takes HiGHS tens of ms."""
    key = (shape, total)
    if key not in _KEPT:
        if len(_KEPT) >= _KEEP:
            _KEPT.clear()
        _KEPT[key] = solve()
    return _KEPT[key]


def distribute_batch(
    pipelines: Sequence[PipelineTemplate], global_batch: int, micro_batch: int, method: str = "minmax"
) -> BatchSplit:
    """Micro-batches per pipeline adding up to ``global_batch / micro_batch``."""
    if not pipelines:
        raise ValueError("no pipeline to distribute the batch over")
    total = microbatch_count(global_batch, micro_batch, len(pipelines))
    if method == "minmax":
        # Pipelines of one size are of one template, so (size, a, b) names each one's part in the problem.
        shape = tuple((p.num_nodes, p.fixed_s, p.per_microbatch_s) for p in pipelines)
        counts = _minmax_kept(shape, total, lambda: _minmax(pipelines, total))
    elif method == "variance":
        counts = _variance(pipelines, total)
    else:
        raise ValueError(f"batch distribution method {method!r} is not 'minmax' or 'variance'")
    return BatchSplit(counts, max(p.iteration_time(n) for p, n in zip(pipelines, counts)))
