"""ReCycle's adaptive schedule as a MILP (slides, "Adaptive Schedule Generation"), built in Pyomo, solved by HiGHS.

Variables: a start time per operation (the slides use end times; start = end - duration), the makespan, and for
every two operations of one worker whose order no precedence decides a binary that orders them (the slides' ``O``).
Constraints: the cross-stage and same-stage dependencies with transfer times (``Problem.predecessors``, the
slides' (2)-(4)); no two operations of a worker overlap (disjunctive big-M pairs, (5)); the memory limit at the start
of every forward, counted through the ordering ((6): forwards before it add a micro-batch, B_weights before it
release one). Objective: the makespan.

The assignment of rerouted micro-batches to peers is fixed beforehand (``problem.reroute``), so the slides'
products of assignment and time variables disappear and the model stays linear. What keeps it tractable:

- symmetry breaking: micro-batches that follow the same workers are interchangeable, so each operation kind runs
  them in id order (``Problem.symmetry_predecessors`` says why no schedule is lost); these orders are precedences
  like the dependencies, and a pair of operations that a chain of precedences orders gets no binary at all (on
  PP 8 x DP 4 with 16 micro-batches about half the pairs);
- every start lies between its head and the horizon minus its tail and duration, widened by a rounding slack
  (``Problem.heads_and_tails``: the longest chains, raised by the work of the same worker that must come before or
  after); the horizon is the list scheduler's makespan, whose schedule, relabelled to respect the symmetry orders
  (``Problem.symmetric``), is the warm start, so the MILP answer is never worse than the heuristic's;
- each big-M is the tightest the two start windows allow;
- the makespan is at least ``Problem.lower_bound`` (a constant: the critical path and each worker's preemptive
  one-machine optimum), and at least every operation's start plus its duration and tail.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass

import pyomo.environ as pyo
from pyomo.contrib.appsi.base import TerminationCondition
from pyomo.contrib.appsi.solvers.highs import Highs

from ftlab.policies.recycle import heuristic
from ftlab.policies.recycle.heuristic import Schedule
from ftlab.policies.recycle.problem import Op, Phase, Problem
from ftlab.runtime.core.plan import grid_plan

_EXACT = 1e-9
"""Relative tolerance under which a makespan meets a bound (sums taken in different orders)."""


@dataclass(frozen=True)
class MilpSolution:
    schedule: Schedule
    """Each worker's operations in the order the solution runs them, with their start times."""
    makespan: float
    lower_bound: float
    """A proven lower bound on the makespan of every schedule."""
    optimal: bool


def ordering_pairs(problem: Problem) -> list[tuple[Op, Op]]:
    """Pairs of operations on one worker that no precedence chain orders: one binary each."""
    return [
        (a, b)
        for ops in problem.ops_by_worker.values()
        for a, b in itertools.combinations(ops, 2)
        if not problem.ordered(a, b)
    ]


def build_model(
    problem: Problem, horizon: float, lower_bound: float, fixed: Mapping[tuple[Op, Op], bool] | None = None
) -> tuple[pyo.ConcreteModel, list[tuple[Op, Op]]]:
    """The model of schedules no longer than ``horizon``; ``fixed`` decides some pairs' order ((a, b) -> a first)."""
    ops = problem.ops
    index = {op: i for i, op in enumerate(ops)}
    head, tail = problem.heads_and_tails()
    # The slack absorbs rounding: the warm start's times were summed in another order than head and tail.
    slack = 1e-6 * max(horizon, 1.0)
    earliest = {op: head[op] - slack for op in problem.ops}
    latest = {op: horizon - tail[op] - problem.duration(op) + slack for op in problem.ops}
    pairs = ordering_pairs(problem)
    m = pyo.ConcreteModel()
    m.start = pyo.Var(range(len(ops)), bounds=lambda _, i: (earliest[ops[i]], latest[ops[i]]))
    m.makespan = pyo.Var(bounds=(lower_bound - slack, horizon + slack))
    m.before = pyo.Var(range(len(pairs)), domain=pyo.Binary)
    m.objective = pyo.Objective(expr=m.makespan, sense=pyo.minimize)
    m.rules = pyo.ConstraintList()

    def start(op: Op) -> pyo.Var:
        return m.start[index[op]]

    for op in ops:
        for pred, lag in problem.precedences(op):
            m.rules.add(start(op) >= start(pred) + problem.duration(pred) + lag)
        # Not only the last operations: a late start anywhere delays the chain after it.
        m.rules.add(m.makespan >= start(op) + problem.duration(op) + tail[op])

    before: dict[tuple[Op, Op], object] = {}
    for k, (a, b) in enumerate(pairs):
        y = m.before[k]
        before[(a, b)], before[(b, a)] = y, 1 - y
        # The tightest big-M each direction allows, from the two start windows.
        m_ab = max(0.0, latest[a] + problem.duration(a) - earliest[b])
        m_ba = max(0.0, latest[b] + problem.duration(b) - earliest[a])
        m.rules.add(start(b) >= start(a) + problem.duration(a) - m_ab * (1 - y))
        m.rules.add(start(a) >= start(b) + problem.duration(b) - m_ba * y)
        if fixed and (a, b) in fixed:
            y.fix(int(fixed[(a, b)]))

    for ops_of_worker in problem.ops_by_worker.values():
        if len({op.microbatch for op in ops_of_worker}) <= problem.memory_limit:
            continue  # the worker never holds more micro-batches than the limit
        for b in ops_of_worker:
            if b.phase is not Phase.FORWARD:
                continue
            held = 1 + sum(
                _before(problem, before, a, b) if a.phase is Phase.FORWARD else -_before(problem, before, a, b)
                for a in ops_of_worker
                if a.microbatch != b.microbatch and a.phase is not Phase.BACKWARD_INPUT
            )
            if isinstance(held, int):  # the precedences decide every pair: nothing to constrain
                assert held <= problem.memory_limit, f"the precedences alone overflow the memory at {b}"
                continue
            m.rules.add(held <= problem.memory_limit)
    return m, pairs


def _before(problem: Problem, before: dict[tuple[Op, Op], object], a: Op, b: Op) -> object:
    """1 when ``a`` runs before ``b``: a binary, or a constant when a precedence chain decides."""
    if (a, b) in before:
        return before[(a, b)]
    return int(problem.precedes(a, b))


def solve(
    problem: Problem,
    time_limit_s: float,
    horizon: float,
    lower_bound: float,
    warm: Schedule | None = None,
    fixed: Mapping[tuple[Op, Op], bool] | None = None,
) -> MilpSolution | None:
    """The best schedule HiGHS finds within ``time_limit_s`` among those no longer than ``horizon`` (and keeping
    the ``fixed`` orders), started from ``warm`` if given; None when it found none."""
    m, pairs = build_model(problem, horizon, lower_bound, fixed)
    index = {op: i for i, op in enumerate(problem.ops)}
    if warm is not None:
        position = {op: (w, k) for w, ops in warm.items() for k, (op, _) in enumerate(ops)}
        for ops in warm.values():
            for op, t in ops:
                var = m.start[index[op]]
                var.set_value(min(max(t, var.lb), var.ub))  # a solver's answer may sit a tolerance outside
        for k, (a, b) in enumerate(pairs):
            if not m.before[k].fixed:
                m.before[k].set_value(int(position[a] < position[b]))
        m.makespan.set_value(horizon)

    solver = Highs()
    solver.config.time_limit = max(time_limit_s, 0.1)
    solver.config.load_solution = False
    solver.config.warmstart = warm is not None
    results = solver.solve(m)
    if results.best_feasible_objective is None:
        return None
    results.solution_loader.load_vars()
    starts = {op: pyo.value(m.start[i]) for op, i in index.items()}
    schedule = {
        w: [(op, starts[op]) for op in sorted(ops, key=lambda op: (starts[op], index[op]))]
        for w, ops in problem.ops_by_worker.items()
    }
    optimal = results.termination_condition == TerminationCondition.optimal
    bound = max(lower_bound, results.best_objective_bound or 0.0)
    return MilpSolution(schedule, results.best_feasible_objective, bound, optimal)


@dataclass(frozen=True)
class Template:
    """The optimal (or best found) schedule of one healthy pipeline with ``microbatches`` micro-batches."""

    position: dict[tuple[int, Phase, int], int]
    """(stage, phase, rank of the micro-batch in its pipeline) -> place in that stage's sequence."""
    lower_bound: float


def fault_free_template(problem: Problem, microbatches: int, time_limit_s: float) -> Template:
    """Schedule one pipeline with ``microbatches`` of its own micro-batches and nothing rerouted, alone."""
    plan = problem.plan
    stages = problem.stages
    single = grid_plan(list(range(stages)), stages, plan.num_layers, microbatches * plan.micro_batch, plan.micro_batch)
    alone = Problem.build(single, (), problem.costs, problem.memory_limit)
    schedule = alone.symmetric(heuristic.list_schedule(alone))
    makespan, bound = heuristic.makespan(alone, schedule), alone.lower_bound()
    if makespan > bound * (1 + _EXACT):
        solution = solve(alone, time_limit_s, makespan, bound, warm=schedule)
        if solution is not None:
            schedule, bound = solution.schedule, solution.lower_bound
    position = {
        (op.stage, op.phase, alone.rank[op.microbatch]): k for ops in schedule.values() for k, (op, _) in enumerate(ops)
    }
    return Template(position, bound)


def template_orders(problem: Problem, templates: Mapping[int, Template]) -> dict[tuple[Op, Op], bool]:
    """Every worker's own pipeline's operations in the order of the fault-free template (rerouted ones free)."""
    size = {home: sum(1 for h in problem.home.values() if h == home) for home in set(problem.home.values())}
    fixed: dict[tuple[Op, Op], bool] = {}
    for a, b in ordering_pairs(problem):
        if problem.rerouted(a) or problem.rerouted(b):
            continue
        template = templates[size[problem.home[a.microbatch]]]
        fixed[(a, b)] = template.position[(a.stage, a.phase, problem.rank[a.microbatch])] < template.position[
            (b.stage, b.phase, problem.rank[b.microbatch])
        ]
    return fixed


def improve(problem: Problem, warm: Schedule, warm_makespan: float, time_limit_s: float) -> MilpSolution:
    """The MILP's best schedule within ``time_limit_s``, never worse than ``warm``, with the best bound proven.

    1. Each healthy pipeline whose workers absorb no reroute, alone (``fault_free_template``, a small MILP), is a
       restriction of the problem, so its optimum bounds the makespan from below, much closer than
       ``Problem.lower_bound`` where pipeline bubbles dominate.
    2. The restricted model keeps every worker's own pipeline's operations in the template's order and decides
       only where the rerouted operations go: a few hundred binaries where the whole has a thousand, solved in
       seconds, and often within a percent of the bound.
    3. The whole model, warm-started from the better of the list schedule and step 2, with the time left.
    """
    deadline = time.monotonic() + time_limit_s
    bound = problem.lower_bound()
    best = MilpSolution(warm, warm_makespan, bound, warm_makespan <= bound * (1 + _EXACT))
    sizes: dict[tuple[int, ...], list[int]] = {}
    for mb, home in problem.home.items():
        sizes.setdefault(home, []).append(mb)
    templates = {m: fault_free_template(problem, m, 0.1 * time_limit_s) for m in {len(v) for v in sizes.values()}}
    for home, mbs in sizes.items():
        # A pipeline none of whose micro-batches is rerouted: the template (every backward one pass) is its
        # restriction, whatever rerouted work its workers absorb besides.
        if all(problem.routes[mb] == home for mb in mbs):
            bound = max(bound, templates[len(mbs)].lower_bound)
    best = _better(best, None, bound)
    steps = ((0.3, template_orders(problem, templates)), (1.0, None))
    for share, fixed in steps:
        if best.optimal:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        warm_start = None if fixed else best.schedule
        found = solve(problem, share * left, best.makespan, bound, warm=warm_start, fixed=fixed)
        whole = found is not None and fixed is None  # the restricted model's bound is not the whole's
        if whole:
            bound = max(bound, found.lower_bound)
        best = _better(best, found, bound, proven=whole and found.optimal)
    return best


def _better(best: MilpSolution, found: MilpSolution | None, bound: float, proven: bool = False) -> MilpSolution:
    """The shorter schedule, with the bound; optimal when it meets the bound or HiGHS proved it (to its gap)."""
    if found is not None and found.makespan < best.makespan:
        best = found
    optimal = proven or best.makespan <= bound * (1 + _EXACT)
    return MilpSolution(best.schedule, best.makespan, bound, optimal)
