"""Messages on the control channel between the coordinator, node agents and workers.

The channel is ``multiprocessing.connection`` on 127.0.0.1: it authenticates every peer with an HMAC challenge on
the per-job secret before a single message is read, and carries pickled dataclasses.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection
from typing import Any

from ftlab.runtime.contract import MemoryRecord, Source
from ftlab.runtime.instructions import Instruction

SECRET_ENV = "FTLAB_SECRET"


def no_delay(conn: Connection) -> Connection:
    """Switch Nagle's algorithm off on a control connection.

    Control messages are small and often follow each other closely (Commit then RunStep, a heartbeat then Ready).
    With Nagle the second one waits for the acknowledgement of the first, which the receiver delays by up to 40 ms:
    measured, one iteration in three stalled 10-40 ms at its commit before this.
    """
    # fromfd duplicates the descriptor: closing the duplicate leaves the connection open.
    with socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def connect(port: int) -> Connection:
    """A control connection to the coordinator's server on 127.0.0.1, authenticated with the job's secret."""
    return no_delay(Client(("127.0.0.1", port), authkey=os.environ[SECRET_ENV].encode()))


# -- sent to the coordinator ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    role: str  # "agent" | "worker" | "aborts" (a worker's second connection, which carries only Aborts)
    node: int
    pid: int
    worker: int | None = None
    incarnation: int = 0
    """Which start of this worker id the process is (0 at the node's start, then one more per respawn)."""


@dataclass(frozen=True)
class Heartbeat:
    pass


@dataclass(frozen=True)
class WorkerExited:
    """From an agent: one of its workers ended (a crash, a kill or a clean exit)."""

    worker: int
    returncode: int
    pid: int


@dataclass(frozen=True)
class Configured:
    generation: int
    step: int
    """The step the worker's layers are at (every optimizer step it has committed)."""
    received_bytes: int = 0
    """Layer state received from peers for this configuration."""
    restored_bytes: int = 0
    """State loaded from the Configure's ``restore`` source."""
    restore_s: float = 0.0
    restored_from: str = ""
    """memory | parity (some shard decoded) | storage | "" (nothing restored)"""


@dataclass(frozen=True)
class Ready:
    """The worker's part of the iteration is done and its gradients are reduced: it waits for Commit."""

    step: int
    loss: float  # this worker's share of the global mean loss (non-zero on last stages only)
    compute_s: float
    snapshot_s: float | None = None
    """Time this iteration's thread spent on a snapshot (starting its copy, waiting for it); None: no snapshot."""


@dataclass(frozen=True)
class Failed:
    """The iteration failed on this worker (a peer vanished mid-operation); it waits for the coordinator."""

    step: int
    error: str


@dataclass(frozen=True)
class AbortDone:
    generation: int
    step: int
    layers: tuple[int, ...] = ()
    """Every layer the worker holds (with its optimizer state) at ``step``."""


@dataclass(frozen=True)
class AtPhase:
    """A test hook armed by ArmFault: the worker stopped at the start of this phase and waits to be killed."""

    step: int
    phase: str


@dataclass(frozen=True)
class Saved:
    step: int
    nbytes: int


@dataclass(frozen=True)
class Snapshotted:
    """The worker's records of a snapshot are in its node's memory, committed (sent before the Ready or AbortDone
    that follows the copy)."""

    step: int
    records: tuple[MemoryRecord, ...]
    copy_s: float


@dataclass(frozen=True)
class Inventory:
    """From an agent: the records of ``step`` in its node's memory whose bytes pass their checksums."""

    node: int
    step: int
    intact: dict[str, int]
    """File name -> CRC-32."""
    corrupt: tuple[str, ...]


@dataclass(frozen=True)
class Crashed:
    error: str


# -- sent by the coordinator ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Configure:
    plan: dict[str, Any]
    program: list[Any]
    store_port: int
    setup: dict[str, Any] = field(default_factory=dict)
    """Model, training and data settings."""
    restore: Source | None = None
    """Saved state to load the layers of the worker's stage from, where it holds them not and receives them not."""
    transfers: tuple[Instruction, ...] = ()
    """This worker's SendLayer/RecvLayer program: layers with their optimizer state copied in place, over the new
    generation's group, before the worker reports Configured."""
    helpers: tuple[int, ...] = ()
    """Live workers outside the plan that join this generation's group only to send the snapshot records of their
    node (a restore from memory); a worker in ``helpers`` runs no program."""


@dataclass(frozen=True)
class RunStep:
    step: int


@dataclass(frozen=True)
class Commit:
    step: int


@dataclass(frozen=True)
class Abort:
    generation: int


@dataclass(frozen=True)
class ArmFault:
    step: int
    phase: str


@dataclass(frozen=True)
class SaveCheckpoint:
    step: int
    directory: str
    layers: tuple[int, ...]
    """The layers this worker writes."""


@dataclass(frozen=True)
class TakeSnapshot:
    """Copy the committed state of ``step`` into these records of the node's memory, off the critical path."""

    step: int
    keep: int
    records: tuple[MemoryRecord, ...]


@dataclass(frozen=True)
class TakeInventory:
    """To an agent: report the intact records of ``step`` in the node's memory."""

    step: int


@dataclass(frozen=True)
class SpawnWorkers:
    """To an agent: start these workers (a restart after a failure), ending any earlier process of theirs first."""

    workers: tuple[int, ...]
    incarnation: int


@dataclass(frozen=True)
class Shutdown:
    pass
