"""The local backend: the coordinator's protocol carried out by real processes (``runtime.processes.cluster``).

Every message and closed connection from agents and workers arrives on the cluster's one event queue, which this
backend reads from the coordinator's thread: membership changes and step results are handled in the order they
happened, with no locks in the protocol. While it waits for one kind of message (Ready, Configured, ...), any sign of
a death (a closed connection, an agent's report of a worker's exit, a heartbeat missed for
``heartbeat_timeout_s``) ends the wait with a ``Failure``; a short window then lets the rest of the failure arrive
(a node's agent and workers report apart, and simultaneous kills should be one recovery). A worker that reports a
failed operation (``Failed``) while no death explains it for ``heartbeat_timeout_s`` is fenced, as a hung one is:
it waits for an abort that only a failure brings.

Snapshots (``TakeSnapshot``) are asynchronous: ``save`` hands each writer its records and returns; each writer's
``Snapshotted`` report arrives later, among the other messages, and is passed on by ``completed_saves``. A restore
from memory is verified first: every live agent takes an inventory of its node's records of the step (checksums
included), and a record that is missing or corrupted is left out of the source. Live workers outside the new plan
join its generation as helpers, so that the records only their node holds can still be sent.

A joining node starts in the background (``start_node`` returns at once) and stays outside the membership until
``joined`` finds, at an iteration boundary, that its agent and every worker of it have registered: no plan, restart or
helper counts on it before. A joining node that dies or does not come up within ``_RESTART_TIMEOUT_S`` is given up
with a ``NodeLostWhileStarting`` event; the job never waits for it and never recovers from it.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ftlab.runtime.state import checkpoint
from ftlab.runtime.control import events as ev
from ftlab.runtime.processes import messages as msg
from ftlab.runtime.control.backend import (
    Backend, ConfigureReport, Failure, FaultTarget, Interrupted, Membership, PendingSnapshot, SaveProgress, SaveReport,
    StepReport, WorkerCrashed,
)  # fmt: skip
from ftlab.runtime.processes.cluster import ClusterEvent, LocalCluster, NodeLost
from ftlab.runtime.control.update import Update
from ftlab.runtime.core.contract import Action, MemorySource, SaveCheckpoint, Source, TakeSnapshot
from ftlab.runtime.core.snapshot_layout import lost_shards, records_to_write
from ftlab.runtime.core.instructions import Program
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.processes.hold import hold, step_point

M = TypeVar("M")

# After the first sign of a failure, wait this long for the rest of it (a node's agent and workers report apart).
_FAILURE_WINDOW_S = 0.3
_POLL_S = 0.2
_RESTART_TIMEOUT_S = 300.0


class LocalBackend(Backend, FaultTarget):
    def __init__(self, cluster: LocalCluster, bus: ev.EventBus, setup: dict[str, Any], heartbeat_timeout_s: float) -> None:
        self.cluster = cluster
        self.bus = bus
        self.setup = setup
        """Model, training and data settings every worker needs; sent with each Configure."""
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._joining: dict[int, float] = {}
        """Nodes starting and not offered yet (``joined``), with when they started; outside the membership."""
        self._joining_lock = threading.Lock()
        """``start_node`` runs on the fault injector's thread too, beside the coordinator's."""
        self._abandoned: set[int] = set()
        """Joining nodes given up: the signs of their deaths are no failure of the job."""
        self._snapshots: dict[int, PendingSnapshot] = {}
        """Snapshots in flight, by step."""
        self._progress: list[SaveProgress] = []
        self._helpers: dict[int, tuple[int, ...]] = {}
        """The helpers of each generation configured with some."""
        self._configured: Plan | None = None

    def clock(self) -> float:
        return time.monotonic()

    def membership(self) -> Membership:
        alive = set(self.cluster.alive_workers())
        nodes = self._member_nodes()
        workers = {n: tuple(w for w in self.cluster.workers_of(n) if w in alive) for n in nodes}
        return Membership(
            workers_of_node={n: ws for n, ws in workers.items() if ws},
            slots_of_node={n: tuple(self.cluster.workers_of(n)) for n in nodes},
        )

    # -- the protocol ------------------------------------------------------------------------------------------
    def configure(
        self, plan: Plan, programs: Mapping[int, Program], transfers: Mapping[int, Program], restore: Source | None
    ) -> ConfigureReport | Failure:
        helpers: tuple[int, ...] = ()
        if isinstance(restore, MemorySource):
            members = {w for n in self._member_nodes() for w in self.cluster.workers_of(n)}
            helpers = tuple(w for w in self.cluster.alive_workers() if w in members and w not in plan.workers)
            self._helpers[plan.generation] = helpers
        for worker in (*plan.workers, *helpers):
            configure = msg.Configure(
                plan.to_dict(), programs.get(worker, []), self.cluster.store_port, self.setup, restore,
                tuple(transfers.get(worker, ())), helpers,
            )  # fmt: skip
            self.cluster.send(worker, configure)
        done = self._collect({*plan.workers, *helpers}, msg.Configured, lambda m: m.generation == plan.generation)
        if isinstance(done, Failure):
            return done
        self._configured = plan
        sources = {m.restored_from for m in done.values()} - {""}
        return ConfigureReport(
            received_bytes=sum(m.received_bytes for m in done.values()),
            restored_bytes=sum(m.restored_bytes for m in done.values()),
            restore_s=max(m.restore_s for m in done.values()),
            restored_from="parity" if "parity" in sources else next(iter(sorted(sources)), ""),
        )

    def verify(self, source: Source) -> Source | str | Failure:
        if not isinstance(source, MemorySource):
            return source
        nodes = set(self.cluster.alive_nodes())
        for node in nodes:
            self.cluster.send_agent(node, msg.TakeInventory(source.step))
        found = self._collect(nodes, msg.Inventory, lambda m: m.step == source.step, role="agent")
        if isinstance(found, Failure):
            return found
        intact = []
        for record in source.records:
            report = found.get(record.node)
            if report is None:
                continue
            if record.name in report.corrupt:
                self._publish(ev.RecordCorrupted, node=record.node, record=record.name, step=source.step)
            elif report.intact.get(record.name) == record.crc:
                intact.append(record)
        lost = lost_shards(source.plan, intact)
        if lost:
            return f"the records left in memory cannot rebuild {'; '.join(lost)}"
        return dataclasses.replace(source, records=tuple(intact))

    def begin_step(self, plan: Plan, step: int, loss_scale: float = 1.0) -> None:
        hold(step_point(step))  # where a test holds training at a step (``runtime.processes.hold``)
        for worker in plan.workers:
            self.cluster.send(worker, msg.RunStep(step, loss_scale))

    def finish_step(
        self, plan: Plan, step: int, interrupted: Callable[[], bool] = lambda: False
    ) -> StepReport | Failure | Interrupted:
        ready = self._collect(set(plan.workers), msg.Ready, lambda m: m.step == step, interrupted=interrupted)
        if isinstance(ready, (Failure, Interrupted)):
            return ready
        snapshot = [r.snapshot_s for r in ready.values() if r.snapshot_s is not None]
        return StepReport(
            loss=sum(r.loss for r in ready.values()),
            compute_s=max(r.compute_s for r in ready.values()),
            snapshot_s=max(snapshot) if snapshot else None,
            grad_sq=_pieces(ready),
        )

    def commit(self, plan: Plan, step: int, update: Update = Update()) -> None:
        for worker in plan.workers:
            self.cluster.send(worker, msg.Commit(step, update))

    def abort(self, plan: Plan, failure: Failure, committed: int) -> dict[int, tuple[int, ...]]:
        survivors = {*plan.workers, *self._helpers.get(plan.generation, ())} & set(self.cluster.alive_workers())
        for worker in survivors:
            self.cluster.abort(worker, msg.Abort(plan.generation))
        # Acknowledgements that came before a failure interrupted the wait are kept: a survivor answers once.
        acknowledged: dict[int, msg.AbortDone] = {}
        while True:
            done = self._collect(survivors, msg.AbortDone, lambda m: m.generation == plan.generation, got=acknowledged)
            if not isinstance(done, Failure):
                break
            failure.merge(done)  # a failure during the abort: fold it in, wait for the rest
            survivors &= set(self.cluster.alive_workers())
            acknowledged = {w: m for w, m in acknowledged.items() if w in survivors}
        # The invariant every policy relies on: no two replicas of a layer at different steps. (Workers restarted
        # a moment ago hold no layer yet.)
        behind = {w: m.step for w, m in done.items() if m.layers and m.step != committed}
        assert not behind, f"workers {behind} are not at the committed step {committed}"
        return {w: m.layers for w, m in done.items()}

    def save(
        self, step: int, action: Action, writers: Mapping[int, tuple[int, ...]], num_layers: int,
        manifest: Mapping[str, object] | None = None,
    ) -> SaveReport | Failure:  # fmt: skip
        if isinstance(action, TakeSnapshot):
            return self._snapshot(step, action)
        assert isinstance(action, SaveCheckpoint), f"the local backend cannot carry out {action!r}"
        if self.setup["zero"] and self._configured is not None:
            # ZeRO-1: every member gathers its groups' optimizer chunks, so every worker of the plan takes part.
            dead = set(self._configured.workers) - set(self.cluster.alive_workers())
            if dead:
                return Failure(workers={w: self.clock() for w in dead})
            writers = {w: writers.get(w, ()) for w in self._configured.workers}
        for worker, layers in writers.items():
            self.cluster.send(worker, msg.SaveCheckpoint(step, action.directory, layers))
        saved = self._collect(set(writers), msg.Saved, lambda m: m.step == step)
        if isinstance(saved, Failure):
            return saved
        nbytes = sum(s.nbytes for s in saved.values())
        errors = [s.error for s in saved.values() if s.error is not None]
        if not errors:
            try:
                directory = checkpoint.write_manifest(action.directory, step, num_layers, dict(manifest or {}))
            except OSError as exc:
                errors = [checkpoint.write_error(exc, checkpoint.step_dir(action.directory, step) / checkpoint.MANIFEST)]
        if errors:  # every writer has stopped: what they wrote goes, so the failed save holds no space
            checkpoint.abandon(action.directory, step)
            free = checkpoint.free_bytes(action.directory) / 2**20
            return SaveReport(nbytes, str(checkpoint.step_dir(action.directory, step)),
                              failed=f"{errors[0]} ({free:.1f} MiB free there)")  # fmt: skip
        if action.keep:
            checkpoint.prune(action.directory, action.keep)
        return SaveReport(nbytes, str(directory))

    def _snapshot(self, step: int, action: TakeSnapshot) -> SaveReport:
        records = records_to_write(action.plan, action.mode, action.workers_per_node)
        for worker, mine in records.items():
            self.cluster.send(worker, msg.TakeSnapshot(step, action.keep, tuple(mine)))
        self._snapshots[step] = PendingSnapshot(action, set(records))
        return SaveReport(0, "memory", pending=True)

    def completed_saves(self) -> list[SaveProgress]:
        done, self._progress = self._progress, []
        return done

    def _snapshotted(self, worker: int, report: msg.Snapshotted) -> None:
        snapshot = self._snapshots.get(report.step)
        if snapshot is None or worker not in snapshot.waiting:
            return
        snapshot.waiting.discard(worker)
        snapshot.nbytes += sum(r.nbytes for r in report.records)
        snapshot.copy_s = max(snapshot.copy_s, report.copy_s)
        snapshot.cpu_s += report.cpu_s
        snapshot.failed |= report.error is not None
        if not snapshot.waiting:
            del self._snapshots[report.step]
        complete = not snapshot.waiting and not snapshot.failed
        self._progress.append(SaveProgress(report.step, snapshot.action, (worker,), report.records, complete,
                                           snapshot.nbytes, snapshot.copy_s, snapshot.cpu_s, report.error))  # fmt: skip

    def restart_workers(self) -> Failure | None:
        """End every worker process of the membership's nodes and start fresh ones there.

        Nodes still joining are left to start on their own: they are in no plan yet, and are offered once up.
        """
        nodes = self._member_nodes()
        alive = set(self.cluster.alive_workers())
        ending = [w for n in nodes for w in self.cluster.workers_of(n) if w in alive]
        for worker in ending:
            self.cluster.kill_worker(worker)
            self.cluster.mark_dead("worker", worker)
        self._snapshots.clear()  # copies in flight die with their workers: those snapshots stay incomplete
        joining = set(self.cluster.alive_nodes()) - set(nodes)
        for member in [m for m in self.cluster.workers.values() if m.node not in joining]:
            self.cluster.wait_gone(member)
        failure = self._drain_events()
        expected: set[int] = set()
        for node in nodes:
            expected |= self.cluster.respawn(node)
        lost = self._wait_for(expected, watch=nodes)
        if lost:
            failure.merge(lost)
        return failure or None

    def joined(self) -> list[int]:
        """The joining nodes up now (agent and every worker registered), each offered once; a node that has been
        starting for longer than ``_RESTART_TIMEOUT_S`` is given up."""
        alive, exited = set(self.cluster.alive_workers()), set(self.cluster.exited_agents())
        agents = set(self.cluster.alive_nodes())
        with self._joining_lock:
            joining = dict(self._joining)
        ready = [n for n in sorted(joining)
                 if n in agents and n not in exited and set(self.cluster.workers_of(n)) <= alive]  # fmt: skip
        late = [n for n, started in joining.items() if n not in ready and self.clock() - started > _RESTART_TIMEOUT_S]
        for node in late:
            self._abandon(node, f"it did not come up within {_RESTART_TIMEOUT_S:.0f} s")
        with self._joining_lock:  # one given up meanwhile (a kill on the injector's thread) is not offered
            return [n for n in ready if self._joining.pop(n, None) is not None]

    def _member_nodes(self) -> list[int]:
        """Live nodes that are members: every live node but those still joining (or given up, whose agent may
        register after all, only to be ended)."""
        with self._joining_lock:
            outside = set(self._joining) | self._abandoned
        return [n for n in self.cluster.alive_nodes() if n not in outside]

    def _joining_node(self, node: int) -> bool:
        with self._joining_lock:
            return node in self._joining

    def _abandon(self, node: int, reason: str) -> None:
        """Give up a joining node that failed to start: logged, and no failure of the job (it is in no plan)."""
        with self._joining_lock:
            self._joining.pop(node, None)
        self._abandoned.add(node)
        self.cluster.abandon_node(node)
        self._publish(ev.NodeLostWhileStarting, node=node, reason=reason)

    # -- faults (the injector's side) ---------------------------------------------------------------------------
    def workers_of(self, node: int) -> list[int]:
        return self.cluster.workers_of(node)

    def alive_nodes(self) -> list[int]:
        """Live nodes, those still joining included (a fault may take one down while it starts)."""
        with self._joining_lock:
            joining = set(self._joining)
        return sorted(set(self.cluster.alive_nodes()) | joining)

    def alive_workers(self) -> list[int]:
        return self.cluster.alive_workers()

    def kill_node(self, node: int) -> None:
        if self._joining_node(node):
            self._abandon(node, "killed while it started")  # at once: no sign of it has to arrive first
            return
        self.cluster.kill_node(node)

    def kill_worker(self, worker: int) -> None:
        self.cluster.kill_worker(worker)

    def hang_worker(self, worker: int) -> None:
        self.cluster.kill_worker(worker, signal.SIGSTOP)

    def resume_worker(self, worker: int) -> None:
        self.cluster.kill_worker(worker, signal.SIGCONT)

    def start_node(self, node: int) -> None:
        with self._joining_lock:
            self._joining[node] = self.clock()
        self.cluster.start_node(node)  # launches the agent and returns: its workers register while training goes on

    def arm(self, worker: int, step: int, phase: str) -> None:
        self.cluster.send(worker, msg.ArmFault(step, phase))

    # -- waiting for messages ----------------------------------------------------------------------------------
    def _collect(
        self, expected: set[int], kind: type[M], accept: Callable[[M], bool], role: str = "worker",
        got: dict[int, M] | None = None, interrupted: Callable[[], bool] = lambda: False,
    ) -> dict[int, M] | Failure | Interrupted:
        """One ``kind`` message from every expected worker (or agent), or the Failure that interrupted the wait, or
        Interrupted once ``interrupted`` answers True (asked before every event and quiet poll).
        ``got``: the messages already received, which this wait adds to (and which outlive an interrupted one)."""
        got = {} if got is None else got
        failed: dict[int, tuple[float, str]] = {}  # workers waited for that reported a failed operation instead

        def awaited(event: ClusterEvent) -> bool:
            if event.role == role and isinstance(event.message, kind) and accept(event.message):
                got[event.ident] = event.message
                return True
            return False

        while not expected <= got.keys():
            if interrupted():
                return Interrupted()
            failure = Failure()
            event = self._next_event(failure)
            if failure:
                # What the failure window brings is kept too: a caller that waits on after the failure (an abort
                # that a death interrupted) would otherwise wait for ever for the acknowledgements it swallowed.
                failure.merge(self._gather(awaited))
                return failure
            self._fence_unexplained(failed, expected - got.keys())
            if event is None:
                continue
            message = event.message
            if not awaited(event) and isinstance(message, msg.Failed):
                self._publish(ev.CommError, worker=event.ident, error=message.error)
                if event.role == role:
                    failed.setdefault(event.ident, (self.clock(), message.error))
        return got

    def _fence_unexplained(self, failed: dict[int, tuple[float, str]], awaited: set[int]) -> None:
        """Fence the first worker whose failed operation no death has explained for ``heartbeat_timeout_s``, the
        longest a death takes to be noticed. A worker that reports ``Failed`` waits for an abort, which only a failure
        brings: with every member alive (a stall past ``comm_timeout_s``, a dropped link), the wait would never end.
        Its death is the failure the job then recovers from, as from a hung worker's."""
        waiting = {w: f for w, f in failed.items() if w in awaited}
        if not waiting:
            return
        worker, (since, error) = min(waiting.items(), key=lambda item: item[1][0])
        waited = self.clock() - since
        if waited < self.heartbeat_timeout_s:
            return
        del failed[worker]
        self._publish(ev.CommErrorFenced, worker=worker, error=error, waited_s=waited)
        self.cluster.kill_worker(worker)  # its exit arrives as any death does, and ends the wait

    def _next_event(self, failure: Failure) -> ClusterEvent | None:
        """The next event, or None after a quiet poll; records failures it sees into ``failure``."""
        try:
            event = self.cluster.events.get(timeout=_POLL_S)
        except queue.Empty:  # a quiet moment: check for hung workers
            for worker in self.cluster.silent_workers(self.heartbeat_timeout_s):
                self._publish(ev.HangDetected, worker=worker, timeout_s=self.heartbeat_timeout_s)
                self.cluster.kill_worker(worker)  # fence it: a hung worker must never come back
            return None
        self._classify(event, failure)
        return event

    def _classify(self, event: ClusterEvent, failure: Failure) -> None:
        message = event.message
        if isinstance(message, msg.Crashed):
            raise WorkerCrashed(f"{event.role} {event.ident} crashed:\n{message.error}")
        if isinstance(message, msg.AtPhase):
            self._publish(ev.WorkerAtPhase, worker=event.ident, step=message.step, phase=message.phase)
            return
        if isinstance(message, msg.Snapshotted):
            self._snapshotted(event.ident, message)
            return
        if isinstance(message, msg.Hello):
            if message.role == "agent":  # a node joining (one started by hand, too)
                with self._joining_lock:
                    self._joining.setdefault(message.node, event.at)
            return
        if self._lost_while_joining(event):
            return
        if isinstance(message, msg.WorkerExited):
            self._lose_worker(message.worker, message.pid, event.at, failure)
        elif event.role == "worker" and message is None:
            self._lose_worker(event.ident, event.pid, event.at, failure)
        elif event.role == "agent" and message is None and self.cluster.agents[event.ident].alive:
            node = event.ident
            self.cluster.mark_dead("agent", node)
            self.cluster.lose_memory(node)
            failure.nodes[node] = event.at
            for worker in self.cluster.workers_of(node):
                self.cluster.kill_worker(worker)  # a lost node loses all of its workers
                member = self.cluster.workers.get(worker)
                if member is not None:
                    self._lose_worker(worker, member.pid, event.at, failure)
                else:  # one a restart was starting: lost with its node all the same
                    failure.workers.setdefault(worker, event.at)

    def _lost_while_joining(self, event: ClusterEvent) -> bool:
        """Whether ``event`` is the death of a joining (or given-up) node's agent or worker: then the node is given
        up, and the event is no failure of the job."""
        message = event.message
        if isinstance(message, msg.WorkerExited):
            node, what = self.cluster.node_of(message.worker), f"worker {message.worker} exited"
        elif message is None:
            node = event.ident if event.role == "agent" else self.cluster.node_of(event.ident)
            what = "its agent exited" if event.role == "agent" else f"worker {event.ident} exited"
        else:
            return False
        if node in self._abandoned:
            return True
        if not self._joining_node(node):
            return False
        self._abandon(node, f"{what} while it started")
        return True

    def _lose_worker(self, worker: int, pid: int, at: float, failure: Failure) -> None:
        """Record a worker's death once, the first time any sign of it arrives; the signs of an earlier process
        of the same worker id (one a restart ended) are not its death."""
        member = self.cluster.workers.get(worker)
        if member is not None and member.alive and member.pid == pid:
            self.cluster.mark_dead("worker", worker)
            failure.workers[worker] = at

    def _gather(self, awaited: Callable[[ClusterEvent], object]) -> Failure:
        """Let the rest of a failure arrive (the other half of a node, simultaneous kills); every other event of the
        window goes to ``awaited``."""
        failure = Failure()
        deadline = time.monotonic() + _FAILURE_WINDOW_S
        while time.monotonic() < deadline:
            try:
                event = self.cluster.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self._classify(event, failure)
            awaited(event)
        return failure

    def _wait_for(self, workers: set[int], watch: list[int]) -> Failure | None:
        """Wait for workers to register; any node of ``watch`` that dies meanwhile is a failure to recover from at
        once."""
        try:
            self.cluster.wait_for_workers(workers, _RESTART_TIMEOUT_S, watch=watch)
        except NodeLost as lost:
            noticed = time.monotonic()
            time.sleep(_FAILURE_WINDOW_S)  # nodes lost together (a burst of a spot trace) are one failure
            failure = Failure()
            for node in {lost.node, *(n for n in self.cluster.exited_agents() if n in watch)}:
                self.cluster.mark_dead("agent", node)
                self.cluster.lose_memory(node)
                self._publish(ev.NodeLostWhileStarting, node=node)
                failure.nodes[node] = noticed
                failure.workers.update({w: noticed for w in self.cluster.workers_of(node)})
            return failure
        return None

    def _drain_events(self) -> Failure:
        """Drop the closed-connection and exit events of workers this backend killed itself; keep real failures."""
        failure = Failure()
        while not self.cluster.events.empty():
            self._classify(self.cluster.events.get_nowait(), failure)
        return failure

    def _publish(self, kind: type[ev.Event], **fields: object) -> None:
        self.bus.publish(kind(at=self.clock(), **fields))


def _pieces(ready: Mapping[int, msg.Ready]) -> dict[tuple[int, int], float] | None:
    """Every piece's squared gradient norm, from the lowest-numbered worker that holds it (replicas agree)."""
    if all(r.grad_sq is None for r in ready.values()):
        return None
    pieces: dict[tuple[int, int], float] = {}
    for _, report in sorted(ready.items()):
        for piece, value in (report.grad_sq or {}).items():
            pieces.setdefault(piece, value)
    return pieces
