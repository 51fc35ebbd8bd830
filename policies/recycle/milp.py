"""ReCycle's adaptive schedule as a MILP (slides, "Adaptive Schedule Generation"), built in Pyomo, solved by HiGHS.

Variables: a start time per operation (the slides use end times; start = end - duration), the makespan, and for
every two operations of different micro-batches on one worker a binary that orders them (the slides' ``O``).
Constraints: the cross-stage and same-stage dependencies with transfer times (``Problem.predecessors``, the
slides' (2)-(4)); no two operations of a worker overlap (disjunctive big-M pairs, (5)); the memory limit at the start
of every forward, counted through the ordering binaries ((6): forwards ordered before it add a micro-batch,
B_weights ordered before it release one). Objective: the makespan.

The assignment of rerouted micro-batches to peers is fixed beforehand (``problem.reroute``), so the slides'
products of assignment and time variables disappear and the model stays linear. What keeps it tractable:

- every start lies between its earliest start from the dependencies (head) and the horizon minus the longest
  chain after it (tail), widened by a rounding slack; the horizon is the list scheduler's makespan, which is also
  the warm start, so the MILP answer is never worse than the heuristic's;
- each big-M is the tightest the two start windows allow;
- micro-batches that follow the same workers are interchangeable, so their forwards on the first stage may be
  taken in id order without losing any schedule (the corresponding binaries are fixed);
- the makespan is at least ``Problem.lower_bound`` (a constant), and at least every operation's start plus its
  duration and tail (constraints that tighten the relaxation).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pyomo.environ as pyo
from pyomo.contrib.appsi.base import TerminationCondition
from pyomo.contrib.appsi.solvers.highs import Highs

from ftlab.policies.recycle.heuristic import Schedule
from ftlab.policies.recycle.problem import Op, Phase, Problem


@dataclass(frozen=True)
class MilpSolution:
    order: dict[int, list[Op]]
    """Each worker's operations in the order the solution runs them."""
    lower_bound: float
    optimal: bool


def ordering_pairs(problem: Problem) -> list[tuple[Op, Op]]:
    """Pairs of operations of different micro-batches on one worker: one binary each."""
    return [
        (a, b)
        for ops in problem.ops_by_worker.values()
        for a, b in itertools.combinations(ops, 2)
        if a.microbatch != b.microbatch
    ]


def build_model(problem: Problem, horizon: float) -> tuple[pyo.ConcreteModel, list[tuple[Op, Op]]]:
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
    m.makespan = pyo.Var(bounds=(problem.lower_bound() - slack, horizon + slack))
    m.before = pyo.Var(range(len(pairs)), domain=pyo.Binary)
    m.objective = pyo.Objective(expr=m.makespan, sense=pyo.minimize)
    m.rules = pyo.ConstraintList()

    def start(op: Op) -> pyo.Var:
        return m.start[index[op]]

    for op in ops:
        for pred, lag in problem.predecessors(op):
            m.rules.add(start(op) >= start(pred) + problem.duration(pred) + lag)
        # Not only the last operations: a late start anywhere delays the chain after it.
        m.rules.add(m.makespan >= start(op) + problem.duration(op) + tail[op])

    before: dict[tuple[Op, Op], object] = {}
    routes = problem.routes
    for k, (a, b) in enumerate(pairs):
        y = m.before[k]
        before[(a, b)], before[(b, a)] = y, 1 - y
        # The tightest big-M each direction allows, from the two start windows.
        m_ab = max(0.0, latest[a] + problem.duration(a) - earliest[b])
        m_ba = max(0.0, latest[b] + problem.duration(b) - earliest[a])
        m.rules.add(start(b) >= start(a) + problem.duration(a) - m_ab * (1 - y))
        m.rules.add(start(a) >= start(b) + problem.duration(b) - m_ba * y)
        if (a.phase, b.phase, a.stage) == (Phase.FORWARD, Phase.FORWARD, 0) and routes[a.microbatch] == routes[
            b.microbatch
        ]:
            y.fix(1 if a.microbatch < b.microbatch else 0)

    for ops_of_worker in problem.ops_by_worker.values():
        if len({op.microbatch for op in ops_of_worker}) <= problem.memory_limit:
            continue  # the worker never holds more micro-batches than the limit
        for b in ops_of_worker:
            if b.phase is not Phase.FORWARD:
                continue
            held = 1 + sum(
                before[(a, b)] if a.phase is Phase.FORWARD else -before[(a, b)]
                for a in ops_of_worker
                if a.microbatch != b.microbatch and a.phase is not Phase.BACKWARD_INPUT
            )
            m.rules.add(held <= problem.memory_limit)
    return m, pairs


def solve(problem: Problem, warm: Schedule, warm_makespan: float, time_limit_s: float) -> MilpSolution | None:
    """Solve within ``time_limit_s``; None when HiGHS found no schedule at all in that time."""
    m, pairs = build_model(problem, warm_makespan)
    index = {op: i for i, op in enumerate(problem.ops)}
    position = {op: (w, k) for w, ops in warm.items() for k, (op, _) in enumerate(ops)}
    for ops in warm.values():
        for op, t in ops:
            m.start[index[op]].set_value(t)
    for k, (a, b) in enumerate(pairs):
        if not m.before[k].fixed:
            m.before[k].set_value(int(position[a] < position[b]))
    m.makespan.set_value(warm_makespan)

    solver = Highs()
    solver.config.time_limit = time_limit_s
    solver.config.load_solution = False
    solver.config.warmstart = True
    results = solver.solve(m)
    if results.best_feasible_objective is None:
        return None
    results.solution_loader.load_vars()
    starts = {op: pyo.value(m.start[i]) for op, i in index.items()}
    order = {
        w: sorted(ops, key=lambda op: (starts[op], index[op])) for w, ops in problem.ops_by_worker.items()
    }
    optimal = results.termination_condition == TerminationCondition.optimal
    return MilpSolution(order, results.best_objective_bound or 0.0, optimal)
