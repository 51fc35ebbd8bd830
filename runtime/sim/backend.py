"""The simulated backend: the coordinator's protocol carried out on a simulated cluster, in simulated time.

The coordinator (``runtime.control.coordinator``), the policies and the protections run unchanged: they see the same calls
answer with the same values (a plan configured, a step ready, a ``Failure``) as on real processes, and the fault
injector fires the same schedules on this backend's ``FaultTarget``. Only the machines are simulated.

Time advances by events, never by ticks. A call that waits (a step, a configuration, a restart, a save, an abort)
moves the clock to when the wait would end, unless something happens first: a timer of the fault injector fires
(a kill, a hang, a join) or a failure is noticed. Notices follow the local runtime's rules: a killed worker or node
is noticed ``sim.detect_s`` after the kill (a closed connection), a hung worker after ``cluster.heartbeat_timeout_s``
of silence (then fenced); after the first notice the coordinator waits ``sim.failure_window_s`` for the rest of the
failure. A worker that is dead or hung blocks whatever waits for it, so the wait lasts until its failure is noticed.

What each wait costs:
- a step: the plan's programs executed instruction by instruction with the one cost model
  (``runtime.sim.timing``), up to every worker's ReduceGrads; then the commit (``sim.control_s``) and the slowest
  optimizer step. **One iteration is simulated per plan and reused for every step of it: the iterations of one plan
  are identical** (same programs, same costs), so the clock of step k of a plan is its start plus k periods.
- a configuration: ``sim_timing.configuration_s`` (programs, process groups, buffers), then the layer copies (the
  ``SendLayer``/``RecvLayer`` programs on the same abstract machine; a worker's sends share its link, one after
  another), building every layer a worker did not hold (``sim.build_bytes_per_s``), decoding what it received
  (``sim.codec_bytes_per_s``), and reading what it restores from storage (``sim.storage_read_bytes_per_s``,
  shared by all readers).
- a restart: every worker process starts again (``sim.process_start_s``; on a shared host, slowed as that many
  processes computing at once).
- a save: each protection ``Action`` kind has a cost (``action_cost``); a storage checkpoint encodes each writer's
  layers (in parallel) and writes them all at ``sim.storage_write_bytes_per_s``. On a shared host the encoding
  shares the cores with the snapshot copies in flight (REFT's flush follows its step's snapshot:
  ``_beside_copies``). Other kinds register their own with ``register_action``, and sources to restore from with
  ``register_source``.
- a REFT snapshot (``TakeSnapshot``) is asynchronous, as on the runtime (below).
- an abort: ``sim.abort_s``, or longer while a survivor finishes the snapshot it is copying.

REFT's snapshots, as the runtime takes them (``runtime.processes.local_backend``, the worker's ``Snapshotter``):
- ``save`` returns at once (``SaveReport(pending=True)``). Each writer writes the records ``snapshot_layout``'s
  ``records_to_write`` gives it (their bytes from the layout's geometry over the layers' parameters), starting
  after ``sim.snapshot_launch_s`` (the launch, on the training thread, delays the next iteration that long) and
  copying at ``sim.snapshot_bytes_per_s`` beside training. On a shared host (the measured cpu profile) the copies
  are threads that take the cores as computations do: the iteration they overlap is timed with them beside it
  (``IterationTimer.time(copies=...)``, once per plan and set of writers), which says when each copy ends and how
  much later every worker reduces. Our choice: a copy is timed as overlapping an iteration even when a
  reconfiguration comes next instead (which then waits for it).
- A writer waits for its copy before it reports ready (the runtime's worker does), so the next step's ready time
  is the later of its gradients and its copy; ``StepReport.snapshot_s`` is the launch plus the longest such wait.
  It reports its records then (``completed_saves``), or when it acknowledges an abort (survivors finish their copy
  first) or a configuration.
- Each node's memory holds the records reported on it, two slots per record name as on the runtime: a reported
  record replaces every slot of its name but the snapshot it must keep (``TakeSnapshot.keep``). (The runtime
  tears the overwritten slot when the copy starts, not when it is reported; no one can tell the difference, since
  the protection forgets every snapshot but the kept one when it asks for a new one.) A writer that dies before it
  reports loses its part (its copy dies with it); a killed node loses its memory, every record on it. ``verify``
  narrows a ``MemorySource`` to the records still in memory.
- A restore from memory (``MemorySource``) follows ``snapshot_layout.load_plan``, the runtime's own: ``_memory_read``
  says what each part costs.

A simulated step has no loss (``StepReport.loss`` is NaN): nothing is computed but time.

Phase faults are simulated where the worker would stop: at its first instruction of the phase (forward, backward,
reduce) in the timed iteration, at the commit (optimizer), at the first layer a writer saves (checkpoint), at the
first layer a worker receives (transfer). A join with ``wait`` (a step-clocked join) moves the clock to when the
node's workers have registered without firing the timers in between (the injector is firing one): those fire at
once after it.

``sim.horizon_s`` ends the job when the clock would pass it (``HorizonReached``).

Which constants apply: a measured (cpu) profile simulates the local runtime on this machine, so every constant
measured on it applies, among them the CPU's cost of building, encoding and decoding layer state and the runtime's
own cost per layer of an instruction. A GPU type's workers build layers on the device and copy them as tensors
(NCCL), at costs its profile already holds (the link), so building and encoding cost nothing there beyond the
bandwidths, and a checkpoint's cost is the storage's (``sim.storage_*``, which a paper-scale study sets for its
storage). Process start, configuration, detection and the coordinator's round trips are the local runtime's
measured figures in both cases.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from ftlab.runtime.control import events as ev
from ftlab.runtime.core import instructions as ins
from ftlab.runtime.control.backend import (
    Backend, ConfigureReport, Failure, FaultTarget, Membership, PendingSnapshot, SaveProgress, SaveReport, StepReport,
    WorkerCrashed,
)
from ftlab.runtime.core.contract import (
    Action, MemoryRecord, MemorySource, SaveCheckpoint, Source, StorageSource, TakeSnapshot,
)
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.core.snapshot_layout import load_plan, lost_shards, record_bytes, records_to_write
from ftlab.runtime.sim.machines import SimMachine
from ftlab.runtime.sim.timing import IterationTiming

_NEVER = math.inf


class HorizonReached(Exception):
    """The simulated clock reached ``sim.horizon_s``: the job ends there."""


@dataclass(frozen=True)
class SimSave:
    """What carrying out a protection's action costs: seconds the coordinator waits, bytes saved, where."""

    seconds: float
    nbytes: int
    location: str
    cpu_s: Mapping[int, float] = field(default_factory=dict)
    """Each writer's CPU in ``seconds`` that runs side by side with the others', on a core of its own (a storage
    checkpoint's encoding): on a shared host it shares the cores with the snapshot copies in flight."""


ActionCost = Callable[[Action, int, Mapping[int, tuple[int, ...]], SimMachine], SimSave]
_ACTIONS: dict[type[Action], ActionCost] = {}


def register_action(kind: type[Action], cost: ActionCost) -> None:
    """Teach the simulator what a protection's action costs: ``cost(action, step, writers, machine)``, where
    ``writers`` maps each saving worker to its layers and ``machine`` holds the figures."""
    _ACTIONS[kind] = cost


def _storage_checkpoint(action: Action, step: int, writers: Mapping[int, tuple[int, ...]], m: SimMachine) -> SimSave:
    assert isinstance(action, SaveCheckpoint)
    per_writer = {worker: m.checkpoint_bytes(layers) for worker, layers in writers.items()}
    encode = {worker: nbytes / m.codec_bytes_per_s for worker, nbytes in per_writer.items()}
    written = sum(per_writer.values()) / m.sim.storage_write_bytes_per_s
    seconds = m.sim.control_s + max(encode.values(), default=0.0) + written
    return SimSave(seconds, int(sum(per_writer.values())), f"{action.directory}/step-{step:06d}", encode)


register_action(SaveCheckpoint, _storage_checkpoint)


@dataclass(frozen=True, eq=False)
class _Part:
    """What one writer writes of each snapshot of a plan: its records, sized, and their names in memory. One object
    per writer and plan layout (``SimBackend._parts``): a key by identity."""

    records: tuple[MemoryRecord, ...]
    names: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True, eq=False)
class _Writers:
    """Writers of a snapshot whose copies begin and end together, and their parts, in worker order. The writers of
    one part size that start at the launch (all of them, unless one still copies the last snapshot) are one of
    these: a snapshot of a thousand writers is simulated as a few copies, not a thousand."""

    workers: tuple[int, ...]
    parts: tuple[_Part, ...]
    members: frozenset[int]
    records: tuple[MemoryRecord, ...]
    """Every part's records, in worker order: what the writers report."""
    nbytes: int

    @staticmethod
    def of(pairs: list[tuple[int, _Part]]) -> _Writers:
        pairs = sorted(pairs, key=lambda pair: pair[0])
        parts = tuple(part for _, part in pairs)
        return _Writers(
            tuple(w for w, _ in pairs), parts, frozenset(w for w, _ in pairs),
            tuple(r for part in parts for r in part.records), sum(part.nbytes for part in parts),
        )  # fmt: skip

    def without(self, gone: set[int] | frozenset[int]) -> _Writers | None:
        """These writers but ``gone``; None if none is left."""
        kept = [(w, part) for w, part in zip(self.workers, self.parts) if w not in gone]
        return _Writers.of(kept) if kept else None


@dataclass(frozen=True)
class _Copy:
    """Writers' parts of a snapshot in flight, copied side by side."""

    step: int
    writers: _Writers
    keep: int
    """The snapshot whose slots the copy must not overwrite."""
    begins: float
    ends: float

    def without(self, gone: set[int] | frozenset[int]) -> _Copy | None:
        """This copy without the parts of ``gone``'s writers; None if none is left."""
        if self.writers.members.isdisjoint(gone):
            return self
        rest = self.writers.without(gone)
        return None if rest is None else replace(self, writers=rest)


@dataclass(frozen=True)
class _Configured:
    """The plan configured last: its generation, iteration timing and workers, its programs, and on a shared host
    its iteration with snapshot copies beside it, by the writers copying."""

    generation: int
    timing: IterationTiming
    workers: frozenset[int]
    plan: Plan
    programs: Mapping[int, ins.Program]
    with_copies: dict[frozenset[int], IterationTiming] = field(default_factory=dict)


class SimBackend(Backend, FaultTarget):
    def __init__(
        self,
        nodes: int,
        workers_per_node: int,
        machine: SimMachine,
        heartbeat_timeout_s: float,
        bus: ev.EventBus,
    ) -> None:
        self.workers_per_node = workers_per_node
        self.machine = machine
        """What everything costs (``runtime.sim.machines``): the one model the policies predict with too."""
        self.costs = machine.costs
        self.sim = machine.sim
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.bus = bus
        self.horizon = _NEVER if self.sim.horizon_s is None else self.sim.horizon_s
        self.now = 0.0
        self.timer = machine.timer
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._sequence = itertools.count()
        self._cancelled: set[int] = set()
        self._step_timers: list[int] = []
        self._nodes: set[int] = set(range(nodes))
        """Nodes whose agent is alive."""
        self._registered_at: dict[int, float] = dict.fromkeys(range(nodes), 0.0)
        """When each node's workers register (later than now for a node still starting)."""
        self._alive: set[int] = {w for n in range(nodes) for w in self.workers_of(n)}
        self._held: dict[int, set[int]] = {w: set() for w in self._alive}
        self._dead_unnoticed: dict[int, float] = {}
        """Dead workers nobody has noticed yet, and when the coordinator will."""
        self._nodes_unnoticed: dict[int, float] = {}
        self._hung: dict[int, float] = {}
        """Hung workers (alive to everyone) and when their silence is noticed."""
        self._pending_joins: set[int] = set()
        self._armed: dict[int, tuple[int, str]] = {}
        self._configured: _Configured | None = None
        """The plan configured last: the only one that runs steps (the coordinator configures a plan before it trains
        it), so no other plan's timing is kept for a whole simulated day of plans."""
        self._layers_dropped = True
        self._step_started = 0.0
        self._membership: Membership | None = None
        self._snapshots: dict[int, PendingSnapshot] = {}
        """Snapshots in flight, by step."""
        self._copies: list[_Copy] = []
        """Writers' copies not reported yet, in the order they were launched."""
        self._memory: dict[int, dict[str, dict[int, MemoryRecord]]] = {}
        """Each node's memory: its records' slots by name, each slot by the step it holds; up to date once the slots
        written since are settled (``_settle_memory``)."""
        self._written: dict[_Part, dict[int, bool]] = {}
        """The slots each writer's part has written since the memory was settled, alike for all its records (one
        writer's records are written together, and no two parts of a layout share a record): step -> True for the
        part's own record of that step, False for whatever its records held at that step before (kept, if they held
        one). A snapshot of a thousand writers updates a few hundred of these, not every record in memory: at a
        snapshot every step of a 24-hour job on 512 nodes, that per-record update was most of the simulation."""
        self._launch_s = 0.0
        """The launch of a snapshot taken since the last step began: it delays the next one."""
        self._launched: float | None = None
        """The launch the running step began after (None: no snapshot since the step before)."""
        self._overlapped: tuple[int, IterationTiming] | None = None
        """On a shared host, the next step's timing with the copies launched since the last step beside it, and the
        generation of the plan it was timed on."""
        self._step_timing: IterationTiming | None = None
        """The running step's timing: its plan's, or with the copies that overlap it."""
        self._layout: tuple[TakeSnapshot, dict[int, _Part], list[_Writers]] | None = None
        """The writers' parts of the running plan's snapshots (the same for every snapshot of it), and the writers
        grouped by their part's size."""
        self._reduced_by: dict[_Writers, float] = {}
        """When the first of a group of writers leaves its ReduceGrads in the configured plan's iteration (each step
        waits for the copies that end later)."""

    # -- clock and timers ------------------------------------------------------------------------------------
    def clock(self) -> float:
        return self.now

    def call_at(self, at: float, action: Callable[[], None]) -> int:
        """Run ``action`` when the simulated clock reaches ``at`` (the fault injector's timer)."""
        ident = next(self._sequence)
        heapq.heappush(self._timers, (at, ident, action))
        return ident

    def _next_timer(self) -> float:
        while self._timers and self._timers[0][1] in self._cancelled:
            self._cancelled.discard(heapq.heappop(self._timers)[1])
        return self._timers[0][0] if self._timers else _NEVER

    def _fire_next(self) -> None:
        at, _, action = heapq.heappop(self._timers)
        self.now = max(self.now, at)
        action()

    def _advance(self, until: float) -> None:
        """Move the clock to ``until``, firing timers on the way; failures are noticed by the next wait."""
        while self._next_timer() <= until:
            self._fire_next()
        self.now = max(self.now, until)

    def _wait(self, until: float, needs: set[int] | frozenset[int]) -> Failure | None:
        """Move the clock to ``until`` unless a failure is noticed first (then: that failure, the clock at its
        notice plus the failure window). A dead or hung worker of ``needs`` holds the wait until it is noticed."""
        while True:
            blocked = any(w in needs for w in self._hung) or any(w in needs for w in self._dead_unnoticed)
            end = _NEVER if blocked else until
            notice = min([*self._dead_unnoticed.values(), *self._hung.values()], default=_NEVER)
            timer = self._next_timer()
            if min(notice, timer, end) == _NEVER and self.horizon == _NEVER:
                raise RuntimeError("the simulation waits for something that never happens")
            if min(notice, timer, end) > self.horizon:
                self.now = max(self.now, self.horizon)
                raise HorizonReached(f"the simulated clock reached sim.horizon_s={self.horizon:g}")
            if notice <= timer and notice <= end:
                self.now = max(self.now, notice)
                return self._gather()
            if timer <= end:
                self._fire_next()
                continue
            self.now = max(self.now, end)
            return None

    def _gather(self) -> Failure:
        """The failure noticed now, with every other sign that arrives within the failure window."""
        end = self.now + self.sim.failure_window_s
        self._advance(end)
        failure = Failure()
        for worker, noticed in sorted(self._hung.items()):
            if noticed <= end:
                self._publish(ev.HangDetected, at=noticed, worker=worker, timeout_s=self.heartbeat_timeout_s)
                del self._hung[worker]
                self._lose(worker, noticed)  # fenced: a hung worker must never come back
        for node, noticed in list(self._nodes_unnoticed.items()):
            if noticed <= end:
                failure.nodes[node] = self._nodes_unnoticed.pop(node)
        for worker, noticed in list(self._dead_unnoticed.items()):
            if noticed <= end:
                failure.workers[worker] = self._dead_unnoticed.pop(worker)
        return failure

    # -- membership ------------------------------------------------------------------------------------------
    def membership(self) -> Membership:
        if self._membership is None:
            slots = {n: tuple(self.workers_of(n)) for n in sorted(self._nodes)}
            alive = self._alive
            workers = {n: ws if alive.issuperset(ws) else tuple(w for w in ws if w in alive) for n, ws in slots.items()}
            self._membership = Membership(
                workers_of_node={n: ws for n, ws in workers.items() if ws}, slots_of_node=slots
            )
        return self._membership

    def _changed(self) -> None:
        self._membership = None

    # -- the protocol ----------------------------------------------------------------------------------------
    def restart_workers(self) -> Failure | None:
        starting = [self._registered_at[n] for n in self._nodes]
        failure = self._wait(max(starting, default=self.now), needs=set())
        if failure:
            return failure
        workers = [w for n in sorted(self._nodes) for w in self.workers_of(n)]
        self._alive = set(workers)
        self._held = {w: set() for w in workers}
        self._hung.clear()  # every worker process is ended, hung ones too
        self._pending_joins.clear()  # every live node restarts: the next plan includes them all
        self._snapshots.clear()  # copies in flight die with their workers: those snapshots stay incomplete
        self._copies.clear()
        self._launch_s = 0.0
        self._changed()
        slots = {node: tuple(self.workers_of(node)) for node in self._nodes}
        failure = self._wait(self.now + self.machine.restart_s(slots), needs=set())
        for node in failure.nodes if failure else ():
            self._publish(ev.NodeLostWhileStarting, node=node)
        return failure

    def configure(
        self, plan: Plan, programs: Mapping[int, ins.Program], transfers: Mapping[int, ins.Program], restore: Source | None
    ) -> ConfigureReport | Failure:
        timing = self.timer.time(plan, programs)
        needs = frozenset(plan.layer_ranges())
        started = self.now + self._copying(needs)  # a worker finishes its snapshot first
        serving = [w for w in sorted(self._alive) if w not in needs]
        cost = self.machine.configuring(plan, transfers, restore, self._held, serving)
        if cost.unprovided is not None and plan.step != 0:
            worker, layer = cost.unprovided
            raise WorkerCrashed(
                f"worker {worker} crashed:\nRuntimeError: layer {layer} is missing at step {plan.step} and nothing "
                f"provides it"
            )
        restored_from = self._restored_from(restore, cost.restored, plan, serving)
        ranges = plan.layer_ranges()
        gaining, received, restored, reading = cost.gaining, cost.received, cost.restored, cost.restore_s
        seconds = cost.seconds
        configuring = cost.configure_s
        self._arm_transfers(plan, transfers, started + configuring)
        failure = self._wait(started + seconds, needs=needs)
        if failure:
            return failure
        for worker in gaining:  # the others hold their stage already
            self._held.setdefault(worker, set()).update(range(*ranges[worker]))
        if self._pending_joins:
            self._pending_joins -= {self.node_of(w) for w in plan.workers}
        self._configured = _Configured(plan.generation, timing, needs, plan, programs)
        self._overlapped = None
        self._reduced_by.clear()
        self._layers_dropped = False
        return ConfigureReport(
            received_bytes=int(sum(self.machine.checkpoint_bytes(layers) for layers in received.values())),
            restored_bytes=int(sum(self.machine.checkpoint_bytes(layers) for layers in restored.values())),
            restore_s=reading, restored_from=restored_from,
        )  # fmt: skip

    def verify(self, source: Source) -> Source | str | Failure:
        """Simulated saved state is never corrupt, but memory is lost with its node and slots are overwritten: a
        memory source keeps the records still in memory."""
        if not isinstance(source, MemorySource):
            return source
        self._settle_memory()
        intact = tuple(
            r for r in source.records
            if r.node in self._nodes and source.step in self._memory.get(r.node, {}).get(r.name, {})
        )  # fmt: skip
        lost = lost_shards(source.plan, intact)
        if lost:
            return f"the records left in memory cannot rebuild {'; '.join(lost)}"
        return replace(source, records=intact)

    def begin_step(self, plan: Plan, step: int) -> None:
        timing = self._running(plan).timing
        overlapped, self._overlapped = self._overlapped, None
        if overlapped is not None and overlapped[0] == plan.generation:
            timing = overlapped[1]
        if timing is not self._step_timing:  # the groups' ReduceGrads ends are the step timing's
            self._reduced_by.clear()
            self._step_timing = timing
        self._launched, self._launch_s = (self._launch_s if self._launch_s else None), 0.0
        self._step_started = self.now + (self._launched or 0.0)
        if not self._layers_dropped:  # a plan's first step drops the layers it no longer runs
            for worker, (start, stop) in plan.layer_ranges().items():
                held = self._held.get(worker)
                # Configured, a worker holds its stage and maybe more (or nothing, restarted since): it holds more
                # than its stage exactly when it holds more layers.
                if held is not None and len(held) > stop - start:
                    held.intersection_update(range(start, stop))
            self._layers_dropped = True
        for worker, (armed_step, phase) in list(self._armed.items()):
            at = timing.phase_at(worker, phase) if armed_step == step and worker in timing.reduce_end else None
            if at is not None:
                self._step_timers.append(self.call_at(self._step_started + at, self._at_phase(worker, step, phase)))

    def finish_step(self, plan: Plan, step: int) -> StepReport | Failure:
        needs = self._running(plan).workers
        timing = self._step_timing
        assert timing is not None, "a step finished that never began"
        ready = self._step_started + timing.ready_s
        longest: float | None = None  # a writer reports ready once its gradients are reduced and its copy is done
        for copy in self._copies:
            if needs.isdisjoint(copy.writers.members):
                continue
            ready = max(ready, copy.ends)
            wait = max(0.0, copy.ends - self._step_started - self._reduced(copy.writers, timing, needs))
            longest = wait if longest is None else max(longest, wait)
        failure = self._wait(ready, needs=needs)
        self._cancel_step_timers()
        if failure:
            return failure
        snapshot_s = None
        if self._launched is not None or longest is not None:
            snapshot_s = (self._launched or 0.0) + (longest or 0.0)
        return StepReport(loss=math.nan, compute_s=timing.compute_s, snapshot_s=snapshot_s)

    def _reduced(self, writers: _Writers, timing: IterationTiming, needs: frozenset[int]) -> float:
        """When the first of ``writers`` that the step needs leaves its ReduceGrads (from the step's start)."""
        if not needs.issuperset(writers.members):
            return min(timing.reduce_end.get(w, timing.ready_s) for w in writers.workers if w in needs)
        if writers not in self._reduced_by:
            self._reduced_by[writers] = min(timing.reduce_end.get(w, timing.ready_s) for w in writers.workers)
        return self._reduced_by[writers]

    def commit(self, plan: Plan, step: int) -> None:
        for worker, (armed_step, phase) in list(self._armed.items()):
            if armed_step == step and phase == "optimizer" and worker in self._running(plan).workers:
                self._at_phase(worker, step, phase)()
        self._advance(self.now + self.sim.control_s + self._running(plan).timing.optimizer_s)

    def _running(self, plan: Plan) -> _Configured:
        assert self._configured is not None and self._configured.generation == plan.generation, "plan not configured"
        return self._configured

    def abort(self, plan: Plan, failure: Failure, committed: int) -> dict[int, tuple[int, ...]]:
        self._cancel_step_timers()
        until = self.now + max(self.sim.abort_s, self._copying(self._alive))  # survivors finish their copies first
        while (more := self._wait(until, needs=set())) is not None:
            failure.merge(more)  # a failure during the abort: fold it in
        # Nearly every survivor holds exactly its stage of the plan: those share one tuple per stage's range.
        ranges = plan.layer_ranges()
        stages = {held: tuple(range(*held)) for held in plan.workers_by_range()}
        holdings = {}
        configured = self._configured
        running = plan.workers
        if configured is not None and configured.generation == plan.generation:
            running = configured.workers
        for worker in running:
            if worker in self._alive:
                held, (start, stop) = self._held[worker], ranges[worker]
                exact = len(held) == stop - start and held.issuperset(range(start, stop))
                holdings[worker] = stages[(start, stop)] if exact else tuple(sorted(held))
        return holdings

    def save(self, step: int, action: Action, writers: Mapping[int, tuple[int, ...]], num_layers: int) -> SaveReport | Failure:
        if isinstance(action, TakeSnapshot):
            return self._snapshot(step, action)
        cost = _ACTIONS.get(type(action))
        if cost is None:
            raise NotImplementedError(
                f"the simulator has no cost for {type(action).__name__}: register one with "
                f"runtime.sim.backend.register_action"
            )
        saved = cost(action, step, writers, self.machine)
        seconds = self._beside_copies(saved)
        started = self.now
        for worker, (armed_step, phase) in list(self._armed.items()):
            if armed_step == step and phase == "checkpoint" and writers.get(worker):
                first = self.machine.checkpoint_bytes(writers[worker][:1]) / self.machine.codec_bytes_per_s
                self._step_timers.append(self.call_at(started + first, self._at_phase(worker, step, phase)))
        failure = self._wait(started + seconds, needs=set(writers))
        self._cancel_step_timers()
        if failure:
            return failure
        return SaveReport(saved.nbytes, saved.location)

    def _beside_copies(self, saved: SimSave) -> float:
        """A save's seconds with the snapshot copies in flight beside it, as the machine shares them
        (``SimMachine.save_beside_copies``). On the runtime a flush to storage follows its step's snapshot, and the
        workers write it while their copy threads run: each copy ends when it is done, and the next iteration, timed
        with the copies beside it, is timed without them if they end within the save. Left as is: a fault armed in a
        copy (the "snapshot" phase) keeps the moment its launch scheduled."""
        flight = [i for i, c in enumerate(self._copies) if c.ends > self.now]
        left = [(self._copy_cpu_left(self._copies[i]), len(self._copies[i].writers.workers)) for i in flight]
        seconds, ends = self.machine.save_beside_copies(saved.seconds, saved.cpu_s, left)
        if ends is None:
            return seconds
        copy_ends = {i: self.now + end for i, end in zip(flight, ends, strict=True)}
        self._copies = [replace(c, ends=copy_ends[i]) if i in copy_ends else c for i, c in enumerate(self._copies)]
        if max(copy_ends.values()) <= self.now + seconds:
            self._overlapped = None
        return seconds

    def _copy_cpu_left(self, copy: _Copy) -> float:
        """The CPU a writer of ``copy`` has left to copy, on a core of its own."""
        whole = copy.writers.parts[0].nbytes / self.sim.snapshot_bytes_per_s
        if copy.begins >= self.now:
            return whole
        return whole * (copy.ends - self.now) / (copy.ends - copy.begins)

    def completed_saves(self) -> list[SaveProgress]:
        done: list[_Copy] = []
        copying: list[_Copy] = []
        for copy in self._copies:
            if copy.ends > self.now:
                copying.append(copy)
                continue
            hung = copy.writers.members.intersection(self._hung)
            if hung:  # a hung writer reports nothing (its copy is dropped when it is fenced)
                stalled = copy.without(copy.writers.members - hung)
                assert stalled is not None  # the hung writers' parts
                copying.append(stalled)
                reporting = copy.without(hung)
                if reporting is None:
                    continue
                copy = reporting
            done.append(copy)
        self._copies = copying
        progress = []
        for copy in _in_report_order(done):
            for part in copy.writers.parts:  # two slots a record name: the kept snapshot's and this one's
                slots = self._written.get(part)
                if slots is None:
                    self._written[part] = {copy.keep: False, copy.step: True}
                elif copy.keep in slots:
                    self._written[part] = {copy.keep: slots[copy.keep], copy.step: True}
                else:
                    self._written[part] = {copy.step: True}
            snapshot = self._snapshots[copy.step]
            snapshot.waiting.difference_update(copy.writers.members)
            snapshot.nbytes += copy.writers.nbytes
            snapshot.copy_s = max(snapshot.copy_s, copy.ends - copy.begins)
            snapshot.cpu_s += copy.writers.nbytes / self.sim.snapshot_bytes_per_s  # each on a core of its own
            if not snapshot.waiting:
                del self._snapshots[copy.step]
            progress.append(SaveProgress(
                copy.step, snapshot.action, copy.writers.workers, copy.writers.records, not snapshot.waiting,
                snapshot.nbytes, snapshot.copy_s, snapshot.cpu_s,
            ))  # fmt: skip
        return progress

    def _snapshot(self, step: int, action: TakeSnapshot) -> SaveReport:
        """Launch every writer's copy of a snapshot; they run beside the next iterations."""
        parts, groups = self._parts(action)
        writing = parts if parts.keys() <= self._alive else {w: p for w, p in parts.items() if w in self._alive}
        rate = self.machine.copy_bytes_per_s(len(writing))
        self._snapshots[step] = PendingSnapshot(action, set(writing))
        launched = self.now + self.sim.snapshot_launch_s
        # A writer still copying the last snapshot starts this one after it (launched in order: its last ends last).
        busy = {w: c.ends for c in self._copies if c.ends > launched for w in c.writers.workers}
        overlapping = self._overlapping(writing) if self.machine.copies_take_compute and not busy else None
        if overlapping is not None:
            ends = overlapping.copy_end
            copies = [_Copy(step, _Writers.of(pairs), action.keep, launched, launched + ends[pairs[0][0]])
                      for pairs in _by_end(writing, ends)]  # fmt: skip
        elif writing is parts and not busy:
            copies = [_Copy(step, writers, action.keep, launched, launched + writers.parts[0].nbytes / rate)
                      for writers in groups]  # fmt: skip
        else:
            starting: dict[tuple[float, int], list[tuple[int, _Part]]] = {}
            for worker, part in writing.items():
                starting.setdefault((max(launched, busy.get(worker, launched)), part.nbytes), []).append((worker, part))
            copies = [_Copy(step, _Writers.of(pairs), action.keep, begins, begins + nbytes / rate)
                      for (begins, nbytes), pairs in starting.items()]  # fmt: skip
        self._copies.extend(copies)
        for worker, armed in self._armed.items():
            if armed == (step, "snapshot") and worker in writing:  # after one record's bytes, before its commit
                copy = next(c for c in copies if worker in c.writers.members)
                share = writing[worker].records[0].nbytes / writing[worker].nbytes
                self.call_at(copy.begins + share * (copy.ends - copy.begins), self._in_copy(step, worker))
        self._launch_s += self.sim.snapshot_launch_s
        return SaveReport(0, "memory", pending=True)

    def _overlapping(self, writing: Mapping[int, _Part]) -> IterationTiming | None:
        """Where the copies take the computation's resources, the configured plan's iteration with ``writing``'s
        copies beside it (kept as the next step's timing), or None if no plan is configured."""
        configured = self._configured
        if configured is None:
            return None
        key = frozenset(writing)
        timing = configured.with_copies.get(key)
        if timing is None:
            copies = {w: part.nbytes / self.sim.snapshot_bytes_per_s for w, part in writing.items()}
            timing = self.machine.overlapped(configured.plan, configured.programs, copies)
            assert timing is not None, "asked only where copies take compute"
            configured.with_copies[key] = timing
        self._overlapped = (configured.generation, timing)
        return timing

    def _parts(self, action: TakeSnapshot) -> tuple[dict[int, _Part], list[_Writers]]:
        """Each writer's records of a snapshot (``snapshot_layout.records_to_write``), sized by the layout's
        geometry, and the writers grouped by their part's size; computed once per plan and mode."""
        if self._layout is not None:
            last, parts, groups = self._layout
            same = (last.mode, last.workers_per_node) == (action.mode, action.workers_per_node)
            if last.plan is action.plan and same:
                return parts, groups
        self._settle_memory()  # the next layout's parts may write the same names
        parts = {}
        for worker, mine in records_to_write(action.plan, action.mode, action.workers_per_node).items():
            if mine:
                sized = tuple(replace(r, nbytes=record_bytes(r, self.machine.numel(r.layers))) for r in mine)
                parts[worker] = _Part(sized, tuple(r.name for r in sized), sum(r.nbytes for r in sized))
        by_size: dict[int, list[tuple[int, _Part]]] = {}
        for worker, part in parts.items():
            by_size.setdefault(part.nbytes, []).append((worker, part))
        groups = [_Writers.of(pairs) for pairs in by_size.values()]
        self._layout = (action, parts, groups)
        self._reduced_by.clear()
        return parts, groups

    def _settle_memory(self) -> None:
        """Bring every record's slots in memory up to date with what its part has written since."""
        for part, slots in self._written.items():
            for record, name in zip(part.records, part.names):
                memory = self._memory.setdefault(record.node, {})
                before = memory.get(name, {})
                memory[name] = {step: record if own else before[step] for step, own in slots.items()
                                if own or step in before}  # fmt: skip
        self._written.clear()

    def joined(self) -> list[int]:
        ready = {n for n in self._pending_joins if n in self._nodes and self._registered_at[n] <= self.now}
        self._pending_joins -= ready
        return sorted(ready)

    # -- faults (the injector's side) ------------------------------------------------------------------------
    def workers_of(self, node: int) -> list[int]:
        return list(range(node * self.workers_per_node, (node + 1) * self.workers_per_node))

    def node_of(self, worker: int) -> int:
        return worker // self.workers_per_node

    def alive_nodes(self) -> list[int]:
        return sorted(self._nodes)

    def alive_workers(self) -> list[int]:
        return sorted(self._alive)

    def kill_node(self, node: int) -> None:
        if node not in self._nodes:
            return
        self._nodes.discard(node)
        self._settle_memory()
        self._memory.pop(node, None)  # its host memory, and every record in it
        self._nodes_unnoticed[node] = self.now + self.sim.detect_s
        self._changed()
        for worker in self.workers_of(node):
            self._hung.pop(worker, None)
            if worker in self._alive:
                self._lose(worker, self.now + self.sim.detect_s)

    def kill_worker(self, worker: int) -> None:
        if worker in self._alive:
            self._hung.pop(worker, None)
            self._lose(worker, self.now + self.sim.detect_s)

    def hang_worker(self, worker: int) -> None:
        if worker in self._alive and worker not in self._hung:
            self._hung[worker] = self.now + self.heartbeat_timeout_s

    def start_node(self, node: int, wait: bool) -> None:
        self._nodes.add(node)
        self._registered_at[node] = self.now + self.sim.node_start_s + self.machine.start_s(self.workers_per_node)
        self._pending_joins.add(node)
        self._changed()
        if wait:
            self.now = max(self.now, self._registered_at[node])
            self._register(node)
        else:
            self.call_at(self._registered_at[node], lambda: self._register(node))

    def _register(self, node: int) -> None:
        """The node's workers are up."""
        if node in self._nodes:
            for worker in self.workers_of(node):
                self._alive.add(worker)
                self._held[worker] = set()
            self._changed()

    def arm(self, worker: int, step: int, phase: str) -> None:
        self._armed[worker] = (step, phase)

    # -- costs -------------------------------------------------------------------------------------------------
    def _restored_from(
        self, source: Source | None, restored: Mapping[int, tuple[int, ...]], plan: Plan, serving: list[int]
    ) -> str:
        """memory | parity (some worker decoded a shard) | storage | "" (nothing restored), as the runtime says."""
        if source is None or not restored:
            return ""
        if isinstance(source, MemorySource):
            loads = load_plan(source, plan, serving)
            if any(g.decode for w in restored for g in loads[w].groups):
                return "parity"
        return source.kind

    def _copying(self, workers: set[int] | frozenset[int]) -> float:
        """How long until the copies in flight of ``workers`` are done."""
        return max([0.0, *(c.ends - self.now for c in self._copies if not c.writers.members.isdisjoint(workers))])

    # -- phase faults ----------------------------------------------------------------------------------------
    def _at_phase(self, worker: int, step: int, phase: str) -> Callable[[], None]:
        def stop_there() -> None:
            if worker in self._alive and self._armed.get(worker) == (step, phase):
                del self._armed[worker]
                self._publish(ev.WorkerAtPhase, worker=worker, step=step, phase=phase)

        return stop_there

    def _arm_transfers(self, plan: Plan, transfers: Mapping[int, ins.Program], begins: float) -> None:
        for worker, (armed_step, phase) in list(self._armed.items()):
            if armed_step == plan.step and phase == "transfer" and any(
                isinstance(i, ins.RecvLayer) for i in transfers.get(worker, ())
            ):
                self._step_timers.append(self.call_at(begins, self._at_phase(worker, plan.step, phase)))

    def _in_copy(self, step: int, worker: int) -> Callable[[], None]:
        """The snapshot phase fault: the writer stops in the middle of its copy (if it is still copying)."""
        stop_there = self._at_phase(worker, step, "snapshot")

        def if_copying() -> None:
            if any(c.step == step and worker in c.writers.members for c in self._copies):
                stop_there()

        return if_copying

    def _cancel_step_timers(self) -> None:
        self._cancelled.update(self._step_timers)
        self._step_timers.clear()

    # -- bookkeeping -----------------------------------------------------------------------------------------
    def _lose(self, worker: int, noticed: float) -> None:
        self._alive.discard(worker)
        self._held.pop(worker, None)
        # Its copy dies with it, unreported.
        self._copies = [c for c in (copy.without({worker}) for copy in self._copies) if c is not None]
        copying = {c.step for c in self._copies}
        self._snapshots = {s: snap for s, snap in self._snapshots.items() if s in copying}  # the rest stay incomplete
        self._dead_unnoticed[worker] = noticed
        self._changed()

    def _publish(self, kind: type[ev.Event], at: float | None = None, **fields: object) -> None:
        self.bus.publish(kind(at=self.now if at is None else at, **fields))


def _by_end(writing: Mapping[int, _Part], ends: Mapping[int, float]) -> list[list[tuple[int, _Part]]]:
    """The writers whose copies end together, with their parts."""
    together: dict[float, list[tuple[int, _Part]]] = {}
    for worker, part in writing.items():
        together.setdefault(ends[worker], []).append((worker, part))
    return list(together.values())


def _in_report_order(done: list[_Copy]) -> list[_Copy]:
    """Completed copies in the order their writers report: by the end of their copy, then by worker. Copies that
    end together are merged, their writers in worker order."""
    by_end: dict[tuple[float, int], list[_Copy]] = {}
    for copy in done:
        by_end.setdefault((copy.ends, copy.step), []).append(copy)
    ordered = []
    for (ends, step), copies in sorted(by_end.items()):
        if len(copies) == 1:
            ordered.append(copies[0])
        else:
            first = copies[0]
            merged = _Writers.of([pair for c in copies for pair in zip(c.writers.workers, c.writers.parts)])
            ordered.append(_Copy(step, merged, first.keep, min(c.begins for c in copies), ends))
    return ordered
