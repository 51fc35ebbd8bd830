"""The simulated backend: the coordinator's protocol carried out on a simulated cluster, in simulated time.

The coordinator (``runtime.control.coordinator``), the policies and the protections run unchanged: they see the same
calls answer with the same values (a plan configured, a step ready, a ``Failure``) as on real processes, and the
fault injector fires the same schedules on the simulated cluster (``runtime.sim.cluster``, the ``FaultTarget``).
Only the machines are simulated, and what each wait costs is the job's machine's (``runtime.sim.machines``), the one
its policies predict with.

Time advances by events, never by ticks (``runtime.sim.clock``). A call that waits (a step, a configuration, a
restart, a save, an abort) moves the clock to when the wait would end, unless something happens first: a timer of
the fault injector fires (a kill, a hang, a join) or a failure is noticed (``SimCluster.wait``).

What each wait costs:
- a step: the plan's programs executed instruction by instruction on the machine (``runtime.sim.timing``), up to
  every worker's ReduceGrads; then the commit (``sim.control_s``) and the slowest optimizer step. **One iteration is
  simulated per plan and reused for every step of it: the iterations of one plan are identical** (same programs,
  same costs), so the clock of step k of a plan is its start plus k periods.
- a configuration: ``SimMachine.configuring`` (programs, process groups, buffers; then the layer copies, building,
  decoding and restoring), after the workers it needs finish the snapshot they are copying.
- a restart: every worker process starts again (``SimMachine.restart_s``).
- a save: each protection ``Action`` kind has a cost (``register_action``); a storage checkpoint encodes each
  writer's layers (in parallel) and writes them all at ``sim.storage_write_bytes_per_s``, beside the snapshot
  copies in flight (REFT's flush follows its step's snapshot: ``SnapshotMemory.beside_save``).
- a REFT snapshot (``TakeSnapshot``) is asynchronous, as on the runtime (``runtime.sim.memory``): ``save`` returns at
  once, the launch delays the next step by ``sim.snapshot_launch_s``, and a writer reports ready once its gradients
  are reduced and its copy is done (``StepReport.snapshot_s`` is the launch plus the longest such wait).
- an abort: ``sim.abort_s``, or longer while a survivor finishes the snapshot it is copying.

A simulated step has no loss (``StepReport.loss`` is NaN): nothing is computed but time.

Phase faults are simulated where the worker would stop: at its first instruction of the phase (forward, backward,
reduce) in the timed iteration, at the commit (optimizer), at the first layer a writer saves (checkpoint), in the
middle of its snapshot copy (snapshot), at the first layer a worker receives (transfer).

``sim.horizon_s`` ends the job when the clock would pass it (``HorizonReached``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ftlab.runtime.control import events as ev
from ftlab.runtime.control.backend import (
    Backend, ConfigureReport, Failure, Interrupted, Membership, SaveProgress, SaveReport, StepReport, WorkerCrashed,
)
from ftlab.runtime.control.update import Update
from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.contract import Action, MemorySource, SaveCheckpoint, Source, TakeSnapshot
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.core.snapshot_layout import load_plan
from ftlab.runtime.sim.clock import Clock
from ftlab.runtime.sim.cluster import HorizonReached, SimCluster
from ftlab.runtime.sim.fault_free import FaultFreeBound
from ftlab.runtime.sim.machines import SimMachine
from ftlab.runtime.sim.memory import Part, SnapshotMemory
from ftlab.runtime.sim.timing import IterationTiming

__all__ = ["HorizonReached", "SimBackend", "SimSave", "register_action"]


@dataclass(frozen=True)
class SimSave:
    """What carrying out a protection's action costs: seconds the coordinator waits, bytes saved, where."""

    seconds: float
    nbytes: int
    location: str
    cpu_s: Mapping[int, float] = field(default_factory=dict)
    """Each writer's CPU in ``seconds`` that runs side by side with the others', on a core of its own (a storage
    checkpoint's encoding): where copies take compute, it shares it with the snapshot copies in flight."""


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


@dataclass(frozen=True)
class _Configured:
    """The plan configured last: its generation, iteration timing and workers, its programs, and where copies take
    compute, its iteration with snapshot copies beside it, by the writers copying."""

    generation: int
    timing: IterationTiming
    workers: frozenset[int]
    plan: Plan
    programs: Mapping[int, ins.Program]
    with_copies: dict[frozenset[int], IterationTiming] = field(default_factory=dict)


class SimBackend(Backend):
    def __init__(
        self, nodes: int, workers_per_node: int, machine: SimMachine, heartbeat_timeout_s: float, bus: ev.EventBus
    ) -> None:
        self.machine = machine
        """What everything costs (``runtime.sim.machines``): the one model the policies predict with too."""
        self.sim = machine.sim
        self.bus = bus
        self.time = Clock()
        self.memory = SnapshotMemory(machine, self.time)
        self.cluster = SimCluster(
            nodes, workers_per_node, machine, heartbeat_timeout_s, bus, self.time, self.memory.lose_writer,
            self.memory.lose_node,
        )  # fmt: skip
        """Who is alive and what each holds: the fault injector's target."""
        self._step_timers: list[int] = []
        self._configured: _Configured | None = None
        """The plan configured last: the only one that runs steps (the coordinator configures a plan before it trains
        it), so no other plan's timing is kept for a whole simulated day of plans."""
        self._layers_dropped = True
        self._step_started = 0.0
        self._launch_s = 0.0
        """The launch of a snapshot taken since the last step began: it delays the next one."""
        self._launched: float | None = None
        """The launch the running step began after (None: no snapshot since the step before)."""
        self._overlapped: tuple[int, IterationTiming] | None = None
        """Where copies take compute, the next step's timing with the copies launched since the last step beside
        it, and the generation of the plan it was timed on."""
        self._step_timing: IterationTiming | None = None
        """The running step's timing: its plan's, or with the copies that overlap it."""
        self.bound = FaultFreeBound()
        """Every plan configured, held to the fault-free plan's samples/s (``runtime.sim.fault_free``)."""

    # -- the clock and who is who ------------------------------------------------------------------------------
    def clock(self) -> float:
        return self.time.now

    def call_at(self, at: float, action: Callable[[], None]) -> int:
        """Run ``action`` when the simulated clock reaches ``at`` (the fault injector's timer)."""
        return self.time.call_at(at, action)

    def membership(self) -> Membership:
        return self.cluster.membership()

    def joined(self) -> list[int]:
        return self.cluster.joined()

    # -- the protocol ------------------------------------------------------------------------------------------
    def restart_workers(self) -> Failure | None:
        cluster = self.cluster
        cluster.restart()  # joining nodes start on beside it: no restart waits for them
        self.memory.restart()
        self._launch_s = 0.0
        slots = {node: tuple(cluster.workers_of(node)) for node in sorted(cluster.members())}
        failure = cluster.wait(self.time.now + self.machine.restart_s(slots), needs=set())
        for node in failure.nodes if failure else ():
            self._publish(ev.NodeLostWhileStarting, node=node)
        return failure

    def configure(
        self, plan: Plan, programs: Mapping[int, ins.Program], transfers: Mapping[int, ins.Program], restore: Source | None
    ) -> ConfigureReport | Failure:
        cluster = self.cluster
        timing = self.machine.iteration(plan, programs)
        ranges = plan.layer_ranges()
        needs = frozenset(ranges)
        started = self.time.now + self.memory.copying(needs)  # a worker finishes its snapshot first
        serving = [w for w in sorted(cluster.alive) if w not in needs]
        cost = self.machine.configuring(plan, transfers, restore, cluster.held, serving)
        # A worker that died unnoticed lacks its layers too; the wait below ends with its failure instead.
        if cost.unprovided is not None and plan.step != 0 and cost.unprovided[0] in cluster.alive:
            worker, layer = cost.unprovided
            raise WorkerCrashed(
                f"worker {worker} crashed:\nRuntimeError: layer {layer} is missing at step {plan.step} and nothing "
                f"provides it"
            )
        restored_from = _restored_from(restore, cost.restored, plan, serving)
        self._arm_transfers(plan, transfers, started + cost.configure_s)
        failure = cluster.wait(started + cost.seconds, needs=needs)
        if failure:
            return failure
        for worker in cost.gaining:  # the others hold their stage already
            cluster.held.setdefault(worker, set()).update(range(*ranges[worker]))
        for worker, layers in cost.received.items():  # a copy kept beside the stage (Bamboo) is held too
            cluster.held.setdefault(worker, set()).update(layers)
        self._configured = _Configured(plan.generation, timing, needs, plan, programs)
        self.bound.timed(plan, self.machine.period_s(timing))
        self._overlapped = None
        self.memory.forget_reductions()
        self._layers_dropped = False
        checkpoint_bytes = self.machine.checkpoint_bytes
        return ConfigureReport(
            received_bytes=int(sum(checkpoint_bytes(layers) for layers in cost.received.values())),
            restored_bytes=int(sum(checkpoint_bytes(layers) for layers in cost.restored.values())),
            restore_s=cost.restore_s, restored_from=restored_from,
        )  # fmt: skip

    def verify(self, source: Source) -> Source | str | Failure:
        """Simulated saved state is never corrupt, but memory is lost with its node and slots are overwritten."""
        return self.memory.verify(source, self.cluster.nodes)

    def begin_step(self, plan: Plan, step: int, loss_scale: float = 1.0) -> None:
        timing = self._running(plan).timing
        overlapped, self._overlapped = self._overlapped, None
        if overlapped is not None and overlapped[0] == plan.generation:
            timing = overlapped[1]
        if timing is not self._step_timing:  # the groups' ReduceGrads ends are the step timing's
            self.memory.forget_reductions()
            self._step_timing = timing
        self._launched, self._launch_s = (self._launch_s if self._launch_s else None), 0.0
        self._step_started = self.time.now + (self._launched or 0.0)
        if not self._layers_dropped:  # a plan's first step drops the layers it no longer runs
            programs = self._running(plan).programs
            for worker, (start, stop) in plan.layer_ranges().items():
                held = self.cluster.held.get(worker)
                # Configured, a worker holds its stage and maybe more (or nothing, restarted since): it holds more
                # than its stage exactly when it holds more layers.
                if held is not None and len(held) > stop - start:
                    held.intersection_update({*range(start, stop), *(ins.kept_copy(programs[worker]) or ())})
            self._layers_dropped = True
        for worker, (armed_step, phase) in list(self.cluster.armed.items()):
            at = timing.phase_at(worker, phase) if armed_step == step and worker in timing.reduce_end else None
            if at is not None:
                self._step_timers.append(self.call_at(self._step_started + at, self._at_phase(worker, step, phase)))

    def finish_step(
        self, plan: Plan, step: int, interrupted: Callable[[], bool] = lambda: False
    ) -> StepReport | Failure | Interrupted:
        needs = self._running(plan).workers
        timing = self._step_timing
        assert timing is not None, "a step finished that never began"
        # A writer reports ready once its gradients are reduced and its copy is done.
        ready, longest = self.memory.step_ready(needs, self._step_started, timing)
        ended = self.cluster.wait(ready, needs=needs, interrupted=interrupted)
        self._cancel_step_timers()
        if ended:
            return ended
        snapshot_s = None
        if self._launched is not None or longest is not None:
            snapshot_s = (self._launched or 0.0) + (longest or 0.0)
        return StepReport(loss=math.nan, compute_s=timing.compute_s, snapshot_s=snapshot_s)

    def commit(self, plan: Plan, step: int, update: Update = Update()) -> None:
        """The simulator computes no gradients, so no norm is ever reported and every update is the plain one."""
        for worker, (armed_step, phase) in list(self.cluster.armed.items()):
            if armed_step == step and phase == "optimizer" and worker in self._running(plan).workers:
                self._at_phase(worker, step, phase)()
        self.time.advance(self.time.now + self.sim.control_s + self._running(plan).timing.optimizer_s)

    def _running(self, plan: Plan) -> _Configured:
        assert self._configured is not None and self._configured.generation == plan.generation, "plan not configured"
        return self._configured

    def abort(self, plan: Plan, failure: Failure, committed: int) -> dict[int, tuple[int, ...]]:
        cluster = self.cluster
        self._cancel_step_timers()
        # Survivors finish their copies first.
        until = self.time.now + max(self.sim.abort_s, self.memory.copying(cluster.alive))
        while (more := cluster.wait(until, needs=set())) is not None:
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
            if worker in cluster.alive:
                held, (start, stop) = cluster.held[worker], ranges[worker]
                exact = len(held) == stop - start and held.issuperset(range(start, stop))
                holdings[worker] = stages[(start, stop)] if exact else tuple(sorted(held))
        return holdings

    def save(
        self, step: int, action: Action, writers: Mapping[int, tuple[int, ...]], num_layers: int,
        manifest: Mapping[str, object] | None = None,
    ) -> SaveReport | Failure:  # fmt: skip
        if isinstance(action, TakeSnapshot):
            return self._snapshot(step, action)
        cost = _ACTIONS.get(type(action))
        if cost is None:
            raise NotImplementedError(
                f"the simulator has no cost for {type(action).__name__}: register one with "
                f"runtime.sim.backend.register_action"
            )
        saved = cost(action, step, writers, self.machine)
        seconds, copies_done = self.memory.beside_save(saved.seconds, saved.cpu_s)
        if copies_done:  # the next iteration runs without the copies its timing had beside it
            self._overlapped = None
        started = self.time.now
        for worker, (armed_step, phase) in list(self.cluster.armed.items()):
            if armed_step == step and phase == "checkpoint" and writers.get(worker):
                first = self.machine.checkpoint_bytes(writers[worker][:1]) / self.machine.codec_bytes_per_s
                self._step_timers.append(self.call_at(started + first, self._at_phase(worker, step, phase)))
        failure = self.cluster.wait(started + seconds, needs=set(writers))
        self._cancel_step_timers()
        if failure:
            return failure
        return SaveReport(saved.nbytes, saved.location)

    def completed_saves(self) -> list[SaveProgress]:
        return self.memory.completed(self.cluster.hung)

    def _snapshot(self, step: int, action: TakeSnapshot) -> SaveReport:
        """Launch every writer's copy of a snapshot; they run beside the next iterations."""
        copies, writing = self.memory.launch(step, action, self.cluster.alive, self._overlapping)
        for worker, armed in self.cluster.armed.items():
            if armed == (step, "snapshot") and worker in writing:  # after one record's bytes, before its commit
                copy = next(c for c in copies if worker in c.writers.members)
                share = writing[worker].records[0].nbytes / writing[worker].nbytes
                self.call_at(copy.begins + share * (copy.ends - copy.begins), self._in_copy(step, worker))
        self._launch_s += self.sim.snapshot_launch_s
        return SaveReport(0, "memory", pending=True)

    def _overlapping(self, writing: Mapping[int, Part]) -> IterationTiming | None:
        """The configured plan's iteration with ``writing``'s copies beside it, where the copies take compute (kept
        as the next step's timing), or None if no plan is configured."""
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

    # -- phase faults ------------------------------------------------------------------------------------------
    def _at_phase(self, worker: int, step: int, phase: str) -> Callable[[], None]:
        def stop_there() -> None:
            if worker in self.cluster.alive and self.cluster.armed.get(worker) == (step, phase):
                del self.cluster.armed[worker]
                self._publish(ev.WorkerAtPhase, worker=worker, step=step, phase=phase)

        return stop_there

    def _arm_transfers(self, plan: Plan, transfers: Mapping[int, ins.Program], begins: float) -> None:
        for worker, (armed_step, phase) in list(self.cluster.armed.items()):
            if armed_step == plan.step and phase == "transfer" and any(
                isinstance(i, ins.RecvLayer) for i in transfers.get(worker, ())
            ):
                self._step_timers.append(self.call_at(begins, self._at_phase(worker, plan.step, phase)))

    def _in_copy(self, step: int, worker: int) -> Callable[[], None]:
        """The snapshot phase fault: the writer stops in the middle of its copy (if it is still copying)."""
        stop_there = self._at_phase(worker, step, "snapshot")

        def if_copying() -> None:
            if self.memory.copies_of(step, worker):
                stop_there()

        return if_copying

    def _cancel_step_timers(self) -> None:
        self.time.cancel(self._step_timers)
        self._step_timers.clear()

    def _publish(self, kind: type[ev.Event], **fields: object) -> None:
        self.bus.publish(kind(at=self.time.now, **fields))


def _restored_from(
    source: Source | None, restored: Mapping[int, tuple[int, ...]], plan: Plan, serving: list[int]
) -> str:
    """memory | parity (some worker decoded a shard) | storage | "" (nothing restored), as the runtime says."""
    if source is None or not restored:
        return ""
    if isinstance(source, MemorySource):
        loads = load_plan(source, plan, serving)
        if any(g.decode for w in restored for g in loads[w].groups):
            return "parity"
    return source.kind
