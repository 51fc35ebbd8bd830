"""Abstract execution of a set of instruction programs: correctness check and timeline.

Every producer of programs (the 1F1B scheduler, ReCycle's planner) is checked by executing its programs on an
abstract machine with the semantics of ``runtime.core.instructions``:

- sends never block; a receive blocks until the matching send (same kind, micro-batch, sender) has happened;
- ``ReduceGrads`` is a collective: a worker leaves it once every worker sharing one of its layers has reached its
  own ``ReduceGrads`` (one group per stage in a grid, which is what lets stages step their optimizers at staggered
  times);
- compute needs its inputs on the same worker: a non-first stage's ``ForwardPass`` a received activation, a
  non-last stage's backward a received gradient, first and last stages a ``LoadMicroBatch``, ``BackwardWeight``
  a ``BackwardInput``.
- Bamboo's redundant work: a ``ForwardRedundant`` follows the worker's own forward of that micro-batch and runs the
  layers right after its own; a stage's reduced gradients are sent after the sender's ``ReduceGrads`` and received
  after the receiver's, between ``ReduceGrads`` and ``OptimizerStep``.

Messages carry the layer boundary they belong to, so the checker follows each micro-batch through the layers: it
must run forward over every layer exactly once, in layer order, then backward exactly once in reverse order, on
the workers of the pipeline the plan assigns it to. A worker's layers come from the plan; a worker may appear in
several pipelines (a ReCycle peer serving a rerouted micro-batch) as long as it holds the same layers in all.

The same machine, given durations, yields a timeline; the simulator and the planners' makespan predictions use it.
Timing rules: compute, loads and collectives occupy their worker for their duration; a send occupies no worker
time and its message arrives ``durations(sender, send)`` later (the transfer time); a receive ends when its
message has arrived, plus its own duration (normally zero).
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.costs import Durations
from ftlab.runtime.core.plan import Plan, PlanError


class ProgramError(ValueError):
    """Programs that would deadlock or train wrongly; the message names the workers and instructions at fault."""


@dataclass(frozen=True)
class Event:
    """One executed instruction: ``index`` is its position in the worker's program."""

    worker: int
    index: int
    instruction: ins.Instruction
    start: float
    end: float


def show(instr: ins.Instruction) -> str:
    return str(instr)


_SENDS: dict[type, str] = {ins.SendActivation: "activation", ins.SendGrad: "gradient", ins.SendLayer: "layer",
                           ins.SendReduced: "reduced gradient"}  # fmt: skip
_RECVS: dict[type, str] = {ins.RecvActivation: "activation", ins.RecvGrad: "gradient", ins.RecvLayer: "layer",
                           ins.RecvReduced: "reduced gradient"}  # fmt: skip


def _peer(instr: ins.Instruction) -> int:
    assert isinstance(instr, (ins.PeerInstruction, ins.LayerInstruction, ins.ReducedInstruction)), instr
    return instr.peer


def _key(instr: ins.Instruction) -> int:
    """The micro-batch of a micro-batch transfer, the layer of a layer transfer, the first layer of reduced
    gradients."""
    if isinstance(instr, ins.ReducedInstruction):
        return instr.start
    return instr.microbatch if isinstance(instr, ins.MicroBatchInstruction) else instr.layer  # type: ignore[attr-defined]


Channel = tuple[str, int, int, int]
"""(kind, sender, receiver, micro-batch or layer): where a message travels, matched FIFO."""


def channel_of(worker: int, instr: ins.Instruction) -> tuple[Channel, bool] | None:
    """The channel ``instr`` on ``worker`` sends to (True) or receives from (False); None if it is no transfer."""
    kind = type(instr)
    if kind in _SENDS:
        return (_SENDS[kind], worker, _peer(instr), _key(instr)), True
    if kind in _RECVS:
        return (_RECVS[kind], _peer(instr), worker, _key(instr)), False
    return None


def worker_layers(plan: Plan) -> dict[int, tuple[int, int]]:
    """Each worker's layer range ``(start, stop)``; a worker named in several pipelines must hold the same layers."""
    try:
        return plan.layer_ranges()
    except PlanError as exc:
        raise ProgramError(str(exc)) from exc


def _co_holders(ranges: Mapping[int, tuple[int, int]]) -> dict[int, tuple[int, ...]]:
    """For each worker, the workers (itself included) it all-reduces a layer with."""
    holders: dict[int, list[int]] = defaultdict(list)
    for w, (start, stop) in ranges.items():
        for layer in range(start, stop):
            holders[layer].append(w)
    return {
        w: tuple(sorted({v for layer in range(start, stop) for v in holders[layer]}))
        for w, (start, stop) in ranges.items()
    }


class _Machine:
    """Runs programs to completion or deadlock; with a plan it also checks the training semantics."""

    def __init__(self, programs: Mapping[int, list[ins.Instruction]], durations: Durations, plan: Plan | None):
        self.programs = programs
        self.durations = durations
        self.plan = plan
        self.pc = dict.fromkeys(programs, 0)
        self.clock = dict.fromkeys(programs, 0.0)
        # (kind, sender, receiver, micro-batch or layer) -> messages in flight: (arrival time, layer boundary)
        self.channels: dict[Channel, deque[tuple[float, int]]] = defaultdict(deque)
        self.sent: set[Channel] = set()
        self.reduce_arrival: dict[int, float] = {}
        self.events: list[Event] = []
        if plan is not None:
            self.num_layers = plan.num_layers
            self.ranges = worker_layers(plan)
            self.groups = _co_holders(self.ranges)
            self.route = {mb: p for p in plan.pipelines for mb in p.microbatches}
            # Per worker: what it holds for each micro-batch, in the order the instructions need it.
            self.loaded: dict[int, set[int]] = defaultdict(set)
            self.act_in: dict[int, set[int]] = defaultdict(set)
            self.grad_in: dict[int, set[int]] = defaultdict(set)
            self.forwarded: dict[int, set[int]] = defaultdict(set)
            self.input_grad: dict[int, set[int]] = defaultdict(set)
            self.weight_grad: dict[int, set[int]] = defaultdict(set)
            # Per (micro-batch, layer): the workers that ran it forward / input-backward / weight-backward.
            self.fwd_by: dict[tuple[int, int], list[int]] = defaultdict(list)
            self.bwd_by: dict[tuple[int, int], list[int]] = defaultdict(list)
            self.wgt_by: dict[tuple[int, int], list[int]] = defaultdict(list)

    # -- execution ---------------------------------------------------------------------------------------------

    def run(self) -> None:
        """Run every worker as far as it goes; a worker that blocks waits until the send or the ReduceGrads
        arrival it needs wakes it. Each instruction is tried a bounded number of times, so programs of a
        thousand workers run in time proportional to their length."""
        self.ready = deque(self.programs)
        self.queued = set(self.programs)
        while self.ready:
            w = self.ready.popleft()
            self.queued.discard(w)
            program = self.programs[w]
            while self.pc[w] < len(program) and self._step(w, program[self.pc[w]]):
                self.pc[w] += 1
        blocked = {w: p[self.pc[w]] for w, p in self.programs.items() if self.pc[w] < len(p)}
        if blocked:
            raise ProgramError("deadlock: no worker can progress; " + "; ".join(
                f"worker {w} blocks at instruction {self.pc[w]} {show(i)} ({self._why_blocked(w, i)})"
                for w, i in sorted(blocked.items())
            ))

    def _wake(self, w: int) -> None:
        if w not in self.queued:
            self.queued.add(w)
            self.ready.append(w)

    def _why_blocked(self, w: int, instr: ins.Instruction) -> str:
        if isinstance(instr, ins.ReduceGrads):
            missing = [v for v in self.groups[w] if v not in self.reduce_arrival]
            return f"waits for workers {missing} to reach ReduceGrads"
        return f"waits for the matching send from worker {_peer(instr)}"

    def _step(self, w: int, instr: ins.Instruction) -> bool:
        """Execute ``instr`` on ``w`` if it can run now; False when it blocks."""
        start = self.clock[w]
        cost = self.durations(w, instr)
        transfer = channel_of(w, instr)
        if transfer is not None and not transfer[1]:
            queue = self.channels[transfer[0]]
            if not queue:
                return False  # the matching send wakes this worker
            arrival, boundary = queue.popleft()
            if self.plan is not None:
                self._receive(w, instr, boundary)
            end = max(start, arrival) + cost
        elif transfer is not None:
            channel = transfer[0]
            if channel in self.sent:
                self._fail(w, instr, f"sends the same {channel[0]} to worker {channel[2]} twice")
            self.sent.add(channel)
            boundary = self._send(w, instr) if self.plan is not None else -1
            self.channels[channel].append((start + cost, boundary))
            self._wake(channel[2])
            end = start  # asynchronous: the worker goes on at once
        elif isinstance(instr, ins.ReduceGrads) and self.plan is not None:
            if w not in self.reduce_arrival:
                self.reduce_arrival[w] = start
                for v in self.groups[w]:  # those waiting for this arrival may go on now
                    if v != w:
                        self._wake(v)
            if any(v not in self.reduce_arrival for v in self.groups[w]):
                return False
            self._reduce(w, instr)
            start = max(self.reduce_arrival[v] for v in self.groups[w])
            end = start + cost
        else:
            if self.plan is not None:
                self._compute(w, instr)
            end = start + cost
        self.events.append(Event(w, self.pc[w], instr, start, end))
        self.clock[w] = end
        return True

    # -- semantics (only with a plan) ---------------------------------------------------------------------------

    def _fail(self, w: int, instr: ins.Instruction, why: str) -> None:
        raise ProgramError(f"worker {w}, instruction {self.pc[w]} {show(instr)}: {why}")

    def _send(self, w: int, instr: ins.Instruction) -> int:
        """Check that the payload exists; return the layer boundary the message carries."""
        start, stop = self.ranges[w]
        if isinstance(instr, ins.SendActivation):
            if instr.microbatch not in self.forwarded[w]:
                self._fail(w, instr, "sends an activation before its ForwardPass")
            if stop == self.num_layers:
                self._fail(w, instr, "the last stage has no activation to send")
            return stop
        if isinstance(instr, ins.SendGrad):
            if instr.microbatch not in self.input_grad[w]:
                self._fail(w, instr, "sends a gradient before its backward pass")
            if start == 0:
                self._fail(w, instr, "the first stage has no input gradient to send")
            return start
        if isinstance(instr, ins.SendReduced):
            if w not in self.reduce_arrival or (instr.start, instr.stop) != (start, stop):
                self._fail(w, instr, f"sends reduced gradients other than its own layers {start}..{stop - 1} after "
                                     f"its ReduceGrads")  # fmt: skip
            return start
        return instr.layer  # type: ignore[attr-defined]

    def _receive(self, w: int, instr: ins.Instruction, boundary: int) -> None:
        start, stop = self.ranges[w]
        if isinstance(instr, ins.RecvActivation):
            if boundary != start:
                why = f"receives the activation at layer boundary {boundary}, its stage starts at {start}"
                self._fail(w, instr, why)
            self._once(w, instr, self.act_in[w], "receives the activation")
        elif isinstance(instr, ins.RecvGrad):
            if boundary != stop:
                why = f"receives the gradient at layer boundary {boundary}, its stage stops at {stop}"
                self._fail(w, instr, why)
            self._once(w, instr, self.grad_in[w], "receives the gradient")
        elif isinstance(instr, ins.RecvReduced) and w not in self.reduce_arrival:
            self._fail(w, instr, "receives a copy's reduced gradients before its own ReduceGrads")

    def _once(self, w: int, instr: ins.MicroBatchInstruction, done: set[int], what: str) -> None:
        mb = instr.microbatch
        if mb in done:
            self._fail(w, instr, f"{what} of micro-batch {mb} a second time")
        done.add(mb)

    def _compute(self, w: int, instr: ins.Instruction) -> None:
        if not isinstance(instr, ins.MicroBatchInstruction):
            return
        mb, plan = instr.microbatch, self.plan
        assert plan is not None
        start, stop = self.ranges[w]
        layers = range(start, stop)
        if not 0 <= mb < plan.num_microbatches:
            self._fail(w, instr, f"micro-batch {mb} is not in the global batch (0..{plan.num_microbatches - 1})")
        ends = start == 0 or stop == plan.num_layers
        if isinstance(instr, ins.LoadMicroBatch):
            if not ends:
                self._fail(w, instr, "only the first and the last stage load a micro-batch")
            self._once(w, instr, self.loaded[w], "loads")
        elif isinstance(instr, ins.ForwardPass):
            pipeline = self.route.get(mb)
            if pipeline is not None and not any(
                (s.worker, s.start, s.stop) == (w, start, stop) for s in pipeline.stages
            ):
                self._fail(w, instr, f"micro-batch {mb} belongs to the pipeline of workers {pipeline.workers}")
            if ends and mb not in self.loaded[w]:
                self._fail(w, instr, "runs before LoadMicroBatch")
            if start > 0 and mb not in self.act_in[w]:
                self._fail(w, instr, "runs before its input activation was received")
            self._once(w, instr, self.forwarded[w], "runs forward")
            self._record(w, instr, self.fwd_by, layers, "forward")
        elif isinstance(instr, (ins.BackwardPass, ins.BackwardInput)):
            if mb not in self.forwarded[w]:
                self._fail(w, instr, "runs backward before the forward pass on this worker")
            if stop < plan.num_layers and mb not in self.grad_in[w]:
                self._fail(w, instr, "runs before its output gradient was received")
            self._once(w, instr, self.input_grad[w], "runs backward")
            self._record(w, instr, self.bwd_by, layers, "backward")
            if isinstance(instr, ins.BackwardPass):
                self._record(w, instr, self.wgt_by, layers, "weight-gradient")
                self.weight_grad[w].add(mb)
        elif isinstance(instr, ins.ForwardRedundant):
            if mb not in self.forwarded[w] or instr.start != stop or instr.stop <= instr.start:
                self._fail(w, instr, f"a redundant forward needs this worker's forward of micro-batch {mb} and runs "
                                     f"the layers right after its own (from {stop})")  # fmt: skip
        elif isinstance(instr, ins.BackwardWeight):
            if mb not in self.input_grad[w] or mb in self.weight_grad[w]:
                self._fail(w, instr, "needs exactly one BackwardInput of the same micro-batch before it")
            self.weight_grad[w].add(mb)
            self._record(w, instr, self.wgt_by, layers, "weight-gradient")

    def _record(
        self, w: int, instr: ins.MicroBatchInstruction, by: dict[tuple[int, int], list[int]], layers: range, what: str
    ) -> None:
        mb = instr.microbatch
        for layer in layers:
            if by[(mb, layer)]:
                self._fail(w, instr, f"micro-batch {mb} already ran {what} through layer {layer} "
                                     f"on worker {by[(mb, layer)][0]}")
            by[(mb, layer)].append(w)

    def _reduce(self, w: int, instr: ins.Instruction) -> None:
        pending = sorted(self.forwarded[w] - self.weight_grad[w])
        if pending:
            self._fail(w, instr, f"reduces gradients before the weight gradients of micro-batches {pending}")

    def leftovers(self) -> list[str]:
        """What is wrong once every program ran to its end: unmatched sends, layers a micro-batch skipped."""
        problems = [
            f"worker {src} sends a {kind} for {'layer' if kind == 'layer' else 'micro-batch'} {key} to worker "
            f"{dst}, which never receives it"
            for (kind, src, dst, key), queue in sorted(self.channels.items()) if queue
        ]
        assert self.plan is not None
        for mb in range(self.plan.num_microbatches):
            for what, by in (("forward", self.fwd_by), ("backward", self.bwd_by), ("weight-gradient", self.wgt_by)):
                skipped = [layer for layer in range(self.plan.num_layers) if not by[(mb, layer)]]
                if skipped:
                    problems.append(f"micro-batch {mb} never runs {what} through layers {skipped}")
        return problems


def _check_shape(plan: Plan, programs: Mapping[int, list[ins.Instruction]]) -> None:
    missing = sorted(set(worker_layers(plan)) - set(programs))
    extra = sorted(set(programs) - set(worker_layers(plan)))
    if missing or extra:
        raise ProgramError(f"programs and plan disagree: no program for workers {missing}, "
                           f"programs for workers {extra} that the plan does not name")
    for w, program in programs.items():
        program = [i for i in program if not isinstance(i, ins.ReducedInstruction)]  # they may sit between the two
        tail = [type(i) for i in program[-2:]]
        if tail != [ins.ReduceGrads, ins.OptimizerStep] or any(
            isinstance(i, (ins.ReduceGrads, ins.OptimizerStep)) for i in program[:-2]
        ):
            raise ProgramError(f"worker {w}'s program must end with ReduceGrads(), OptimizerStep() and hold "
                               f"them nowhere else; it ends with {[show(i) for i in program[-2:]]}")


def check_programs(plan: Plan, programs: Mapping[int, list[ins.Instruction]]) -> None:
    """Raise ProgramError unless the programs run to the end and train every micro-batch exactly once."""
    _check_shape(plan, programs)
    machine = _Machine(programs, lambda _w, _i: 1.0, plan)
    machine.run()
    problems = machine.leftovers()
    if problems:
        raise ProgramError("; ".join(problems))


def timeline(
    programs: Mapping[int, list[ins.Instruction]], durations: Durations, plan: Plan | None = None
) -> list[Event]:
    """Every instruction with its start and end time, in an order that respects the dependencies.

    Without a plan, ``ReduceGrads`` is a local instruction and no training semantics are checked; deadlocks raise
    ProgramError either way.
    """
    machine = _Machine(programs, durations, plan)
    machine.run()
    return machine.events


def simulate(
    programs: Mapping[int, list[ins.Instruction]], durations: Durations, plan: Plan | None = None
) -> float:
    """The makespan: when the last worker finishes its program."""
    return max((e.end for e in timeline(programs, durations, plan)), default=0.0)
