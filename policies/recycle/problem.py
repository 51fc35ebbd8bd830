"""The scheduling problem ReCycle solves after failures, and the programs a solution becomes.

Rerouting. Each micro-batch keeps its pipeline's surviving workers; at a stage whose worker failed it goes to a
surviving data-parallel peer of that stage (a worker of the same stage in another pipeline). A failed worker's
micro-batches are dealt one by one to the peer with the fewest rerouted micro-batches so far, so peers share the
extra work evenly. The slides' MILP also chooses that assignment (its variables ``s``); we fix it here so that
the MILP only orders and times the work, which keeps it linear and small.

Representation in a Plan. Micro-batches that follow the same workers form one Pipeline, whose stage list names the
peer at a failed stage. A peer therefore appears in several pipelines, always with the same layers; the failed
workers appear nowhere.

Operations. Each (micro-batch, stage) has a forward F, an input-gradient backward B_input and a weight-gradient
backward B_weight on the micro-batch's worker of that stage. Dependencies, as in the slides: F of stage s+1 after F
of stage s plus the transfer time; B_input of stage s after B_input of stage s+1 plus the transfer time, and after
F of the same stage (the last stage's B_input directly after its F); B_weight after B_input. Memory: a worker
holds a micro-batch's activations from the start of its F to the end of its B_weight, and at most
``memory_limit`` micro-batches at once (the slides' constraint (6) with F adding one unit, B_weight releasing it
and B_input keeping it).

Programs. A per-worker order of operations becomes instructions with every receive placed just before the
compute that needs it and every send just after the compute that produced it; sends never block, so the programs
are deadlock-free whenever the order is consistent with some feasible timing (both planners guarantee this). A
B_weight that directly follows its B_input on the first stage is fused into one ``BackwardPass``: there it costs
no time, while on later stages decoupling lets the gradient leave before the weight gradient is computed.

Decoupling only where a reroute needs it (the paper's slides: "avoid decoupling Backward unless necessary"): only
a rerouted micro-batch's backward is split, so the peer that absorbs it can send its input gradient back to the
other pipeline at once and fill a bubble with the deferred weight gradient. Every other backward stays one pass, as
in DeepSpeed's 1F1B, the peers' own micro-batches included: decoupling those too would let a plan on fewer workers
beat the fault-free 1F1B it is compared with. In the model a one-pass backward's B_input takes the whole backward
and its B_weight nothing; its program has one ``BackwardPass`` where the B_input is.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property
from typing import NamedTuple

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.plan import Pipeline, Plan, Stage
from ftlab.runtime.core.costs import CostModel, Durations


class ReCycleError(ValueError):
    """The failures cannot be handled by rerouting; the message says why and what to do instead."""


class Phase(IntEnum):
    """An operation's kind; the value is the list scheduler's priority (lower first)."""

    BACKWARD_INPUT = 0
    FORWARD = 1
    BACKWARD_WEIGHT = 2


class Op(NamedTuple):
    """One micro-batch's work of one phase at one stage. A named tuple: the planners hash and compare operations
    millions of times on a large grid, which tuples do in C."""

    microbatch: int
    stage: int
    phase: Phase


@dataclass(frozen=True)
class StageCosts:
    """Durations of one stage's work for one micro-batch (any time unit, the same for every stage)."""

    forward: float
    backward_input: float
    backward_weight: float
    p2p: float = 0.0
    """Time to move this stage's output activation to the next stage (and the gradient at that boundary back)."""

    @staticmethod
    def of_grid(costs: CostModel, grid: Plan) -> tuple[StageCosts, ...]:
        """Each stage's durations in seconds, from the one cost model (``runtime.core.costs``)."""
        return tuple(
            StageCosts(
                forward=costs.forward_s(start, stop),
                backward_input=costs.backward_input_s(start, stop),
                backward_weight=costs.backward_weight_s(start, stop),
                p2p=costs.p2p_s(costs.boundary_bytes(stop)) if stop < grid.num_layers else 0.0,
            )
            for start, stop in grid_shape(grid)
        )

    def of(self, phase: Phase) -> float:
        return {Phase.FORWARD: self.forward, Phase.BACKWARD_INPUT: self.backward_input,
                Phase.BACKWARD_WEIGHT: self.backward_weight}[phase]


def grid_shape(grid: Plan) -> list[tuple[int, int]]:
    """The stage layer bounds shared by every pipeline; ReCycle needs a homogeneous PP x DP grid."""
    bounds = [(s.start, s.stop) for s in grid.pipelines[0].stages]
    for p in grid.pipelines:
        if [(s.start, s.stop) for s in p.stages] != bounds:
            raise ReCycleError(
                f"ReCycle reroutes between data-parallel peers of one stage, so every pipeline must split the "
                f"layers the same way; pipeline {p.workers} does not match {bounds}"
            )
    return bounds


def reroute(grid: Plan, failed: Collection[int]) -> tuple[Plan, dict[int, tuple[int, ...]]]:
    """The plan after rerouting, and each micro-batch's worker per stage."""
    bounds = grid_shape(grid)
    dead = set(failed)
    unknown = dead - set(grid.workers)
    if unknown:
        raise ReCycleError(f"failed workers {sorted(unknown)} are not in the plan (workers {grid.workers})")
    peers = [[p.stages[s].worker for p in grid.pipelines if p.stages[s].worker not in dead] for s in range(len(bounds))]
    for s, alive in enumerate(peers):
        if not alive:
            raise ReCycleError(
                f"every worker of stage {s} (layers {bounds[s][0]}..{bounds[s][1] - 1}) failed, so no data-parallel "
                f"peer is left to reroute to; restart from a checkpoint (or an in-memory snapshot)"
            )
    extra = {w: 0 for stage_peers in peers for w in stage_peers}
    routes: dict[int, tuple[int, ...]] = {}
    for pipeline in grid.pipelines:
        for mb in pipeline.microbatches:
            route = []
            for s, stage in enumerate(pipeline.stages):
                worker = stage.worker
                if worker in dead:
                    worker = min(peers[s], key=lambda w: extra[w])  # first of the least loaded, in grid order
                    extra[worker] += 1
                route.append(worker)
            routes[mb] = tuple(route)
    by_route: dict[tuple[int, ...], list[int]] = {}
    for mb in sorted(routes):
        by_route.setdefault(routes[mb], []).append(mb)
    pipelines = tuple(
        Pipeline(tuple(Stage(w, *bounds[s]) for s, w in enumerate(route)), tuple(mbs))
        for route, mbs in by_route.items()
    )
    plan = Plan(
        grid.generation + 1, grid.num_layers, grid.global_batch, grid.micro_batch, pipelines, step=grid.step,
        notes={"policy": "recycle", "failed": ",".join(map(str, sorted(dead)))},
    )
    return plan, routes


@dataclass
class Problem:
    """Operations, their workers, durations and dependencies for one iteration after rerouting."""

    plan: Plan
    routes: dict[int, tuple[int, ...]]
    costs: tuple[StageCosts, ...]
    memory_limit: int
    home: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Each micro-batch's workers in the healthy grid (failed ones included); its route where none failed."""
    _preds: dict[Op, list[tuple[Op, float]]] = field(default_factory=dict, init=False, repr=False)

    @staticmethod
    def build(
        grid: Plan, failed: Collection[int], costs: StageCosts | Sequence[StageCosts], memory_limit: int | None = None
    ) -> Problem:
        """``memory_limit`` (micro-batches whose activations a worker may hold) defaults to twice the number of
        stages: the 1F1B peak of a healthy first stage, plus room for one rerouted stream."""
        plan, routes = reroute(grid, failed)
        stages = len(grid.pipelines[0].stages)
        per_stage = tuple(costs) if isinstance(costs, Sequence) else (costs,) * stages
        if len(per_stage) != stages:
            raise ReCycleError(f"costs are given for {len(per_stage)} stages, the plan has {stages}")
        if any(c.forward <= 0 or c.backward_input <= 0 or c.backward_weight <= 0 or c.p2p < 0 for c in per_stage):
            raise ReCycleError(f"compute durations must be positive and transfer times non-negative: {per_stage}")
        limit = 2 * stages if memory_limit is None else memory_limit
        if limit < 1:
            raise ReCycleError(f"memory_limit {limit}: a worker must hold at least one micro-batch")
        home = {mb: p.workers for p in grid.pipelines for mb in p.microbatches}
        return Problem(plan, routes, per_stage, limit, home)

    def restrict(self, microbatches: Collection[int]) -> Problem:
        """The same problem with only these micro-batches: every schedule of the whole restricts to one of this,
        so its optimum is a lower bound of the whole's."""
        keep = set(microbatches)
        return Problem(self.plan, {mb: r for mb, r in self.routes.items() if mb in keep}, self.costs,
                       self.memory_limit, {mb: r for mb, r in self.home.items() if mb in keep})  # fmt: skip

    def rerouted(self, op: Op) -> bool:
        """True when ``op`` runs on a peer instead of the worker of its own pipeline."""
        return self.routes[op.microbatch][op.stage] != self.home[op.microbatch][op.stage]

    @cached_property
    def rank(self) -> dict[int, int]:
        """Each micro-batch's position among its healthy pipeline's micro-batches."""
        pipelines: dict[tuple[int, ...], list[int]] = {}
        for mb in sorted(self.home):
            pipelines.setdefault(self.home[mb], []).append(mb)
        return {mb: k for mbs in pipelines.values() for k, mb in enumerate(mbs)}

    @property
    def stages(self) -> int:
        return len(self.costs)

    @cached_property
    def ops(self) -> list[Op]:
        """Every operation, in an order where each comes after its dependencies."""
        forward = [Op(mb, s, Phase.FORWARD) for mb in sorted(self.routes) for s in range(self.stages)]
        backward = [
            Op(mb, s, phase)
            for mb in sorted(self.routes)
            for s in reversed(range(self.stages))
            for phase in (Phase.BACKWARD_INPUT, Phase.BACKWARD_WEIGHT)
        ]
        return forward + backward

    def worker(self, op: Op) -> int:
        return self.routes[op.microbatch][op.stage]

    def duration(self, op: Op) -> float:
        if op.phase is not Phase.FORWARD and not self.rerouted(op):
            c = self.costs[op.stage]
            return c.backward_input + c.backward_weight if op.phase is Phase.BACKWARD_INPUT else 0.0
        return self.costs[op.stage].of(op.phase)

    def predecessors(self, op: Op) -> list[tuple[Op, float]]:
        """(operation, lag): ``op`` starts no earlier than the predecessor's end plus the lag (a transfer time)."""
        if op not in self._preds:
            mb, s = op.microbatch, op.stage
            if op.phase is Phase.FORWARD:
                preds = [(Op(mb, s - 1, Phase.FORWARD), self.costs[s - 1].p2p)] if s > 0 else []
            elif op.phase is Phase.BACKWARD_INPUT:
                preds = [(Op(mb, s, Phase.FORWARD), 0.0)]
                if s < self.stages - 1:
                    preds.append((Op(mb, s + 1, Phase.BACKWARD_INPUT), self.costs[s].p2p))
            else:
                preds = [(Op(mb, s, Phase.BACKWARD_INPUT), 0.0)]
            self._preds[op] = preds
        return self._preds[op]

    @cached_property
    def ops_by_worker(self) -> dict[int, list[Op]]:
        by: dict[int, list[Op]] = {w: [] for w in self.plan.workers}
        for op in self.ops:
            by[self.worker(op)].append(op)
        return by

    # -- symmetry, bounds ----------------------------------------------------------------------------------------

    @cached_property
    def interchangeable(self) -> list[tuple[int, ...]]:
        """Micro-batches that follow the same workers, sorted: any schedule stays feasible with their labels
        exchanged."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for mb in sorted(self.routes):
            groups.setdefault(self.routes[mb], []).append(mb)
        return [tuple(g) for g in groups.values() if len(g) > 1]

    def symmetry_predecessors(self, op: Op) -> list[Op]:
        """The same operation of the previous interchangeable micro-batch, which some optimal schedule runs first.

        Why that loses no schedule: in any schedule, sort the start times of one operation kind (stage, phase) of an
        interchangeable group and hand them to the group's micro-batches in id order, for every kind. Each
        dependency has the form "the k-th smallest start of this kind is at least the k-th smallest end of that
        kind plus a lag", which sorting preserves; the memory a worker holds only counts operations, whatever their
        labels. So the relabelled schedule is feasible with the same makespan, and runs every kind in id order.
        """
        return self._symmetry.get(op, [])

    @cached_property
    def _symmetry(self) -> dict[Op, list[Op]]:
        edges: dict[Op, list[Op]] = {}
        for group in self.interchangeable:
            for a, b in zip(group, group[1:]):
                for s in range(self.stages):
                    for phase in Phase:
                        edges[Op(b, s, phase)] = [Op(a, s, phase)]
        return edges

    def precedences(self, op: Op) -> list[tuple[Op, float]]:
        """Dependencies and symmetry orders together: what every schedule the MILP considers respects."""
        return self.predecessors(op) + [(p, 0.0) for p in self.symmetry_predecessors(op)]

    def symmetric(self, order: Mapping[int, Sequence[tuple[Op, float]]]) -> dict[int, list[tuple[Op, float]]]:
        """A schedule (per worker: operations with start times) relabelled so that every interchangeable group runs
        each operation kind in id order (see ``symmetry_predecessors``); same times, so same makespan."""
        group_of = {mb: group for group in self.interchangeable for mb in group}
        slots: dict[tuple[tuple[int, ...], int, Phase], list[tuple[float, Op]]] = {}
        for ops in order.values():
            for op, start in ops:
                if op.microbatch in group_of:
                    slots.setdefault((group_of[op.microbatch], op.stage, op.phase), []).append((start, op))
        relabel: dict[Op, Op] = {}
        for (group, stage, phase), taken in slots.items():
            for mb, (_, op) in zip(group, sorted(taken)):
                relabel[op] = Op(mb, stage, phase)
        return {w: sorted(((relabel.get(op, op), t) for op, t in ops), key=lambda x: (x[1], x[0]))
                for w, ops in order.items()}  # fmt: skip

    @cached_property
    def _ancestors(self) -> dict[Op, int]:
        """Per operation, the bit set (over ``ops`` indices) of every operation it transitively follows."""
        reach: dict[Op, int] = {}
        for op in self.ops:  # ``ops`` is in an order where each comes after all of its precedences
            bits = 0
            for p, _ in self.precedences(op):
                bits |= reach[p] | (1 << self._index[p])
            reach[op] = bits
        return reach

    def precedes(self, a: Op, b: Op) -> bool:
        """True when a chain of precedences runs from ``a`` to ``b``: ``b`` starts after ``a`` ends."""
        return bool(self._ancestors[b] >> self._index[a] & 1)

    def ordered(self, a: Op, b: Op) -> bool:
        """True when the precedences decide the order of ``a`` and ``b`` (no binary needed)."""
        return self.precedes(a, b) or self.precedes(b, a)

    @cached_property
    def _index(self) -> dict[Op, int]:
        return {op: i for i, op in enumerate(self.ops)}

    @cached_property
    def _same_worker_ancestors(self) -> dict[Op, list[Op]]:
        """Per operation, the operations of its own worker that precede it."""
        return {
            op: [a for a in self.ops_by_worker[self.worker(op)] if self._ancestors[op] >> self._index[a] & 1]
            for op in self.ops
        }

    def unordered_pairs(self) -> int:
        """Pairs of operations on one worker that no precedence chain orders: the MILP's ordering binaries
        (``milp.ordering_pairs``), counted without listing them."""
        pairs = sum(len(ops) * (len(ops) - 1) // 2 for ops in self.ops_by_worker.values())
        return pairs - sum(len(before) for before in self._same_worker_ancestors.values())

    @cached_property
    def _heads_and_tails(self) -> tuple[dict[Op, float], dict[Op, float]]:
        same_worker = self._same_worker_ancestors
        head: dict[Op, float] = {}
        for op in self.ops:
            h = max((head[p] + self.duration(p) + lag for p, lag in self.precedences(op)), default=0.0)
            # Every ancestor on the same worker runs before ``op`` there: for each release threshold r, the ones
            # released at r or later take their whole durations after r.
            done = 0.0
            for a in sorted(same_worker[op], key=lambda x: -head[x]):
                done += self.duration(a)
                h = max(h, head[a] + done)
            head[op] = h
        after_on_worker: dict[Op, list[Op]] = {op: [] for op in self.ops}
        for op, before in same_worker.items():
            for a in before:
                after_on_worker[a].append(op)
        tail: dict[Op, float] = {}
        successors: dict[Op, list[tuple[Op, float]]] = {op: [] for op in self.ops}
        for op in self.ops:
            for p, lag in self.precedences(op):
                successors[p].append((op, lag))
        for op in reversed(self.ops):
            q = max((lag + self.duration(s) + tail[s] for s, lag in successors[op]), default=0.0)
            after = 0.0
            for d in sorted(after_on_worker[op], key=lambda x: -tail[x]):
                after += self.duration(d)
                q = max(q, after + tail[d])
            tail[op] = q
        return head, tail

    def heads_and_tails(self) -> tuple[dict[Op, float], dict[Op, float]]:
        """Each operation's earliest start (head) and the least time that must follow its end (tail), in every
        schedule that respects the precedences (dependencies and symmetry orders): the longest chains, raised by
        the work the operation's ancestors (descendants) put on its own worker before (after) it."""
        return self._heads_and_tails

    def lower_bound(self) -> float:
        """A makespan no schedule can beat: the critical path, and for every worker the optimum of its operations
        alone with their heads and tails, preemption allowed (Jackson's preemptive schedule, which is exact for
        that relaxation and at least every "release + work + shortest tail" bound)."""
        head, tail = self.heads_and_tails()
        bound = max(head[op] + self.duration(op) + tail[op] for op in self.ops)
        for ops in self.ops_by_worker.values():
            bound = max(bound, jackson_preemptive(
                [(head[op], self.duration(op), tail[op]) for op in ops]
            ))  # fmt: skip
        return bound

    # -- programs ----------------------------------------------------------------------------------------------

    def programs(self, order: Mapping[int, Sequence[Op]]) -> dict[int, ins.Program]:
        """Instructions for each worker from its operations in execution order."""
        last = self.stages - 1
        programs: dict[int, ins.Program] = {}
        for w, ops in order.items():
            program: ins.Program = []
            fused: set[Op] = set()
            for i, op in enumerate(ops):
                mb, s, route = op.microbatch, op.stage, self.routes[op.microbatch]
                if op in fused:
                    continue
                if op.phase is Phase.FORWARD:
                    if s == 0 or s == last:
                        program.append(ins.LoadMicroBatch(mb))
                    if s > 0:
                        program.append(ins.RecvActivation(mb, route[s - 1]))
                    program.append(ins.ForwardPass(mb))
                    if s < last:
                        program.append(ins.SendActivation(mb, route[s + 1]))
                elif op.phase is Phase.BACKWARD_INPUT:
                    if s < last:
                        program.append(ins.RecvGrad(mb, route[s + 1]))
                    weight = Op(mb, s, Phase.BACKWARD_WEIGHT)
                    if not self.rerouted(op) or (s == 0 and i + 1 < len(ops) and ops[i + 1] == weight):
                        program.append(ins.BackwardPass(mb))
                        fused.add(weight)
                    else:
                        program.append(ins.BackwardInput(mb))
                    if s > 0:
                        program.append(ins.SendGrad(mb, route[s - 1]))
                else:
                    program.append(ins.BackwardWeight(mb))
            programs[w] = [*program, ins.ReduceGrads(), ins.OptimizerStep()]
        return programs

    def durations(self) -> Durations:
        """Instruction durations for ``runtime.core.program_check.simulate``, consistent with the operation model."""
        stage_of = {w: s for route in self.routes.values() for s, w in enumerate(route)}

        def duration(worker: int, instr: ins.Instruction) -> float:
            c = self.costs[stage_of[worker]]
            if isinstance(instr, ins.ForwardPass):
                return c.forward
            if isinstance(instr, ins.BackwardInput):
                return c.backward_input
            if isinstance(instr, ins.BackwardWeight):
                return c.backward_weight
            if isinstance(instr, ins.BackwardPass):
                return c.backward_input + c.backward_weight
            if isinstance(instr, ins.SendActivation):
                return c.p2p
            if isinstance(instr, ins.SendGrad):
                return self.costs[stage_of[worker] - 1].p2p
            return 0.0

        return duration


def jackson_preemptive(jobs: Sequence[tuple[float, float, float]]) -> float:
    """The optimal makespan of (release, duration, tail) jobs on one machine with preemption: always run the
    released job with the longest tail (Jackson's rule), a lower bound for the same jobs without preemption."""
    pending = sorted(jobs)
    ready: list[tuple[float, float, float]] = []  # (-tail, remaining, tail)
    time, best, k = 0.0, 0.0, 0
    while k < len(pending) or ready:
        if not ready:
            time = max(time, pending[k][0])
        while k < len(pending) and pending[k][0] <= time:
            _, duration, q = pending[k]
            heapq.heappush(ready, (-q, duration, q))
            k += 1
        negq, remaining, q = heapq.heappop(ready)
        until = pending[k][0] if k < len(pending) else math.inf
        run = min(remaining, until - time)
        time += run
        if run < remaining:
            heapq.heappush(ready, (negq, remaining - run, q))
        else:
            best = max(best, time + q)
    return best
