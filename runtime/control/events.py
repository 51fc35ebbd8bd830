"""One typed event stream: everything that happens in a job, in the order it happened.

The coordinator, the backend and the fault injector publish; tracking (MLflow metrics and ``events.jsonl``), the
progress line, the fault ledger and the timeline subscribe. Each event is a dataclass whose ``kind`` names it in
``events.jsonl``; ``at`` is the backend's clock (seconds, monotonic: wall time on real processes, simulated time in
the simulator). Steps are not written to ``events.jsonl`` (they are metrics); everything else is.

Publishing is synchronous and thread-safe: the fault injector publishes from its own thread, and a subscriber may
publish in turn (the fault ledger announces a recovery when it sees the first committed step after a fault).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ftlab.runtime.control.update import StepNumerics
from ftlab.runtime.core.plan import Plan


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str]
    logged: ClassVar[bool] = True
    """Written to events.jsonl."""
    at: float

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "at"}


@dataclass(frozen=True)
class StepCommitted(Event):
    kind: ClassVar[str] = "step"
    logged: ClassVar[bool] = False
    step: int
    loss: float
    iter_s: float
    compute_s: float
    generation: int
    samples: int
    alive_nodes: int
    pipelines: int
    snapshot_s: float | None = None
    """Time a snapshot took on the critical path of this iteration (the slowest worker's); None: none was taken."""
    numerics: StepNumerics | None = None
    """The update the step committed with (gradient norm, fp16's loss scale); None where no norms are reported."""


@dataclass(frozen=True)
class StepStarting(Event):
    """The coordinator is about to start iteration ``step`` (step-clocked faults fire here)."""

    kind: ClassVar[str] = "step_starting"
    logged: ClassVar[bool] = False
    step: int


@dataclass(frozen=True)
class WorkerAtPhase(Event):
    """A worker armed with a phase fault stopped at the start of that phase and waits to be killed."""

    kind: ClassVar[str] = "at_phase"
    logged: ClassVar[bool] = False
    worker: int
    step: int
    phase: str


@dataclass(frozen=True)
class PlanConfigured(Event):
    """Every worker of the plan holds its layers: the plan runs from its ``step``."""

    kind: ClassVar[str] = "plan"
    generation: int
    step: int
    pipelines: int
    plan: Plan = field(repr=False)

    def fields(self) -> dict[str, Any]:
        return {"generation": self.generation, "step": self.step, "pipelines": self.pipelines}


@dataclass(frozen=True)
class FaultInjected(Event):
    kind: ClassVar[str] = "fault_injected"
    fault: dict[str, Any]
    fault_kind: str
    workers: tuple[int, ...]
    """The workers the fault takes down (none for a join)."""


@dataclass(frozen=True)
class PreemptionWarned(Event):
    """The fault injector gave notice of a preemption: ``nodes`` are killed ``grace_s`` seconds from ``at``."""

    kind: ClassVar[str] = "preemption_warning"
    fault: dict[str, Any]
    nodes: tuple[int, ...]
    grace_s: float


@dataclass(frozen=True)
class WarningHeeded(Event):
    """What the policy did about a preemption warning, at the iteration boundary it saw it or with the iteration in
    flight given up for it (``step_given_up``, ``Policy.heeds_warnings_at_once``): the actions it asked for
    (``save`` for a checkpoint) and why; ``left_s`` of the grace period remained then."""

    kind: ClassVar[str] = "warning_decision"
    policy: str
    nodes: tuple[int, ...]
    step: int
    left_s: float
    actions: tuple[str, ...]
    reason: str
    step_given_up: bool = False


@dataclass(frozen=True)
class FaultSkipped(Event):
    kind: ClassVar[str] = "fault_skipped"
    fault: dict[str, Any]
    reason: str


@dataclass(frozen=True)
class FaultUnfired(Event):
    """A scheduled fault the job did not fire: it lies beyond the job's steps, or the job ended first."""

    kind: ClassVar[str] = "fault_unfired"
    fault: dict[str, Any]
    reason: str


@dataclass(frozen=True)
class FailureDetected(Event):
    kind: ClassVar[str] = "failure_detected"
    nodes: tuple[int, ...]
    workers: tuple[int, ...]
    step: int
    noticed_at: float
    """When the first sign of the failure arrived (``at`` is when the coordinator acts on it)."""


@dataclass(frozen=True)
class HangDetected(Event):
    kind: ClassVar[str] = "hang_detected"
    worker: int
    timeout_s: float


@dataclass(frozen=True)
class CommError(Event):
    """A worker's operation failed because a peer vanished; the coordinator's own view of who died follows."""

    kind: ClassVar[str] = "comm_error"
    worker: int
    error: str


@dataclass(frozen=True)
class CommErrorFenced(Event):
    """A worker's operation failed and no death explained it within ``cluster.heartbeat_timeout_s`` (a peer that
    stalled past ``cluster.comm_timeout_s``, a link that dropped): the worker was fenced (killed), so that the job
    recovers from its death instead of waiting for ever for a worker that waits for an abort."""

    kind: ClassVar[str] = "comm_error_fenced"
    worker: int
    error: str
    waited_s: float


@dataclass(frozen=True)
class NodesJoined(Event):
    kind: ClassVar[str] = "nodes_joined"
    nodes: tuple[int, ...]
    step: int


@dataclass(frozen=True)
class NodeLostWhileStarting(Event):
    """A node died (or did not come up in time) while it started: a joining node is given up, and the job goes on
    without it; a node lost during a restart is part of that failure."""

    kind: ClassVar[str] = "node_lost_while_starting"
    node: int
    reason: str = ""


@dataclass(frozen=True)
class Decided(Event):
    """A policy's answer to a membership change, with its reason."""

    kind: ClassVar[str] = "recovery_decision"
    policy: str
    outcome: str
    """reconfigure | replan | restart | keep | stop"""
    reason: str
    committed_step: int
    """Committed steps when the change was seen."""
    resume_step: int | None = None
    """The step the new plan starts from (None for keep and stop)."""
    generation: int | None = None
    transfers: int = 0
    restore: str | None = None
    """Where missing state comes from: '<kind> of step <s>'."""
    restore_reason: str = ""
    """Why the protection offered that state (e.g. why its memory snapshot was not enough)."""
    details: dict[str, Any] = field(default_factory=dict)
    predicted_pause_s: float | None = None
    """The policy's prediction of the pause (``Decision.predicted_pause_s``), when it predicts."""
    predicted_iter_s: float | None = None


@dataclass(frozen=True)
class Reviewed(Event):
    """A policy's review of the running plan with no membership change (``Policy.review``): keep it, or leave it for
    another (carried out as a join's decision is), with the reason and, for a policy that predicts, what it weighed
    (``details``) and the new plan's predicted pause and iteration time."""

    kind: ClassVar[str] = "review_decision"
    policy: str
    outcome: str
    """keep | reconfigure | replan"""
    reason: str
    step: int
    """Committed steps at the review: where the new plan, if any, starts."""
    generation: int | None = None
    """The new plan's (None for keep)."""
    transfers: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    predicted_pause_s: float | None = None
    predicted_iter_s: float | None = None


@dataclass(frozen=True)
class LayersCopied(Event):
    kind: ClassVar[str] = "layers_copied"
    copies: int
    nbytes: int
    generation: int


@dataclass(frozen=True)
class StateSaved(Event):
    """A protection's action (or the survivors' save before a stop) completed."""

    kind: ClassVar[str] = "checkpoint"
    step: int
    seconds: float
    nbytes: int
    location: str


@dataclass(frozen=True)
class SaveFailed(Event):
    """A protection's save to storage was abandoned: storage refused a write (full, failing or read-only). Nothing of
    it is left; the previous saved state stays the newest and training goes on."""

    kind: ClassVar[str] = "save_failed"
    step: int
    reason: str
    location: str


@dataclass(frozen=True)
class SnapshotTaken(Event):
    """Every record of an in-memory snapshot of ``step`` committed steps is written (they were copied while the next
    iterations ran)."""

    kind: ClassVar[str] = "snapshot"
    logged: ClassVar[bool] = False
    step: int
    copy_s: float
    """The slowest writer's copy time."""
    cpu_s: float
    """Every writer's copy CPU time, added up: what the snapshot cost the cores beside training."""
    nbytes: int
    """Every record's bytes, redundancy included."""


@dataclass(frozen=True)
class StateRestored(Event):
    """Workers loaded the saved state of ``step`` they lacked."""

    kind: ClassVar[str] = "restore"
    step: int
    source: str
    """memory | parity (some shard decoded from parity) | storage"""
    reason: str
    """Why this source (the protection's words)."""
    seconds: float
    """The slowest worker's load."""
    nbytes: int
    generation: int


@dataclass(frozen=True)
class RecordCorrupted(Event):
    """A snapshot record failed its checksum in a node's memory: it is left out and never loaded."""

    kind: ClassVar[str] = "record_corrupted"
    node: int
    record: str
    step: int


@dataclass(frozen=True)
class RestoreRefused(Event):
    """Saved state a policy chose cannot be loaded after all; the policy is asked again."""

    kind: ClassVar[str] = "restore_refused"
    source: str
    reason: str


@dataclass(frozen=True)
class Recovered(Event):
    """The first step committed after a fault: what the fault cost."""

    kind: ClassVar[str] = "recovered"
    fault: int
    """The fault's index in the job (0 for the first)."""
    fault_kind: str
    detect_s: float | None
    recover_s: float | None
    lost_steps: int | None
    transfer_bytes: int


@dataclass(frozen=True)
class JobStoppedEvent(Event):
    kind: ClassVar[str] = "stopped"
    reason: str


Handler = Callable[[Event], None]


class EventBus:
    def __init__(self) -> None:
        self._handlers: list[Handler] = []
        self._lock = threading.RLock()  # re-entrant: a handler may publish

    def subscribe(self, handler: Handler) -> None:
        self._handlers.append(handler)

    def publish(self, event: Event) -> None:
        with self._lock:
            for handler in self._handlers:
                handler(event)
