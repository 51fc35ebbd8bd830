"""The coordinator's training loop: plan, configure, run steps, commit, and recover when membership changes.

One iteration is a two-phase commit. Every worker of the plan runs its program up to the optimizer step and reports
Ready with its gradients reduced; only when all have, the coordinator sends Commit and the workers step their
optimizers. A failure before that point aborts the iteration everywhere, so no two replicas of a layer are ever at
different steps and a failure costs at most the iteration in flight.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from policies.base import Change, Continue, InPlace, Job, Policy, Restart, SaveCheckpoint, Stop
from runtime import checkpoint
from runtime import messages as msg
from runtime.cluster import Event, LocalCluster, NodeLost
from runtime.fault_ledger import FaultLedger, FaultRecord
from runtime.plan import Plan

M = TypeVar("M")

# After the first sign of a failure, wait this long for the rest of it (a node's agent and workers report apart).
_FAILURE_WINDOW_S = 0.3

Transfers = tuple[tuple[int, int, int], ...]
_POLL_S = 0.2


class JobStopped(RuntimeError):
    """The job cannot go on: a policy decided to stop, or a worker crashed. The message says why."""


@dataclass
class Failure:
    """Members found dead, with the monotonic time each was noticed."""

    nodes: dict[int, float] = field(default_factory=dict)
    workers: dict[int, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.nodes or self.workers)


class MembershipChanged(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(f"nodes {sorted(failure.nodes)} and workers {sorted(failure.workers)} failed")
        self.failure = failure


@dataclass
class StepRecord:
    step: int
    loss: float
    iter_s: float
    compute_s: float
    generation: int
    ended_at: float
    """time.monotonic() when the step committed."""


@dataclass
class Hooks:
    """What the trainer tells the rest of the job (tracking, progress, the fault injector)."""

    on_step: Callable[[StepRecord, Plan], None] = lambda record, plan: None
    on_event: Callable[..., None] = lambda kind, **fields: None
    on_plan: Callable[[Plan], None] = lambda plan: None
    on_recovered: Callable[[list[FaultRecord]], None] = lambda records: None
    before_step: Callable[[int], None] = lambda step: None
    after_configure: Callable[[], None] = lambda: None
    on_at_phase: Callable[[int, msg.AtPhase], None] = lambda worker, message: None


class Trainer:
    def __init__(
        self,
        cluster: LocalCluster,
        policy: Policy,
        make_job: Callable[[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]], Job],
        setup: dict[str, Any],
        steps: int,
        heartbeat_timeout_s: float,
        hooks: Hooks,
        ledger: FaultLedger,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.make_job = make_job
        self.setup = setup
        self.steps = steps
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.hooks = hooks
        self.ledger = ledger
        self.pending_joins: set[int] = set()

    # -- the loop ----------------------------------------------------------------------------------------------
    def job(self) -> Job:
        """Who is alive: workers that are registered and running, and the worker slots of every live node
        (a node that is still joining counts among the slots, which a restart fills)."""
        alive = set(self.cluster.alive_workers())
        nodes = self.cluster.alive_nodes()
        workers = {n: tuple(w for w in self.cluster.workers_of(n) if w in alive) for n in nodes}
        slots = {n: tuple(self.cluster.workers_of(n)) for n in nodes}
        return self.make_job({n: ws for n, ws in workers.items() if ws}, slots)

    def run(self, plan: Plan, restore: str | None = None) -> list[StepRecord]:
        """Train until ``steps`` steps are committed. Records hold every executed step, re-executed ones too."""
        records: list[StepRecord] = []
        unreported: list[tuple[StepRecord, Plan]] = []

        def report() -> None:
            for record, ran_on in unreported:
                self._report(record, ran_on)
            unreported.clear()

        step, transfers = plan.step, ()
        configured = False
        try:
            while step < self.steps:
                try:
                    if not configured:
                        self._configure(plan, restore, transfers)
                        configured = True
                    grown = self._absorb_joins(plan, step)
                    if grown is not None:
                        plan, step = grown, grown.step
                    self.hooks.before_step(step)
                    # The previous step is reported while the workers compute this one: metrics and progress cost
                    # the iteration nothing.
                    record, actions = self._run_step(plan, step, meanwhile=report)
                    step += 1
                    records.append(record)
                    unreported.append((record, plan))
                    for action in actions:
                        self._checkpoint(plan, step, action)
                except MembershipChanged as changed:
                    report()  # before the failure is noticed: the fault ledger sees events in order
                    plan, restore, transfers = self._recover_until_stable(changed.failure, plan, step)
                    step, configured = plan.step, False
        finally:
            report()  # a committed step is reported whatever ends the job
        return records

    def _report(self, record: StepRecord, plan: Plan) -> None:
        self.hooks.on_step(record, plan)
        recovered = self.ledger.recovered(record.ended_at)  # the first step committed after a fault
        if recovered:
            self.hooks.on_recovered(recovered)

    def _absorb_joins(self, plan: Plan, step: int) -> Plan | None:
        """Offer nodes that joined (and whose workers all registered) to the policy, at an iteration boundary.

        Returns the new, configured plan, or None when the policy keeps the running one.
        """
        alive = set(self.cluster.alive_workers())
        ready = {n for n in self.pending_joins if set(self.cluster.workers_of(n)) <= alive}
        if not ready:
            return None
        self.pending_joins -= ready
        self.hooks.on_event("nodes_joined", nodes=sorted(ready), step=step)
        change = Change(plan=plan, step=step, joined_nodes=tuple(sorted(ready)))
        new_plan, restore, transfers = self._recovery_plan(self.policy.on_change(change, self.job()), plan)
        if new_plan is plan:
            return None
        self._configure(new_plan, restore, transfers)
        return new_plan

    # -- one iteration -----------------------------------------------------------------------------------------
    def _run_step(
        self, plan: Plan, step: int, meanwhile: Callable[[], None]
    ) -> tuple[StepRecord, list[SaveCheckpoint]]:
        """One iteration, and what the policy wants done after it. Both the policy's decision and ``meanwhile`` run
        while the workers compute, so the next RunStep can follow Commit at once."""
        started = time.perf_counter()
        for worker in plan.workers:
            self.cluster.send(worker, msg.RunStep(step))
        meanwhile()
        actions = self.policy.after_step(step + 1, self.job())
        ready = self._collect(set(plan.workers), msg.Ready, lambda m: m.step == step)
        for worker in plan.workers:
            self.cluster.send(worker, msg.Commit(step))
        record = StepRecord(
            step=step,
            loss=sum(r.loss for r in ready.values()),
            iter_s=time.perf_counter() - started,
            compute_s=max(r.compute_s for r in ready.values()),
            generation=plan.generation,
            ended_at=time.monotonic(),
        )
        return record, actions

    def _configure(self, plan: Plan, restore: str | None, transfers: tuple[tuple[int, int, int], ...] = ()) -> None:
        programs = self.policy.programs(plan)
        port = self.cluster.store.port
        for worker in plan.workers:
            configure = msg.Configure(asdict(plan), programs[worker], port, self.setup, restore, transfers)
            self.cluster.send(worker, configure)
        done = self._collect(set(plan.workers), msg.Configured, lambda m: m.generation == plan.generation)
        received = sum(m.received_bytes for m in done.values())
        if transfers:
            self.ledger.transferred(received)
            self.hooks.on_event("layers_copied", copies=len(transfers), nbytes=received, generation=plan.generation)
        self.policy.configured(plan)
        self.hooks.on_plan(plan)
        self.hooks.after_configure()

    def _checkpoint(self, plan: Plan, step: int, action: SaveCheckpoint) -> None:
        started = time.perf_counter()
        for worker in plan.workers:
            self.cluster.send(worker, msg.SaveCheckpoint(step, action.directory))
        saved = self._collect(set(plan.workers), msg.Saved, lambda m: m.step == step)
        checkpoint.write_manifest(action.directory, step, plan.num_layers, {"generation": plan.generation})
        checkpoint.prune(action.directory, action.keep)
        seconds = time.perf_counter() - started
        self.hooks.on_event("checkpoint", step=step, seconds=seconds, nbytes=sum(s.nbytes for s in saved.values()))

    # -- events ------------------------------------------------------------------------------------------------
    def _collect(self, expected: set[int], kind: type[M], accept: Callable[[M], bool]) -> dict[int, M]:
        """Wait for one ``kind`` message from every expected worker; raise MembershipChanged on any failure."""
        got: dict[int, M] = {}
        while set(got) < expected:
            failure = Failure()
            event = self._next_event(failure)
            if failure:
                raise MembershipChanged(self._gather(failure))
            if event is None:
                continue
            message = event.message
            if event.role == "worker" and isinstance(message, kind) and accept(message):
                got[event.ident] = message
            elif isinstance(message, msg.Failed):
                # A peer vanished under this worker; the coordinator's own view of who died follows shortly.
                self.hooks.on_event("comm_error", worker=event.ident, error=message.error)
        return got

    def _next_event(self, failure: Failure) -> Event | None:
        """The next event, or None after a quiet poll; records failures it sees into ``failure``."""
        try:
            event = self.cluster.events.get(timeout=_POLL_S)
        except queue.Empty:  # a quiet moment: check for hung workers
            for worker in self.cluster.silent_workers(self.heartbeat_timeout_s):
                self.hooks.on_event("hang_detected", worker=worker, timeout_s=self.heartbeat_timeout_s)
                self.cluster.kill_worker(worker)  # fence it: a hung worker must never come back
            return None
        self._classify(event, failure)
        return event

    def _classify(self, event: Event, failure: Failure) -> None:
        message = event.message
        if isinstance(message, msg.Crashed):
            raise JobStopped(f"{event.role} {event.ident} crashed:\n{message.error}")
        if isinstance(message, msg.AtPhase):
            self.hooks.on_at_phase(event.ident, message)
            return
        if isinstance(message, msg.Hello):
            if message.role == "agent":
                self.pending_joins.add(message.node)
            return
        dead_worker = (event.role == "worker" and message is None) or isinstance(message, msg.WorkerExited)
        if dead_worker:
            worker = message.worker if isinstance(message, msg.WorkerExited) else event.ident
            self._lose_worker(worker, event.at, failure)
        elif event.role == "agent" and message is None and self.cluster.agents[event.ident].alive:
            node = event.ident
            self.cluster.mark_dead("agent", node)
            failure.nodes[node] = event.at
            for worker in self.cluster.workers_of(node):
                self.cluster.kill_worker(worker)  # a lost node loses all of its workers
                self._lose_worker(worker, event.at, failure)

    def _lose_worker(self, worker: int, at: float, failure: Failure) -> None:
        """Record a worker's death once, the first time any sign of it arrives."""
        member = self.cluster.workers.get(worker)
        if member is not None and member.alive:
            self.cluster.mark_dead("worker", worker)
            failure.workers[worker] = at

    def _gather(self, failure: Failure) -> Failure:
        """Let the rest of a failure arrive (the other half of a node, simultaneous kills)."""
        deadline = time.monotonic() + _FAILURE_WINDOW_S
        while time.monotonic() < deadline:
            try:
                event = self.cluster.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self._classify(event, failure)
        return failure

    # -- recovery ----------------------------------------------------------------------------------------------
    def _abort(self, plan: Plan, failure: Failure, committed: int) -> dict[int, tuple[int, ...]]:
        """Stop the iteration in flight on every survivor; returns who holds which layers."""
        survivors = set(plan.workers) & set(self.cluster.alive_workers())
        for worker in survivors:
            self.cluster.abort(worker, msg.Abort(plan.generation))
        while True:
            try:
                done = self._collect(survivors, msg.AbortDone, lambda m: m.generation == plan.generation)
                break
            except MembershipChanged as more:  # a failure during the abort: fold it in, wait for the rest
                failure.nodes.update(more.failure.nodes)
                failure.workers.update(more.failure.workers)
                survivors &= set(self.cluster.alive_workers())
        # The invariant every policy relies on: no two replicas of a layer at different steps. (Workers restarted
        # a moment ago hold no layer yet.)
        behind = {w: m.step for w, m in done.items() if m.layers and m.step != committed}
        assert not behind, f"workers {behind} are not at the committed step {committed}"
        return {w: m.layers for w, m in done.items()}

    def _recover_until_stable(self, failure: Failure, plan: Plan, step: int) -> tuple[Plan, str | None, Transfers]:
        """Recover, and recover again if more members fail while recovering (e.g. a node dies during a restart)."""
        while True:
            try:
                return self._recover(failure, plan, step)
            except MembershipChanged as more:
                failure = more.failure

    def _recover(self, failure: Failure, plan: Plan, committed: int) -> tuple[Plan, str | None, Transfers]:
        """``committed`` is the number of committed steps: what every survivor holding layers is at."""
        noticed = min([*failure.nodes.values(), *failure.workers.values()])
        records = self.ledger.noticed(set(failure.workers), noticed)
        self.hooks.on_event(
            "failure_detected", nodes=sorted(failure.nodes), workers=sorted(failure.workers), step=committed
        )
        holdings = self._abort(plan, failure, committed)
        change = Change(
            plan=plan,
            step=committed,
            failed_nodes=tuple(sorted(failure.nodes)),
            failed_workers=tuple(sorted(w for w in failure.workers if self.cluster.node_of(w) not in failure.nodes)),
        )
        decision = self.policy.on_change(change, self.job())
        if isinstance(decision, Stop):
            raise JobStopped(decision.reason + self._save_survivors(committed, holdings, plan.num_layers))
        new_plan, restore, transfers = self._recovery_plan(decision, plan)
        self.ledger.resumed(records, committed, new_plan.step)
        return new_plan, restore, transfers

    def _save_survivors(self, step: int, holdings: dict[int, tuple[int, ...]], num_layers: int) -> str:
        """Before stopping: a checkpoint of the last committed step from the survivors, if they hold every layer."""
        writer: dict[int, int] = {}
        for worker, layers in sorted(holdings.items()):
            for layer in layers:
                writer.setdefault(layer, worker)
        missing = sorted(set(range(num_layers)) - set(writer))
        if missing:
            return f". Layers {missing} have no live replica, so no checkpoint of step {step} could be written."
        directory = self.policy.settings.checkpoint_dir
        chosen = {w: tuple(sorted(layer for layer, ww in writer.items() if ww == w)) for w in set(writer.values())}
        for worker, layers in chosen.items():
            self.cluster.send(worker, msg.SaveCheckpoint(step, directory, layers))
        try:
            self._collect(set(chosen), msg.Saved, lambda m: m.step == step)
        except MembershipChanged:
            return f". A further failure stopped the checkpoint of step {step}."
        saved = checkpoint.write_manifest(directory, step, num_layers, {"reason": "stop"})
        return f". The survivors saved step {step} to {saved}: resume with train.resume_from={saved}"

    def _recovery_plan(self, decision: Any, plan: Plan) -> tuple[Plan, str | None, Transfers]:
        """Carry out a policy's decision up to the new plan (processes restarted if needed); not yet configured."""
        self.hooks.on_event("recovery_decision", decision=type(decision).__name__)
        if isinstance(decision, Stop):
            raise JobStopped(decision.reason)
        if isinstance(decision, Continue):
            return plan, None, ()
        if isinstance(decision, Restart):
            self._restart_workers()
            self.pending_joins -= {self.cluster.node_of(w) for w in decision.plan.workers}
            return decision.plan, decision.checkpoint, ()
        assert isinstance(decision, InPlace)
        self.pending_joins -= {self.cluster.node_of(w) for w in decision.plan.workers}
        return decision.plan, None, decision.transfers

    def _restart_workers(self) -> None:
        """Checkpoint-restart: end every worker process and start fresh ones on every live node.

        Workers of a node still joining are waited for first, so none is left starting while its slot is refilled.
        """
        booting = {w for n in self.pending_joins if n in self.cluster.alive_nodes() for w in self.cluster.workers_of(n)}
        self._wait_for(booting)
        for worker in self.cluster.alive_workers():
            self.cluster.kill_worker(worker)
            self.cluster.mark_dead("worker", worker)
        for worker, member in self.cluster.workers.items():
            _wait_gone(member.pid)
        self._drain_events()
        expected: set[int] = set()
        for node in self.cluster.alive_nodes():
            workers = tuple(self.cluster.workers_of(node))
            for worker in workers:
                self.cluster.workers.pop(worker, None)
            self.cluster.send_agent(node, msg.SpawnWorkers(workers))
            expected |= set(workers)
        self._wait_for(expected)

    def _wait_for(self, workers: set[int]) -> None:
        """Wait for workers to register; a node that dies meanwhile is a further failure to recover from."""
        try:
            self.cluster.wait_for_workers(workers, timeout_s=300)
        except NodeLost as lost:
            self.cluster.mark_dead("agent", lost.node)
            self.hooks.on_event("node_lost_while_starting", node=lost.node)
            raise MembershipChanged(Failure(nodes={lost.node: time.monotonic()})) from lost

    def _drain_events(self) -> None:
        """Drop the closed-connection and exit events of workers this coordinator killed itself."""
        while not self.cluster.events.empty():
            event = self.cluster.events.get_nowait()
            if isinstance(event.message, msg.Crashed):
                raise JobStopped(f"{event.role} {event.ident} crashed:\n{event.message.error}")
            if event.role == "agent" and event.message is None:
                self.cluster.mark_dead("agent", event.ident)


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
