"""One iteration's programs on workers that share the cores of one host: processor sharing, in time order.

The local runtime runs every worker as a single-threaded process on one machine with a few cores, and its layers
are profiled alone on one core. Whenever more workers compute than the host has cores, the operating system shares
the cores out, and each computing worker advances at its share of them. The programs run here in time order, and
every computing worker's rate changes the moment a worker starts or ends a computation: the pipelines of a plan move
in lockstep, so their workers compute at the same moments and wait at the same moments, and a computation meets the
contention of the moment it runs in, which a slowdown averaged over the iteration misses.

What takes the cores, besides the forward and backward passes:
- **Messages.** A message arrives after the link's cost, as on the checker's abstract machine
  (``program_check.timeline``); with ``message_cpu_s`` it also costs the processes on both sides of a stage boundary
  CPU, half on the sender's core before it leaves and half on the receiver's once it arrived. A worker pays its half
  per message up to one half per forward or backward pass of its own, so a stage between two others, with a message
  on each side of every pass, pays half as much per message: what a message costs is the pass after the wait, which
  finds its working set gone, not the send or the receive.
- **All-reduces.** Each program runs up to its ``ReduceGrads``; its gradient all-reduces, given, start once every
  co-holder of its layers has arrived there, and take the cores as a computation does: on loopback an all-reduce is
  the processes' own copying and adding, and it gets the cores the other workers' computations leave it. What it
  costs is its CPU (``SimConfig.allreduce_cpu_bytes_per_s``), not the link's time, which counts its waits too.
- **Snapshot copies.** A REFT snapshot's copy, given, runs on a second thread of its worker from the iteration's start
  (the runtime starts it right after the optimizer step), and takes the cores as a computation does: a CPU host has
  no copy engine, and a copy thread is one more runnable thread.
- **Optimizer steps.** The caller (``runtime.sim.timing``) charges every worker's step at once with its own work of
  a step (``shared_span``): a worker that steps fewer layers is done sooner and leaves its share to the others.

How much the cores give depends on how many processes compute at once (``HostCores``): past the host's cores, the
switches between processes and their working sets in the shared caches cost more than the cores' count says.

Left out on purpose: the kernel's time slices (a worker woken by a message waits for a core, then runs faster than
its even share), and each worker starting its next iteration as soon as its own optimizer step is done. The work is
the same and so are the cores it gets; ``docs/simulator.md`` says how the model is validated against the runtime.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.config import SimConfig
from ftlab.runtime.core.program_check import Channel, ProgramError, channel_of, show


@dataclass
class SharedRun:
    """Each worker's times, from the iteration's start."""

    reduce_at: dict[int, float] = field(default_factory=dict)
    """When each worker reaches its ReduceGrads."""
    reduce_end: dict[int, float] = field(default_factory=dict)
    """When each worker leaves its ReduceGrads (given its all-reduces; otherwise when it reached it)."""
    phase_at: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    """When each worker starts each phase (``instructions.phase_of``)."""
    compute_s: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    """Wall seconds each worker spent in forward and backward instructions, waits for a core included (what the
    runtime's workers measure)."""
    copy_end: dict[int, float] = field(default_factory=dict)
    """When each worker's snapshot copy, if it had one, is done."""


@dataclass(frozen=True)
class HostCores:
    """A host's cores as processes computing at once get them: ``count`` cores, and where measured
    (``runtime.processes.profiler.cores_by_load``), the cores' worth ``k`` processes computing at once got together,
    ``by_load[k - 1]`` (past the last, ``worth``), in cores of one process alone's speed. Measured beside a job,
    entry 0 is one, and how fast each worker computes against its costs is ``SimConfig.host_layer_speed``'s (the
    caller's); an entry 0 other than one speeds up or slows down everything the host runs."""

    count: float
    by_load: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.count <= 0 or any(worth <= 0 for worth in self.by_load):
            raise ValueError(f"a host needs positive cores, not {self.count} and {list(self.by_load)} by load")

    def worth(self, running: int) -> float:
        """The cores' worth ``running`` processes computing at once get together (by ``count``, none more than a
        core each).

        Past the loads measured (a job's workers and their snapshot copies beside them), each process more gets
        what each of the last measured load got, while the host has a core for it: on a host of more cores than the
        job has workers, four workers and their four copies are eight processes on eight cores, each getting what one
        of the measured load got; where the measured load already filled the cores, the last entry holds."""
        if running <= 0:
            return 0.0
        if not self.by_load:
            return min(float(running), self.count)
        measured = len(self.by_load)
        if running <= measured:
            return self.by_load[running - 1]
        return self.by_load[-1] * min(running, self.count) / min(measured, self.count)

    def slowdown(self, running: int) -> float:
        """How much slower each of ``running`` processes computing at once is than on a core of its own at the speed
        its costs charge."""
        return running / self.worth(running) if running > 0 else 1.0

    def contention(self, running: int) -> float:
        """How much slower each of ``running`` processes is than one of them alone: the slowdown without what one
        alone already has against the costs, for work the profile did not time (starting processes, copies)."""
        return self.slowdown(running) / self.slowdown(1)


def contention_on(host: HostCores | None, running: int) -> float:
    """``host.contention(running)``, or 1 where no host is shared (each process has a core of its own)."""
    return host.contention(running) if host is not None else 1.0


def host_of(sim: SimConfig) -> HostCores | None:
    """The host every worker shares by ``sim``'s constants, or None where it names no cores."""
    return HostCores(sim.host_cores, tuple(sim.host_cores_by_load)) if sim.host_cores > 0 else None


def shared_ends(seconds: Sequence[float], cores: HostCores) -> list[float]:
    """When each of processes started at once on ``cores`` is done, each with its ``seconds`` of work on a core of
    its own: processor sharing, each one done leaving its share to the others."""
    ends = [0.0] * len(seconds)
    running = sum(amount > 0 for amount in seconds)
    now = done = 0.0
    for i in sorted((i for i, amount in enumerate(seconds) if amount > 0), key=lambda i: seconds[i]):
        now += (seconds[i] - done) * cores.slowdown(running)
        done, ends[i] = seconds[i], now
        running -= 1
    return ends


def shared_span(seconds: Sequence[float], cores: HostCores) -> float:
    """How long processes started at once on ``cores`` take until the last is done (``shared_ends``)."""
    return max(shared_ends(seconds, cores), default=0.0)


@dataclass(frozen=True)
class Reduction:
    """A worker's ReduceGrads: the workers it waits for (the co-holders of its layers) and its all-reduces' seconds
    on a core of its own."""

    peers: frozenset[int]
    seconds: float


def run_shared(
    programs: Mapping[int, Sequence[ins.Instruction]], cost: Callable[[int, ins.Instruction], float], cores: HostCores,
    reductions: Mapping[int, Reduction] | None = None, copies: Mapping[int, float] | None = None,
    message_cpu_s: float = 0.0,
) -> SharedRun:  # fmt: skip
    """Execute ``programs`` up to their ReduceGrads on a host of ``cores``, then each worker's ``reductions``
    (none given: every worker leaves ReduceGrads as it reaches it), with each worker's snapshot copy in ``copies``
    (its seconds on a core of its own) beside them from the start; ``cost``: an instruction's seconds on a core of
    its own (a transfer's: the link's); ``message_cpu_s``: what a message costs its sender and receiver together on
    a core (``SimConfig.message_cpu_s``), half each. ProgramError on a deadlock."""
    return _Host(programs, cost, cores, reductions or {}, copies or {}, message_cpu_s).run()


def _passes_per_message(program: Sequence[ins.Instruction]) -> float:
    """How much of its half of a message's CPU a worker running ``program`` pays per message it sends or receives:
    all of it, up to one half per forward or backward pass of its own (a stage between two others pays half of it;
    module docstring)."""
    passes = sum(isinstance(i, ins.COMPUTE) for i in program)
    messages = sum(isinstance(i, ins.PeerInstruction) for i in program)  # activations and gradients
    return min(1.0, passes / messages) if messages else 0.0


class _Host:
    def __init__(
        self, programs: Mapping[int, Sequence[ins.Instruction]], cost: Callable[[int, ins.Instruction], float],
        cores: HostCores, reductions: Mapping[int, Reduction], copies: Mapping[int, float], message_cpu_s: float,
    ) -> None:  # fmt: skip
        self.programs = programs
        self.cost = cost
        self.cores = cores
        self.reductions = reductions
        self.handling_s = {w: message_cpu_s / 2 * _passes_per_message(program) for w, program in programs.items()}
        """Each worker's share of a message's CPU, per message it sends or receives: the sender's before the message
        leaves, the receiver's after it arrived."""
        self.handling: dict[int, tuple[Channel, float] | None] = {}
        """Worker handling a message -> for a send, its channel and the link's seconds once handled; None: a
        receive."""
        self.reducing: set[int] = set()
        """Workers whose work left is their all-reduces."""
        self.arrived_at: dict[int, list[int]] = defaultdict(list)
        """Worker -> the workers at ReduceGrads that wait for it to arrive too."""
        self.now = 0.0
        self.pc = dict.fromkeys(programs, 0)
        self.work_left: dict[int, float] = {}  # computing worker -> seconds of work (on a core of its own) left
        self.copy_left = {w: s for w, s in copies.items() if s > 0}  # copying worker -> seconds of its copy left
        self.started: dict[int, float] = {}  # computing worker -> when its instruction started
        self.waiting: dict[int, Channel] = {}  # blocked worker -> the channel it receives from
        self.messages: dict[Channel, deque[float]] = defaultdict(deque)  # arrival times, in order
        self.out = SharedRun()

    def run(self) -> SharedRun:
        for worker in self.programs:
            self._advance(worker)
        while self.work_left or self.waiting or self.copy_left:
            running = len(self.work_left) + len(self.copy_left)
            rate = 1 / self.cores.slowdown(running)
            least = min([*self.work_left.values(), *self.copy_left.values()], default=None)
            arrivals = [q[0] for q in (self.messages[c] for c in self.waiting.values()) if q]
            until = min([*arrivals, *([self.now + least / rate] if least is not None else [])], default=None)
            if until is None:
                raise ProgramError("deadlock: no worker can progress; " + "; ".join(
                    f"worker {w} waits at {show(self.programs[w][self.pc[w]])} for the matching send"
                    for w in sorted(self.waiting)
                ))  # fmt: skip
            elapsed = until - self.now
            self.now = until
            done = [w for w, left in self.work_left.items() if left - elapsed * rate <= 1e-12 * max(1.0, left)]
            for worker in self.work_left:
                self.work_left[worker] -= elapsed * rate
            for worker, left in list(self.copy_left.items()):
                if left - elapsed * rate <= 1e-12 * max(1.0, left):
                    del self.copy_left[worker]
                    self.out.copy_end[worker] = self.now
                else:
                    self.copy_left[worker] = left - elapsed * rate
            for worker in done:
                del self.work_left[worker]
                started = self.started.pop(worker)
                if worker in self.reducing:
                    self.reducing.discard(worker)
                    self.out.reduce_end[worker] = self.now
                    continue
                if worker in self.handling:
                    sent = self.handling.pop(worker)
                    if sent is not None:
                        self.messages[sent[0]].append(self.now + sent[1])
                else:
                    self.out.compute_s[worker] += self.now - started
                self.pc[worker] += 1
                self._advance(worker)
            for worker, channel in list(self.waiting.items()):
                if self.messages[channel] and self.messages[channel][0] <= self.now:
                    del self.waiting[worker]
                    self._advance(worker)
        return self.out

    def _advance(self, worker: int) -> None:
        """Run ``worker`` at ``now`` until it computes, waits for a message or reaches its ReduceGrads."""
        program = self.programs[worker]
        while self.pc[worker] < len(program):
            instr = program[self.pc[worker]]
            phase = ins.phase_of(instr)
            if phase:
                self.out.phase_at[worker].setdefault(phase, self.now)
            if isinstance(instr, (ins.ReduceGrads, ins.OptimizerStep)):
                self._arrive(worker)
                return
            transfer = channel_of(worker, instr)
            if transfer is None:
                seconds = self.cost(worker, instr)
                if seconds > 0 or isinstance(instr, ins.COMPUTE):  # whatever takes a worker's time takes its core
                    self.work_left[worker] = seconds
                    self.started[worker] = self.now
                    return
            elif transfer[1]:
                if self.handling_s[worker] > 0:
                    self._handle(worker, (transfer[0], self.cost(worker, instr)))
                    return
                self.messages[transfer[0]].append(self.now + self.cost(worker, instr))
            else:
                queue = self.messages[transfer[0]]
                if not queue or queue[0] > self.now:
                    self.waiting[worker] = transfer[0]
                    return
                queue.popleft()
                if self.handling_s[worker] > 0:
                    self._handle(worker, None)
                    return
            self.pc[worker] += 1
        self._arrive(worker)  # a program without ReduceGrads ends here

    def _handle(self, worker: int, sent: tuple[Channel, float] | None) -> None:
        """``worker`` spends its share of a message's CPU on the cores; a send's message leaves after it."""
        self.work_left[worker] = self.handling_s[worker]
        self.started[worker] = self.now
        self.handling[worker] = sent

    def _arrive(self, worker: int) -> None:
        """``worker`` reaches its ReduceGrads: its all-reduces, and those of the workers that waited for it, start
        once every worker they wait for is there."""
        self.out.reduce_at[worker] = self.now
        for ready in [worker, *self.arrived_at.pop(worker, ())]:
            self._start_reduction(ready)

    def _start_reduction(self, worker: int) -> None:
        reduction = self.reductions.get(worker)
        if reduction is None or reduction.seconds <= 0:
            self.out.reduce_end[worker] = self.now
            return
        absent = [peer for peer in reduction.peers if peer not in self.out.reduce_at]
        if absent:
            self.arrived_at[absent[0]].append(worker)  # asked again when that one arrives
            return
        self.work_left[worker] = reduction.seconds
        self.started[worker] = self.now
        self.reducing.add(worker)
