"""A fast list scheduler for the ReCycle problem: the planner's answer when it meets the lower bound or when the
MILP is too big, and the MILP's warm start otherwise.

Non-delay list scheduling: repeatedly start, over all workers, the operation that can start earliest; among
operations that can start at the same moment the priority is B_input, then F, then B_weight (an input gradient
unblocks the previous stage, a forward feeds the next one, a weight gradient unblocks nobody and fills whatever
bubble is left), then the micro-batch that has waited longest. A forward may start only while its worker holds
fewer than ``memory_limit`` micro-batches' activations.

This never deadlocks: a worker that is full holds micro-batches whose forward is done there, and by induction from
the last stage (whose B_input needs only its own F) each of them can progress. Operations are appended to their
worker's timeline, so executing the resulting order as early as possible reproduces the same times exactly.
"""

from __future__ import annotations

import heapq

from ftlab.policies.recycle.problem import Op, Phase, Problem

Schedule = dict[int, list[tuple[Op, float]]]
"""Per worker, its operations in execution order with their start times."""


def list_schedule(problem: Problem) -> Schedule:
    waiting = {op: len(problem.predecessors(op)) for op in problem.ops}
    successors: dict[Op, list[tuple[Op, float]]] = {op: [] for op in problem.ops}
    for op in problem.ops:
        for pred, lag in problem.predecessors(op):
            successors[pred].append((op, lag))
    earliest = dict.fromkeys(problem.ops, 0.0)  # max over finished predecessors of end + lag
    free_at = dict.fromkeys(problem.ops_by_worker, 0.0)
    holding = dict.fromkeys(problem.ops_by_worker, 0)
    schedule: Schedule = {w: [] for w in problem.ops_by_worker}
    # Every step starts the ready operation of least key over all workers, ties to the one ready first (``arrival``).
    # An operation's key changes only with its own worker's state, so each worker offers its best candidate on a
    # heap and offers anew when its state or its ready set changes; an offer made before that is stale (``version``).
    # Scanning one worker's few ready operations instead of every worker's keeps large grids (a 1,000-GPU plan has
    # thousands of operations ready at once) from going quadratic.
    ready: dict[int, list[tuple[int, Op]]] = {w: [] for w in problem.ops_by_worker}
    arrivals = 0
    version = dict.fromkeys(problem.ops_by_worker, 0)
    offers: list[tuple[tuple[float, Phase, float, int, int], int, int, int]] = []

    def make_ready(op: Op) -> int:
        nonlocal arrivals
        w = problem.worker(op)
        ready[w].append((arrivals, op))
        arrivals += 1
        return w

    def offer(w: int) -> None:
        version[w] += 1
        candidates = [
            ((max(free_at[w], earliest[op]), op.phase, earliest[op], op.microbatch, op.stage), arrival)
            for arrival, op in ready[w]
            if op.phase is not Phase.FORWARD or holding[w] < problem.memory_limit
        ]
        if candidates:
            key, arrival = min(candidates)
            heapq.heappush(offers, (key, arrival, version[w], w))

    for w in {make_ready(op) for op, count in waiting.items() if count == 0}:
        offer(w)
    while offers:
        _, arrival, offered, w = heapq.heappop(offers)
        if offered != version[w]:
            continue
        index = next(i for i, (a, _) in enumerate(ready[w]) if a == arrival)
        _, op = ready[w].pop(index)
        start = max(free_at[w], earliest[op])
        free_at[w] = start + problem.duration(op)
        holding[w] += {Phase.FORWARD: 1, Phase.BACKWARD_WEIGHT: -1}.get(op.phase, 0)
        schedule[w].append((op, start))
        changed = {w}
        for succ, lag in successors[op]:
            earliest[succ] = max(earliest[succ], free_at[w] + lag)
            waiting[succ] -= 1
            if not waiting[succ]:
                changed.add(make_ready(succ))
        for worker in changed:
            offer(worker)
    return schedule


def makespan(problem: Problem, schedule: Schedule) -> float:
    return max(start + problem.duration(op) for ops in schedule.values() for op, start in ops)
