"""The seam between the coordinator's protocol and the machines that carry it out.

The coordinator (``runtime.control.coordinator``) decides what happens: plan, configure, run a step, commit, abort, recover,
absorb joins. A Backend makes it happen and says what the machines did: local processes (``runtime.local``), and
next the simulator and agents on other hosts, without touching the protocol. Time is the backend's clock.

Anything that can fail because a member died answers with a ``Failure`` instead of its result, so the protocol reads
as plain control flow: ``result = backend.finish_step(...)``, then ``if isinstance(result, Failure): recover``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ftlab.runtime.control.update import Piece, Update
from ftlab.runtime.core.contract import Action, MemoryRecord, Source, TakeSnapshot
from ftlab.runtime.core.instructions import Program
from ftlab.runtime.core.plan import Plan


@dataclass
class Failure:
    """Members found dead, with the backend-clock time each was noticed."""

    nodes: dict[int, float] = field(default_factory=dict)
    workers: dict[int, float] = field(default_factory=dict)
    """Every dead worker, those of dead nodes included."""

    def __bool__(self) -> bool:
        return bool(self.nodes or self.workers)

    def merge(self, other: Failure) -> None:
        for ident, at in other.nodes.items():
            self.nodes.setdefault(ident, at)
        for ident, at in other.workers.items():
            self.workers.setdefault(ident, at)

    @property
    def noticed_at(self) -> float:
        return min([*self.nodes.values(), *self.workers.values()])


@dataclass(frozen=True)
class Membership:
    workers_of_node: dict[int, tuple[int, ...]]
    """Alive nodes and their alive, registered workers (nodes with none are left out)."""
    slots_of_node: dict[int, tuple[int, ...]]
    """Alive nodes and every worker they run after a restart."""

    @property
    def nodes(self) -> list[int]:
        return sorted(self.slots_of_node)


@dataclass(frozen=True)
class StepReport:
    loss: float
    """The iteration's mean loss over the global batch."""
    compute_s: float
    """The busiest worker's forward and backward time."""
    snapshot_s: float | None = None
    """The longest time a worker's training thread spent on a snapshot in this iteration (None: none was taken)."""
    grad_sq: dict[Piece, float] | None = None
    """The squared L2 norm of the reduced gradient of each piece of the model (``runtime.control.update``), where
    the job clips or runs fp16; None where nobody computes them (not asked for, or the simulator)."""


@dataclass(frozen=True)
class Interrupted:
    """``finish_step``'s wait ended because the coordinator asked (``interrupted`` answered True): the step is
    neither done nor failed, and its caller aborts it."""


@dataclass(frozen=True)
class SaveReport:
    nbytes: int
    location: str
    pending: bool = False
    """An asynchronous action (a snapshot): the writers copy on while training goes on, and each one's completion
    comes later from ``completed_saves``."""
    failed: str | None = None
    """Why the save was abandoned (storage refused a write): nothing of it is left, the previous saved state stays
    the newest, and training goes on."""


@dataclass(frozen=True)
class SaveProgress:
    """Writers' parts of an asynchronous save, done (a writer's own on the runtime; the simulator reports the writers
    whose copies ended together at once)."""

    step: int
    action: Action
    workers: tuple[int, ...]
    records: tuple[MemoryRecord, ...]
    complete: bool
    """Every writer of the save is done now."""
    nbytes: int
    """Every writer's bytes so far."""
    copy_s: float
    """The slowest writer's copy time so far."""
    cpu_s: float
    """Every writer's copy CPU time so far, added up."""
    failed: str | None = None
    """Why these writers' part could not be copied (their node's memory refused it): the snapshot never completes,
    and the previous one stays the newest."""


@dataclass
class PendingSnapshot:
    """A snapshot whose writers have not all reported (each backend's bookkeeping between save and
    completed_saves)."""

    action: TakeSnapshot
    waiting: set[int]
    nbytes: int = 0
    copy_s: float = 0.0
    cpu_s: float = 0.0
    failed: bool = False
    """A writer's copy failed: the snapshot is reported incomplete when the last writer is done."""


@dataclass(frozen=True)
class ConfigureReport:
    received_bytes: int = 0
    """Layer state copied between workers."""
    restored_bytes: int = 0
    restore_s: float = 0.0
    """The slowest worker's load of the restore source."""
    restored_from: str = ""
    """memory | parity | storage | "" (nothing restored)"""


class WorkerCrashed(RuntimeError):
    """A worker or agent raised an exception: a bug, not a fault to recover from. The message holds its traceback."""


class Backend(ABC):
    @abstractmethod
    def clock(self) -> float:
        """Seconds, monotonic."""

    @abstractmethod
    def membership(self) -> Membership: ...

    @abstractmethod
    def restart_workers(self) -> Failure | None:
        """End every worker process and start fresh ones on every live node; they hold nothing yet."""

    @abstractmethod
    def configure(
        self, plan: Plan, programs: Mapping[int, Program], transfers: Mapping[int, Program], restore: Source | None
    ) -> ConfigureReport | Failure:
        """Give every worker of ``plan`` its program, run the layer transfers (``transfers``: each worker's
        SendLayer/RecvLayer program), load what is still missing from ``restore``."""

    @abstractmethod
    def verify(self, source: Source) -> Source | str | Failure:
        """Check that ``source`` can be loaded now, before anything is restarted for it: the source narrowed to what
        is intact (a record that fails its checksum is left out), or why it cannot be loaded."""

    @abstractmethod
    def begin_step(self, plan: Plan, step: int, loss_scale: float = 1.0) -> None:
        """Start iteration ``step`` on every worker of ``plan`` (it runs while the coordinator reports the last), its
        loss multiplied by ``loss_scale`` before the backward (fp16)."""

    @abstractmethod
    def finish_step(
        self, plan: Plan, step: int, interrupted: Callable[[], bool] = lambda: False
    ) -> StepReport | Failure | Interrupted:
        """Wait until every worker has reduced its gradients and is ready to commit; ``interrupted`` is asked as
        the wait goes on (from the thread that waits, on the backend's clock), and the wait ends as soon as it
        answers True (a preemption warning a policy acts on at once)."""

    @abstractmethod
    def commit(self, plan: Plan, step: int, update: Update = Update()) -> None:
        """Every worker steps its optimizers as ``update`` says: ``step`` is committed."""

    @abstractmethod
    def abort(self, plan: Plan, failure: Failure, committed: int) -> dict[int, tuple[int, ...]]:
        """Stop the iteration in flight on every survivor of ``plan``; returns the layers each holds at
        ``committed``. Members that die meanwhile are added to ``failure``."""

    @abstractmethod
    def save(
        self, step: int, action: Action, writers: Mapping[int, tuple[int, ...]], num_layers: int,
        manifest: Mapping[str, object] | None = None,
    ) -> SaveReport | Failure:  # fmt: skip
        """Carry out a protection's action for committed ``step``: ``writers`` says which worker saves which layers
        (a snapshot names its own writers). ``manifest``: what a storage checkpoint records beside the layers (the
        loss scaler's state)."""

    @abstractmethod
    def completed_saves(self) -> list[SaveProgress]:
        """Parts of asynchronous saves that completed since the last call, in order."""

    @abstractmethod
    def joined(self) -> list[int]:
        """Nodes that started (``FaultTarget.start_node``) and whose workers all registered by now, not offered
        before: each is offered once, at the iteration boundary this is asked at. A node still starting is in no
        ``Membership`` until then, so no plan counts on it and no restart waits for it."""


class FaultTarget(ABC):
    """What a backend offers the injector: its membership by node, and the faults it can cause."""

    @abstractmethod
    def workers_of(self, node: int) -> list[int]: ...

    @abstractmethod
    def alive_nodes(self) -> list[int]: ...

    @abstractmethod
    def alive_workers(self) -> list[int]: ...

    @abstractmethod
    def kill_node(self, node: int) -> None:
        """The node's agent and every worker of it die at once; its host memory is lost."""

    @abstractmethod
    def kill_worker(self, worker: int) -> None: ...

    @abstractmethod
    def hang_worker(self, worker: int) -> None:
        """The worker stops responding (and stops heartbeating) without dying."""

    @abstractmethod
    def resume_worker(self, worker: int) -> None:
        """A hung worker goes on where it stopped; nothing, if it was fenced (killed) meanwhile."""

    @abstractmethod
    def start_node(self, node: int) -> None:
        """A new node starts in the background and returns at once: training goes on while it boots. The node joins
        the membership once its workers have registered, as ``Backend.joined`` offers it at an iteration boundary; if
        it dies or times out before that, the backend logs ``NodeLostWhileStarting`` and the job goes on without it."""

    @abstractmethod
    def arm(self, worker: int, step: int, phase: str) -> None:
        """Make ``worker`` stop at the start of ``phase`` of ``step`` and report it."""
