"""ReCycle's planner: from a healthy grid and its failed workers to a rerouted plan and every worker's program.

Steps: optionally normalize failures (move survivors between stages so the failures spread as Algorithm 1 says);
reroute the failed workers' micro-batches to data-parallel peers; schedule the operations with the list scheduler
and relabel interchangeable micro-batches so the schedule respects the symmetry orders (``Problem.symmetric``); if
its makespan meets ``Problem.lower_bound`` it is optimal and planning stops, otherwise the MILP improves it when the
MILP has at most ``max_binaries`` ordering binaries (``milp.improve``: healthy-pipeline bounds, a restricted model,
then the whole one, warm-started); turn the order into programs; check them and predict the makespan by executing
them on the abstract machine of ``runtime.core.program_check``.

Why 1,500 binaries by default: on a 2-core machine with HiGHS single-threaded, instances up to about that size
mostly solve to optimality in a few seconds. PP 8 x DP 4 with 16 micro-batches (900 to 1,900 binaries once
precedence-ordered pairs are left out) does not solve to optimality within 20 s, but the restricted model brings it
within 4-5% of the proven bound (``experiments/bench_planner.py``). With many micro-batches per pipeline the list
schedule usually meets the lower bound anyway: the stage that absorbs the rerouted work is the bottleneck and never
idles.

The staggered optimizer needs no instruction of its own here: ``ReduceGrads`` synchronises only the workers that
share a layer (one stage's peers), so each stage reduces and steps as soon as its own work is done. Its other half,
overlapping one iteration's optimizer step with the next iteration's warm-up, spans iterations and is not
modelled: programs and makespans are per iteration.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from ftlab.policies.recycle import heuristic, milp
from ftlab.policies.recycle.normalization import normalize_failures, rebalance
from ftlab.policies.recycle.problem import Problem, StageCosts, grid_shape
from ftlab.runtime.core.contract import LayerTransfer
from ftlab.runtime.core.instructions import Program
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.core.program_check import check_programs, simulate

Method = Literal["auto", "milp", "heuristic"]


@dataclass(frozen=True)
class ReCyclePlan:
    plan: Plan
    """The plan after rerouting: failed workers removed, peers named in the pipelines they serve."""
    programs: dict[int, Program]
    makespan: float
    """Predicted iteration time: the programs executed on the abstract machine with the given costs."""
    method: Literal["milp", "heuristic"]
    optimal: bool
    """True when the schedule is proven optimal for the model (by HiGHS, or by meeting the lower bound)."""
    lower_bound: float
    """A proven lower bound on the model's makespan (``Problem.lower_bound``, raised by the MILP's bound)."""
    binaries: int
    """Ordering binaries the MILP has (or would have) for this instance."""
    solve_s: float
    """Seconds spent scheduling (heuristic plus MILP)."""
    transfers: tuple[LayerTransfer, ...] = ()
    """Layer copies that failure normalization needs before the plan can run."""
    layout: Plan | None = None
    """The healthy-shaped grid of roles the plan reroutes around: the given grid, or the grid after failure
    normalization moved survivors between stages (failed workers still name the slots they left)."""


def plan_recycle(
    grid: Plan,
    failed: Collection[int],
    costs: StageCosts | Sequence[StageCosts],
    *,
    memory_limit: int | None = None,
    method: Method = "auto",
    max_binaries: int = 1500,
    time_limit_s: float = 10.0,
    normalize: bool = False,
) -> ReCyclePlan:
    """Reroute around ``failed`` workers of the healthy PP x DP ``grid`` and schedule one iteration.

    ``costs``: one StageCosts for every stage or one per stage. ``memory_limit``: micro-batches whose activations a
    worker may hold at once (default: twice the number of stages). ``method="auto"`` uses the MILP up to
    ``max_binaries`` ordering binaries.
    """
    transfers: tuple[LayerTransfer, ...] = ()
    if normalize:
        bounds = grid_shape(grid)
        dead = set(failed)
        actual = [sum(p.stages[s].worker in dead for p in grid.pipelines) for s in range(len(bounds))]
        per_pipeline = max(len(p.microbatches) for p in grid.pipelines)
        target = normalize_failures(len(grid.pipelines), len(bounds), per_pipeline, actual).per_stage
        grid, transfers = rebalance(grid, failed, target)
    problem = Problem.build(grid, failed, costs, memory_limit)
    binaries = problem.unordered_pairs()
    began = time.perf_counter()
    schedule = problem.symmetric(heuristic.list_schedule(problem))
    order = {w: [op for op, _ in ops] for w, ops in schedule.items()}
    used: Literal["milp", "heuristic"] = "heuristic"
    lower_bound = problem.lower_bound()
    makespan = heuristic.makespan(problem, schedule)
    optimal = makespan <= lower_bound * (1 + 1e-9)  # then no MILP can do better
    if not optimal and (method == "milp" or (method == "auto" and binaries <= max_binaries)):
        solution = milp.improve(problem, schedule, makespan, time_limit_s)
        order = {w: [op for op, _ in ops] for w, ops in solution.schedule.items()}
        used, optimal, lower_bound = "milp", solution.optimal, max(lower_bound, solution.lower_bound)
    solve_s = time.perf_counter() - began
    programs = problem.programs(order)
    check_programs(problem.plan, programs)
    makespan = simulate(programs, problem.durations(), problem.plan)
    return ReCyclePlan(
        problem.plan, programs, makespan, used, optimal, lower_bound, binaries, solve_s, transfers, layout=grid
    )
