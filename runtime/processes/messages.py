"""Messages on the control channel between the coordinator, node agents and workers, and how a peer proves it
belongs to the job before any of them is read.

The channel carries pickled dataclasses, and unpickling runs code: so nothing is ever unpickled from a peer that
has not proved it holds the job's secret. Every connection starts with a mutual HMAC-SHA256 challenge on raw,
fixed-length frames (``handshake``): the server sends a magic string and a random nonce, the client answers with the
HMAC of that nonce and a nonce of its own, the server checks it (``hmac.compare_digest``) and answers the client's
nonce in turn, so neither side reads a pickle from an impostor (a peer that connects to the coordinator, or a
server that pretends to be it). A peer that fails, sends too little or stays silent for ``HANDSHAKE_TIMEOUT_S`` is
closed; the handshake runs on a thread of its own per connection, so a silent peer cannot stall other peers.

Why our own handshake rather than ``multiprocessing.connection``'s ``authkey`` (which also answers a challenge
before unpickling): it runs inside ``Listener.accept``, on the one accepting thread with no timeout, so one peer
that connects and says nothing blocks every later registration; and it is HMAC-MD5 on Python 3.11. After the
handshake the socket becomes a ``multiprocessing.connection.Connection`` as before.

The secret is the job's (``secrets.token_hex``, made by the coordinator). It reaches agents and workers through the
environment (``FTLAB_SECRET``) or a file (``ftlab-agent --secret-file``, ``-`` for standard input), never through a
command line (``/proc/<pid>/cmdline`` is world-readable) and never through the run's MLflow params.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ftlab.runtime.control.update import Update
from ftlab.runtime.core.contract import MemoryRecord, Source
from ftlab.runtime.core.instructions import Instruction

SECRET_ENV = "FTLAB_SECRET"
MAGIC = b"ftlab-control-v1"
_NONCE = 32
_DIGEST = 32  # SHA-256
HANDSHAKE_TIMEOUT_S = 10.0


class AuthenticationError(ConnectionError):
    """The peer did not prove it holds the job's secret."""


def new_secret() -> str:
    return secrets.token_hex(32)


def job_secret(secret_file: str | None = None) -> str:
    """The job's secret: from ``secret_file`` (``-``: the first line of standard input), else ``FTLAB_SECRET``."""
    if secret_file == "-":
        import sys

        secret = sys.stdin.readline().strip()
    elif secret_file is not None:
        secret = Path(secret_file).read_text().strip()
    else:
        secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise SystemExit(f"no job secret: give --secret-file PATH (or -, for standard input) or set {SECRET_ENV}")
    return secret


def _mac(secret: str, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), MAGIC + role + nonce, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AuthenticationError("the peer closed the connection during the handshake")
        data += chunk
    return data


def _server_handshake(sock: socket.socket, secret: str) -> None:
    nonce = secrets.token_bytes(_NONCE)
    sock.sendall(MAGIC + nonce)
    answer = _read_exact(sock, _DIGEST + _NONCE)  # raw bytes: nothing is unpickled here
    if not hmac.compare_digest(answer[:_DIGEST], _mac(secret, b"client", nonce)):
        raise AuthenticationError("the peer does not hold the job's secret")
    sock.sendall(_mac(secret, b"server", answer[_DIGEST:]))


def _client_handshake(sock: socket.socket, secret: str) -> None:
    greeting = _read_exact(sock, len(MAGIC) + _NONCE)
    if not greeting.startswith(MAGIC):
        raise AuthenticationError("the server is not an ftlab coordinator")
    nonce = secrets.token_bytes(_NONCE)
    sock.sendall(_mac(secret, b"client", greeting[len(MAGIC):]) + nonce)
    if not hmac.compare_digest(_read_exact(sock, _DIGEST), _mac(secret, b"server", nonce)):
        raise AuthenticationError("the server does not hold the job's secret")


def _connection(sock: socket.socket) -> Connection:
    """The authenticated socket as a message connection, with Nagle's algorithm off.

    Control messages are small and often follow each other closely (Commit then RunStep, a heartbeat then Ready).
    With Nagle the second one waits for the acknowledgement of the first, which the receiver delays by up to 40 ms:
    many iterations would stall that long at their commit.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    return Connection(sock.detach())


def connect(addr: str, port: int, secret: str | None = None, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Connection:
    """A control connection to the coordinator's server, authenticated both ways with the job's secret (by default
    ``FTLAB_SECRET``)."""
    secret = secret if secret is not None else os.environ[SECRET_ENV]
    sock = socket.create_connection((addr, port), timeout=timeout_s)
    try:
        _client_handshake(sock, secret)
    except BaseException:
        sock.close()
        raise
    return _connection(sock)


class ControlServer:
    """The coordinator's listening socket: hands each peer that proves the secret to ``on_connection``, on the
    thread that authenticated it; closes every other one having read nothing but the handshake's bytes."""

    def __init__(self, addr: str, port: int, secret: str, on_connection: Callable[[Connection], None]) -> None:
        self._secret = secret
        self._on_connection = on_connection
        self._sock = socket.create_server((addr, port), backlog=128)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self.refused = 0
        """Connections closed for failing the handshake (for tests and logs)."""
        self._closing = False
        threading.Thread(target=self._accept, daemon=True, name="control-accept").start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._authenticate, args=(sock,), daemon=True, name="control-auth").start()

    def _authenticate(self, sock: socket.socket) -> None:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            _server_handshake(sock, self._secret)
        except (OSError, AuthenticationError):
            self.refused += 1
            sock.close()
            return
        self._on_connection(_connection(sock))

    def close(self) -> None:
        self._closing = True
        # close() alone does not wake the thread blocked in accept() on Linux: the socket would go on listening,
        # and that thread would keep this server and its coordinator's tables alive. shutdown() wakes it.
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected: some platforms refuse shutdown() on a listening socket, and close() suffices there
        self._sock.close()
        # The callback is bound to the coordinator's tables: dropped, they go when the job does, not at the next
        # garbage collection (the rendezvous store's sockets with them). A peer still authenticating is turned away.
        self._on_connection = Connection.close


# -- sent to the coordinator ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    role: str  # "agent" | "worker" | "aborts" (a worker's second connection, which carries only Aborts)
    node: int
    pid: int
    worker: int | None = None
    incarnation: int = 0
    """Which start of this worker id the process is (0 at the node's start, then one more per respawn)."""
    host: str = ""
    """An agent's: the address its node's workers are reachable on."""
    gpus: int = 0
    """An agent's: the GPUs its node's workers may use (``runtime.processes.placement.visible_gpus``)."""


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
    grad_sq: dict[tuple[int, int], float] | None = None
    """The squared norm of each piece of the model this worker holds, its gradients reduced
    (``runtime.control.update``); None where the job neither clips nor runs fp16."""


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
    error: str | None = None
    """Why this worker's part of the checkpoint could not be written (a storage error): the save is abandoned."""


@dataclass(frozen=True)
class Snapshotted:
    """The worker's records of a snapshot are in its node's memory, committed (sent before the Ready or AbortDone
    that follows the copy)."""

    step: int
    records: tuple[MemoryRecord, ...]
    copy_s: float
    cpu_s: float
    """The copy thread's CPU time."""
    error: str | None = None
    """Why the copy failed (the node's memory refused it, full): no record of this worker's part is reported."""


@dataclass(frozen=True)
class Inventory:
    """From an agent: the records of ``step`` in its node's memory whose bytes pass their checksums."""

    node: int
    step: int
    intact: dict[str, int]
    """File name -> checksum."""
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
    loss_scale: float = 1.0
    """fp16: the loss is multiplied by this before the backward."""


@dataclass(frozen=True)
class Commit:
    step: int
    update: Update = Update()
    """What to do with the reduced gradients: multiply them by a factor, or skip the step."""


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
