"""How long one iteration of a plan takes: its programs executed instruction by instruction, costed by the one cost
model (``runtime.core.costs.CostModel.durations`` on ``runtime.core.program_check``'s abstract machine).

The simulator runs a plan's iteration once and reuses the result for every step of the plan, since the iterations
of one plan are identical (same programs, same costs). To make that one run cheap at a thousand workers, it is split
in two phases, which together give exactly what the abstract machine gives for the whole plan:

1. **Components.** Workers that exchange point-to-point messages (activations, gradients) form a component, usually
   one pipeline (several when a ReCycle peer serves another pipeline's micro-batches). Up to its ``ReduceGrads`` a
   component depends on no other, so it is executed alone, its ``ReduceGrads`` treated as arrival only. Each
   component is reduced to a canonical form (workers ordered by their layers, workers and micro-batches renumbered
   in order of appearance), and components of the same form (the pipelines of one Oobleck template with the same
   micro-batch count, every pipeline of a grid) are executed and checked once; the results are kept for later
   plans.
2. **Reduction.** Every program ends with ``ReduceGrads`` and ``OptimizerStep`` (the checker insists), so what
   remains is the collective: a worker leaves ``ReduceGrads`` when every worker sharing one of its layers has
   arrived, after the cost of its all-reduces; the iteration is ready for the commit when the last one has.
   A worker that keeps a redundant copy of another's layers (Bamboo: ``RecvReduced``) is ready only once the owner's
   reduced gradients, sent as the owner leaves its ``ReduceGrads``, have arrived (the runtime's worker receives
   them before it reports ready), and its optimizer step at the commit steps the copy's layers too.

Each distinct component is also held to the program checker's training semantics (``check_programs`` on the
component as a plan of its own), and the components' micro-batches must partition the global batch: together this
is the checker's verdict on the whole plan.

The default scheduler's programs (``scheduler.OneFOneB``) are a pure function of a pipeline's shape (its stages'
layers, its micro-batch count), up to renumbering, so a pipeline of a shape already executed is not even read:
the simulator builds and runs one pipeline of each shape. Other programs are read in full.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.costs import CostModel
from ftlab.runtime.core.plan import Pipeline, Plan, PlanError, Stage
from ftlab.runtime.core.program_check import ProgramError, check_programs, timeline
from ftlab.runtime.core.scheduler import OneFOneB
from ftlab.runtime.sim.shared_host import HostCores, Reduction, run_shared, shared_span

PHASES = ("forward", "backward", "reduce")


@dataclass(frozen=True)
class ComponentTiming:
    """One component executed alone, from the iteration's start; indexed by canonical worker."""

    reduce_at: tuple[float, ...]
    """When each worker reaches its ReduceGrads."""
    phase_at: tuple[dict[str, float], ...]
    """When each worker starts each phase (``instructions.phase_of``)."""
    compute_s: tuple[float, ...]
    """Each worker's forward and backward time."""


@dataclass(frozen=True)
class IterationTiming:
    ready_s: float
    """From the iteration's start until every worker has reduced its gradients (the commit point)."""
    optimizer_s: float
    """After the commit, until the last worker's optimizer step is done."""
    compute_s: float
    """The busiest worker's forward and backward time."""
    total_compute_s: float
    """Every worker's forward and backward time, added up."""
    reduce_end: dict[int, float]
    """When each worker leaves ReduceGrads."""
    _components: tuple[tuple[Sequence[int], ComponentTiming], ...]
    """Each component's workers in canonical order, and its timing."""
    copy_end: Mapping[int, float] = field(default_factory=dict)
    """When each worker's snapshot copy is done, for an iteration timed with copies beside it (a shared host's)."""

    def phase_at(self, worker: int, phase: str) -> float | None:
        """When ``worker`` starts ``phase`` (forward, backward, reduce), or None if its program has none."""
        timing, index = self._phases[worker]
        return timing.phase_at[index].get(phase)

    @cached_property
    def _phases(self) -> dict[int, tuple[ComponentTiming, int]]:
        """Each worker's component and index in it: built on the first question (a phase fault), not per plan."""
        return {worker: (timing, i) for order, timing in self._components for i, worker in enumerate(order)}


_Key = tuple[tuple[int, int, tuple[tuple, ...]], ...]


class IterationTimer:
    """Times plans' iterations from their programs; components of the same canonical form are run once.

    ``layer_overhead_s``: the runtime's own cost per layer of a forward or backward instruction, beyond the profiled
    layers'.
    ``cores``: every worker shares one host's cores (the local runtime's processes on this machine, each layer
    profiled alone on one core). The whole plan then runs as one, under processor sharing
    (``runtime.sim.shared_host``), its all-reduces included: a small plan, and its components are not independent, since
    they share the cores. The optimizer steps, every worker's at once with its other work of a step (``step_cpu_s``),
    share the cores as processes started together, each stepping its own layers (``shared_host.shared_span``).
    ``None``: each worker has a device of its own.

    ``layer_speed``: on a shared host, how fast each layer is computed against its charge
    (``SimConfig.host_layer_speed``; empty: 1): a worker's forward and backward instructions run at its layers'
    speed, each layer weighted by its charge.

    ``time(..., copies=...)``: the iteration with REFT snapshot copies beside it, each worker's in seconds on a core of
    its own. On a shared host they take cores from the computation (``runtime.sim.shared_host``); a device's copy engine
    leaves the computation alone, and the copies are the caller's to charge (``runtime.sim.backend``).
    """

    def __init__(
        self, costs: CostModel, check: bool = True, cores: HostCores | None = None, layer_overhead_s: float = 0.0,
        step_cpu_s: float = 0.0, message_cpu_s: float = 0.0, allreduce_cpu_bytes_per_s: float | None = None,
        layer_speed: Sequence[float] = (), message_cpu_own_core_s: float | None = None,
    ) -> None:  # fmt: skip
        self.costs = costs
        self.check = check
        self.cores = cores
        self.layer_overhead_s = layer_overhead_s
        """Added to every forward and backward instruction per layer it runs: the runtime's own cost beyond the
        layers'."""
        self.step_cpu_s = step_cpu_s
        """On a shared host, each worker's own work of a step besides its instructions, charged with its optimizer
        step."""
        self.message_cpu_s = message_cpu_s
        """On a shared host, what a message between stages costs its two workers' cores (``SimConfig``)."""
        self.message_cpu_own_core_s = message_cpu_own_core_s
        """The same where the plan's processes fit the host's cores (``SimConfig``); None: ``message_cpu_s``."""
        self.allreduce_cpu_bytes_per_s = allreduce_cpu_bytes_per_s
        """On a shared host, the CPU a gradient all-reduce costs each member (``SimConfig``); None: the link's time."""
        self.layer_speed = tuple(layer_speed)
        self._components: dict[_Key, ComponentTiming] = {}
        self._shapes: dict[tuple, ComponentTiming] = {}

    @property
    def components(self) -> int:
        """Distinct components executed so far."""
        return len(self._components)

    def time(
        self, plan: Plan, programs: Mapping[int, ins.Program], copies: Mapping[int, float] | None = None
    ) -> IterationTiming:
        if self.cores is not None:
            return self._time_shared(plan, programs, self.cores, copies or {})
        return self._time(plan, programs)

    def _time_shared(
        self, plan: Plan, programs: Mapping[int, ins.Program], cores: HostCores, copies: Mapping[int, float]
    ) -> IterationTiming:
        """Every worker of ``plan`` on one host of ``cores``, with ``copies`` beside them."""
        ranges = plan.layer_ranges()
        workers = sorted(ranges)
        missing = [w for w in workers if w not in programs]
        if missing:
            raise ProgramError(f"programs and plan disagree: no program for workers {missing}")
        own = {w: list(programs[w]) for w in workers}
        if self.check:
            check_programs(plan, own)
        durations = self.costs.durations(plan)

        overhead = {w: self.layer_overhead_s * (stop - start) for w, (start, stop) in ranges.items()}
        speed = {w: self._speed(start, stop) for w, (start, stop) in ranges.items()}

        def cost(worker: int, instruction: ins.Instruction) -> float:
            if isinstance(instruction, ins.COMPUTE):
                return (durations(worker, instruction) + overhead[worker]) / speed[worker]
            return durations(worker, instruction)

        peers: dict[int, set[int]] = defaultdict(set)
        for holders, _ in plan.reduction_groups():
            for worker in holders:
                peers[worker].update(holders)
        reduce_s = self.costs.reduce_s(plan, self._reduce_cpu_s if self.allreduce_cpu_bytes_per_s else None)
        reductions = {w: Reduction(frozenset(peers[w] - {w}), reduce_s.get(w, 0.0)) for w in workers}
        run = run_shared(own, cost, cores, reductions, copies, self._message_cpu_s(len(workers), copies, cores))
        whole = ComponentTiming(
            tuple(run.reduce_at[w] for w in workers),
            tuple(dict(run.phase_at.get(w, {})) for w in workers),
            tuple(run.compute_s.get(w, 0.0) for w in workers),
        )
        compute = max(whole.compute_s, default=0.0)
        optimizer = shared_span([self.step_cpu_s + self.costs.optimizer_s(*ranges[w]) for w in workers], cores)
        return IterationTiming(
            max(run.reduce_end.values()), optimizer, compute, sum(whole.compute_s), dict(run.reduce_end),
            ((workers, whole),), run.copy_end,
        )  # fmt: skip

    def _message_cpu_s(self, workers: int, copies: Mapping[int, float], cores: HostCores) -> float:
        """A message's CPU for a plan of ``workers`` with ``copies`` beside them on ``cores``: where every process has
        a core of its own, a waiting worker keeps its core and finds its working set there."""
        fits = workers + sum(seconds > 0 for seconds in copies.values()) <= cores.count
        return self.message_cpu_own_core_s if fits and self.message_cpu_own_core_s is not None else self.message_cpu_s

    def _speed(self, start: int, stop: int) -> float:
        """How fast a worker computes layers [start, stop) against their charge: its layers' speeds, each weighted
        by its charge (a forward and a backward pass, the runtime's own cost included)."""
        if not self.layer_speed or stop <= start:
            return 1.0
        charges = {i: compute_charge_s(self.costs, self.layer_overhead_s, i, i + 1) for i in range(start, stop)}
        taken = sum(charge / self.layer_speed[i] for i, charge in charges.items())
        return sum(charges.values()) / taken if taken > 0 else 1.0

    def _reduce_cpu_s(self, nbytes: float, members: int) -> float:
        """A replica set's all-reduce as the CPU it costs each member on a shared host: its buffer at
        ``allreduce_cpu_bytes_per_s``, whatever the members. Not the ring's 2(k - 1)/k of the buffer through each of k
        members, which is the link's traffic: on loopback each member's CPU for an all-reduce stays about the same
        from two members to six."""
        return nbytes / self.allreduce_cpu_bytes_per_s

    def _time(self, plan: Plan, programs: Mapping[int, ins.Program]) -> IterationTiming:
        ranges = plan.layer_ranges()
        scheduled = isinstance(programs, OneFOneB) and programs.plan == plan  # a program for each of its workers
        missing = [] if scheduled else sorted(set(ranges) - set(programs))
        if missing:
            raise ProgramError(f"programs and plan disagree: no program for workers {missing}")
        pipelines_from: dict[int, list[Pipeline]] = defaultdict(list)
        for pipeline in plan.pipelines:
            pipelines_from[pipeline.stages[0].worker].append(pipeline)
        covered: dict[int, int] = {}
        arrival: dict[int, float] = {}
        compute = total = 0.0
        components = []
        for order, shape in self._split(plan, programs):
            timing = self._shapes.get(shape) if shape is not None else None
            if timing is None:
                key, microbatches = _canonical(order, programs, ranges)
                timing = self._components.get(key)
                if timing is None:
                    pipelines = [p for w in order for p in pipelines_from.get(w, ())]
                    timing = self._run(key, order, pipelines, microbatches, plan)
                    self._components[key] = timing
                if shape is not None:
                    self._shapes[shape] = timing
                for mb in microbatches:
                    if mb in covered:
                        raise ProgramError(
                            f"micro-batch {mb} runs on workers {covered[mb]} and {order[0]}, which exchange nothing: "
                            "every micro-batch must run once, in one pipeline"
                        )
                    covered[mb] = order[0]
            arrival.update(zip(order, timing.reduce_at))
            components.append((order, timing))
            compute = max(compute, *timing.compute_s)
            for seconds in timing.compute_s:  # worker by worker, as ever: the same sum to the last bit
                total += seconds
        if self.check:
            # A pipeline of a known shape runs its own micro-batches (which were not read): those of the plan.
            ran = sorted(covered) if not isinstance(programs, OneFOneB) else sorted(
                mb for p in plan.pipelines for mb in p.microbatches
            )
            if ran != list(range(plan.num_microbatches)):
                raise ProgramError(
                    f"the programs run micro-batches {ran}, not each of 0..{plan.num_microbatches - 1} once"
                )
        timing = self._reduce(plan, arrival, compute, total, tuple(components))
        return timing if isinstance(programs, OneFOneB) else self._kept_copies(plan, programs, timing)

    def _kept_copies(self, plan: Plan, programs: Mapping[int, ins.Program], timing: IterationTiming) -> IterationTiming:
        """``timing`` with the redundant copies of ``programs`` kept current: each holder ready once its owner's
        ``SendReduced`` has arrived, and stepping its own layers and the copy's at the commit."""
        sends = [(w, i) for w, program in programs.items() for i in program if isinstance(i, ins.SendReduced)]
        if not sends:
            return timing
        duration = self.costs.durations(plan)
        ranges = plan.layer_ranges()
        reduce_end = dict(timing.reduce_end)
        optimizer = timing.optimizer_s
        for owner, send in sends:
            reduce_end[send.peer] = max(reduce_end[send.peer], timing.reduce_end[owner] + duration(owner, send))
            stepped = self.costs.optimizer_s(*ranges[send.peer]) + self.costs.optimizer_s(send.start, send.stop)
            optimizer = max(optimizer, stepped)
        return replace(timing, ready_s=max(reduce_end.values()), optimizer_s=optimizer, reduce_end=reduce_end)

    def _split(self, plan: Plan, programs: Mapping[int, ins.Program]) -> list[tuple[Sequence[int], tuple | None]]:
        """The plan's components, each with its workers in canonical order and, for the default scheduler's
        programs, its shape: the stages' layers and the micro-batch count, which determine the programs up to
        renumbering (``scheduler.stage_program``), so a pipeline of a known shape is not read at all."""
        if isinstance(programs, OneFOneB) and programs.disjoint and programs.plan == plan:
            return [(p.workers, (p.spans, len(p.microbatches))) for p in plan.pipelines]
        ranges = plan.layer_ranges()
        return [
            (sorted(members, key=lambda w: (*ranges.get(w, (-1, -1)), w)), None) for members in _components(programs)
        ]

    def _run(
        self, key: _Key, order: Sequence[int], pipelines: list[Pipeline], microbatches: list[int], plan: Plan
    ) -> ComponentTiming:
        """Execute (and check) one component in its canonical form."""
        programs = {index: [_instruction(entry) for entry in program] for index, (_, _, program) in enumerate(key)}
        local = _local_plan(order, pipelines, microbatches, plan)
        if self.check:
            check_programs(local, programs)
        durations = self.costs.durations(local)
        overhead = {w: self.layer_overhead_s * (stop - start) for w, (start, stop) in local.layer_ranges().items()}

        def until_reduce(worker: int, instruction: ins.Instruction) -> float:
            if isinstance(instruction, (ins.ReduceGrads, ins.OptimizerStep)):
                return 0.0
            if isinstance(instruction, ins.COMPUTE):
                return durations(worker, instruction) + overhead[worker]
            return durations(worker, instruction)

        reduce_at = [0.0] * len(order)
        phase_at: list[dict[str, float]] = [{} for _ in order]
        compute = [0.0] * len(order)
        for event in timeline(programs, until_reduce):
            phase = ins.phase_of(event.instruction)
            if phase:
                phase_at[event.worker].setdefault(phase, event.start)
            if isinstance(event.instruction, ins.ReduceGrads):
                reduce_at[event.worker] = event.start
            elif isinstance(event.instruction, ins.COMPUTE):
                compute[event.worker] += event.end - event.start
        return ComponentTiming(tuple(reduce_at), tuple(phase_at), tuple(compute))

    def _reduce(
        self, plan: Plan, arrival: dict[int, float], compute: float, total: float,
        components: tuple[tuple[Sequence[int], ComponentTiming], ...],
    ) -> IterationTiming:  # fmt: skip
        """Phase 2: a worker leaves ReduceGrads once every co-holder of its layers arrived, after its all-reduces."""
        # By range of layers (Plan.workers_by_range): its workers have the same co-holders and the same all-reduces.
        by_range = plan.workers_by_range()
        last_of_range = {held: max(0.0, *(arrival[worker] for worker in workers)) for held, workers in by_range.items()}
        latest = [0.0] * plan.num_layers
        for (start, stop), at in last_of_range.items():
            for layer in range(start, stop):
                latest[layer] = max(latest[layer], at)
        reduce_s = self.costs.range_reduce_s(plan)  # what durations(plan) gives ReduceGrads
        reduce_end: dict[int, float] = {}
        for held, workers in by_range.items():
            reduce_end.update(dict.fromkeys(workers, max(latest[held[0] : held[1]]) + reduce_s.get(held, 0.0)))
        optimizer = max(self.costs.optimizer_s(start, stop) for start, stop in last_of_range)
        return IterationTiming(max(reduce_end.values()), optimizer, compute, total, reduce_end, components)


def compute_charge_s(costs: CostModel, layer_overhead_s: float, start: int, stop: int) -> float:
    """What a shared host's simulation charges a micro-batch's forward and backward passes over layers
    [start, stop): the profile's time and the runtime's own cost per layer of each (``sim.layer_overhead_s``). A
    layer's speed (``SimConfig.host_layer_speed``) is measured against it and applied to it."""
    return costs.forward_s(start, stop) + costs.backward_s(start, stop) + 2 * layer_overhead_s * (stop - start)


def _components(programs: Mapping[int, ins.Program]) -> list[list[int]]:
    """Workers connected by point-to-point instructions, each group in ascending order."""
    parent = {w: w for w in programs}

    def find(w: int) -> int:
        while parent[w] != w:
            parent[w] = parent[parent[w]]
            w = parent[w]
        return w

    for worker, program in programs.items():
        peers = {i.peer for i in program if isinstance(i, (ins.PeerInstruction, ins.LayerInstruction, ins.ReducedInstruction))}
        for peer in peers:
            if peer not in parent:
                raise ProgramError(f"worker {worker} talks to worker {peer}, which has no program")
            a, b = find(worker), find(peer)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = defaultdict(list)
    for worker in sorted(programs):
        groups[find(worker)].append(worker)
    return list(groups.values())


def _canonical(
    order: Sequence[int], programs: Mapping[int, ins.Program], ranges: Mapping[int, tuple[int, int]]
) -> tuple[_Key, list[int]]:
    """The component with workers numbered by ``order`` and micro-batches by first appearance; and the
    micro-batches in that order."""
    worker_index = {w: i for i, w in enumerate(order)}
    mb_index: dict[int, int] = {}
    key = []
    for worker in order:
        entries = []
        for instruction in programs[worker]:
            fields = instruction.__dict__
            if isinstance(instruction, ins.ForwardRedundant):  # the copy's layers, as absolute as ``ranges``
                mb = mb_index.setdefault(instruction.microbatch, len(mb_index))
                entries.append((type(instruction), mb, instruction.start, instruction.stop))
            elif isinstance(instruction, ins.ReducedInstruction):
                entries.append((type(instruction), worker_index[instruction.peer], instruction.start, instruction.stop))
            elif "microbatch" in fields:
                mb = mb_index.setdefault(fields["microbatch"], len(mb_index))
                peer = fields.get("peer")
                entries.append((type(instruction), mb) if peer is None else (type(instruction), mb, worker_index[peer]))
            elif "layer" in fields:
                entries.append((type(instruction), fields["layer"], worker_index[fields["peer"]]))
            else:
                entries.append((type(instruction),))
        start, stop = ranges.get(worker, (-1, -1))
        key.append((start, stop, tuple(entries)))
    return tuple(key), list(mb_index)


def _instruction(entry: tuple) -> ins.Instruction:
    kind, *fields = entry
    return kind(*fields)


def _local_plan(order: Sequence[int], pipelines: list[Pipeline], microbatches: list[int], plan: Plan) -> Plan:
    """The component as a plan of its own: workers and micro-batches renumbered as in its canonical form."""
    worker_index = {w: i for i, w in enumerate(order)}
    mb_index = {mb: i for i, mb in enumerate(microbatches)}
    for p in pipelines:
        for mb in p.microbatches:
            mb_index.setdefault(mb, len(mb_index))
    try:
        local = tuple(
            Pipeline(
                tuple(Stage(worker_index[s.worker], s.start, s.stop) for s in p.stages),
                tuple(mb_index[mb] for mb in p.microbatches),
            )
            for p in pipelines
        )
    except KeyError as missing:
        raise ProgramError(
            f"worker {missing} is in a pipeline with workers {order} but exchanges nothing with them"
        ) from None
    return Plan(plan.generation, plan.num_layers, len(mb_index) * plan.micro_batch, plan.micro_batch, local)


__all__ = ["IterationTimer", "IterationTiming", "PHASES", "PlanError"]
