"""The coordinator's view of a cluster of processes: control server, rendezvous store, agents, membership.

The control server and the rendezvous store listen on ``coordinator_addr`` only (loopback by default: a job on one
machine is reachable from no other), and the control server admits only peers that prove the job's secret
(``messages.ControlServer``). Agents start through a launcher (``runtime.processes.launchers``: children of the coordinator,
ssh, SLURM); each reports the address its workers are reachable on. An agent's death is its closed control
connection, wherever it runs; where the launcher also knows the process (a local child), its exit counts too.

Everything that arrives from agents and workers (messages, closed connections) becomes a ``ClusterEvent`` on one queue,
which the local backend consumes from a single thread: membership changes and step results are handled in the order they
happened, with no locks in the training logic.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import psutil
import torch.distributed as dist

from ftlab.runtime.processes import messages as msg
from ftlab.runtime.state import shm
from ftlab.runtime.processes.hold import hold, registered_point
from ftlab.runtime.processes.launchers import AgentHandle, AgentSpec, Launcher, LocalLauncher
from ftlab.runtime.processes.placement import device_index

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    pass


class NodeLost(ClusterError):
    """A node's agent died while the coordinator waited for its workers."""

    def __init__(self, node: int, returncode: int | None) -> None:
        super().__init__(f"the agent of node {node} exited with code {returncode} while its workers started")
        self.node = node


@dataclass(frozen=True)
class ClusterEvent:
    role: str  # "agent" | "worker"
    ident: int  # node id for agents, worker id for workers
    message: Any  # a message, or None when the connection closed
    pid: int
    """The process it came from: a worker id outlives its processes, and only its current one counts."""
    at: float = field(default_factory=time.monotonic)


@dataclass
class Member:
    role: str
    ident: int
    node: int
    pid: int
    conn: Connection
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True
    aborts: Connection | None = None
    """A worker's second connection, on which Aborts are repeated (see ``abort``)."""
    host: str = ""
    gpus: int = 0
    closed: bool = False
    """Its control connection has closed: the process is gone (or cut off, which is the same to the job)."""


class LocalCluster:
    def __init__(
        self, nodes: int, workers_per_node: int, heartbeat_s: float, threads_per_worker: int,
        coordinator_addr: str = "127.0.0.1", launcher: Launcher | None = None, coordinator_port: int = 0,
        store_port: int = 0,
    ) -> None:  # fmt: skip
        self.workers_per_node = workers_per_node
        self.heartbeat_s = heartbeat_s
        self.threads_per_worker = threads_per_worker
        self.node_ids = list(range(nodes))
        self.coordinator_addr = coordinator_addr
        self.launcher = launcher or LocalLauncher()
        self.secret = msg.new_secret()
        """Every control connection proves it; it leaves this process only through environments and 0600 files."""
        self.events: queue.Queue[ClusterEvent] = queue.Queue()
        self.agents: dict[int, Member] = {}
        self.workers: dict[int, Member] = {}
        # By (worker, pid): workers one of whose two connections has not registered yet.
        self._connecting: dict[tuple[int, int], dict[str, tuple[Connection, msg.Hello]]] = {}
        self.worker_pids: dict[int, list[int]] = {}
        """Every process each worker id has had, in order: a restarted worker has several."""
        self.incarnation: dict[int, int] = {}
        """Worker id -> the start of it that may register now (0 until it is respawned)."""
        self._agent_procs: dict[int, AgentHandle] = {}
        self._accept_lock = threading.Lock()
        self._starting: set[int] = set()
        self._closing = False
        self.started = False
        self._server = msg.ControlServer(coordinator_addr, coordinator_port, self.secret, self._register)
        self.port = self._server.address[1]
        # The rendezvous store lives in the coordinator, which outlives every generation of workers. TCPStore
        # would listen on every interface: it is handed a socket bound to the coordinator's address instead. Only
        # held here: its server serves the workers as long as this reference lives (``shutdown`` drops it).
        self._store_socket = socket.create_server((coordinator_addr, store_port), backlog=128)
        self._store: dist.TCPStore | None = dist.TCPStore(
            coordinator_addr, self._store_socket.getsockname()[1], is_master=True, wait_for_workers=False,
            master_listen_fd=self._store_socket.fileno(),
        )  # fmt: skip
        self.store_port: int = self._store.port
        self._store_socket.detach()  # the store's server owns the descriptor now
        log.info("control server on %s:%d, rendezvous store on %s:%d", coordinator_addr, self.port, coordinator_addr,
                 self.store_port)  # fmt: skip
        self.memory_root = shm.job_root(f"{os.getpid()}-{secrets.token_hex(4)}")
        """The nodes' host memories (``node-N`` each, owned by its agent); removed when the job ends."""

    def workers_of(self, node: int) -> list[int]:
        return [node * self.workers_per_node + i for i in range(self.workers_per_node)]

    def node_of(self, worker: int) -> int:
        return worker // self.workers_per_node

    # -- starting ----------------------------------------------------------------------------------------------
    def agent_spec(self, node: int) -> AgentSpec:
        return AgentSpec(
            self.coordinator_addr, self.port, node, tuple(self.workers_of(node)), self.heartbeat_s,
            self.threads_per_worker, str(self.memory_root), self.launcher.host_addr(node),
            device_index(node, 0, self.workers_per_node, self.launcher.same_machine),
        )  # fmt: skip

    def start_node(self, node: int) -> None:
        self._starting.add(node)  # until its agent registers, an earlier agent's closed connection is not its death
        self._agent_procs[node] = self.launcher.start(self.agent_spec(node), self.secret)
        if node not in self.node_ids:
            self.node_ids.append(node)

    def start(self, timeout_s: float = 300.0) -> None:
        """Start every node and wait until each of its workers has registered."""
        for node in self.node_ids:
            self.start_node(node)
        expected = {w for n in self.node_ids for w in self.workers_of(n)}
        self.wait_for_workers(expected, timeout_s)
        self.started = True

    def wait_for_workers(self, expected: set[int], timeout_s: float, watch: Iterable[int] = ()) -> None:
        """Wait until every expected worker has registered; NodeLost if the agent of a node they are on, or of a
        node in ``watch``, dies meanwhile."""
        deadline = time.monotonic() + timeout_s
        watched = {self.node_of(w) for w in expected} | set(watch)
        while not expected <= {w for w, m in self.workers.items() if m.alive}:
            for node in watched:
                if self._agent_ended(node):
                    raise NodeLost(node, self._agent_procs[node].poll() if node in self._agent_procs else None)
            if time.monotonic() > deadline:
                missing = sorted(expected - set(self.workers))
                raise ClusterError(f"workers {missing} did not register within {timeout_s:.0f} s")
            time.sleep(0.05)

    # -- control connections -----------------------------------------------------------------------------------
    def _agent_ended(self, node: int) -> bool:
        """The node's agent is gone: its launcher saw it end, or its control connection closed."""
        handle = self._agent_procs.get(node)
        member = self.agents.get(node)
        closed = member is not None and member.closed and node not in self._starting
        return (handle is not None and handle.poll() is not None) or closed

    def _register(self, conn: Connection) -> None:
        """An authenticated connection (on its own thread): its Hello says who it is."""
        try:
            hello = conn.recv()
        except (OSError, EOFError):
            conn.close()  # a peer that vanished while connecting
            return
        if self._closing or not isinstance(hello, msg.Hello):
            conn.close()
            return
        with self._accept_lock:  # registrations change the tables one at a time
            member = self._admit(conn, hello)
        if member is not None:
            if member.role == "worker":
                hold(registered_point(member.ident, hello.incarnation))  # where a test waits for a registration
            threading.Thread(target=self._read, args=(member,), daemon=True, name=f"read-{member.role}{member.ident}").start()

    def _admit(self, conn: Connection, hello: msg.Hello) -> Member | None:
        if hello.role != "agent" and hello.incarnation != self.incarnation.get(hello.worker, 0):
            conn.close()  # a process of an earlier start, which its agent ends: it must not replace this one
            return None
        if hello.role in ("worker", "aborts"):
            # A worker counts once both its connections are there: an Abort must reach it at any time. Each
            # connection registers on its own thread, so either Hello may come first. (Keyed by worker and pid:
            # pids repeat across hosts.)
            parts = self._connecting.setdefault((hello.worker, hello.pid), {})
            parts[hello.role] = (conn, hello)
            if len(parts) < 2:
                return None
            del self._connecting[(hello.worker, hello.pid)]
            (conn, hello), (aborts, _) = parts["worker"], parts["aborts"]
            member = Member("worker", hello.worker, hello.node, hello.pid, conn, aborts=aborts, host=hello.host)
            self.worker_pids.setdefault(member.ident, []).append(member.pid)
        else:
            member = Member(hello.role, hello.node, hello.node, hello.pid, conn, host=hello.host, gpus=hello.gpus)
            self._starting.discard(hello.node)
        (self.workers if member.role == "worker" else self.agents)[member.ident] = member
        if self.started:
            # How the backend learns of joins and restarts.
            self.events.put(ClusterEvent(member.role, member.ident, hello, member.pid))
        return member

    def _read(self, member: Member) -> None:
        while True:
            try:
                message = member.conn.recv()
            except (EOFError, OSError):
                member.closed = True
                self.events.put(ClusterEvent(member.role, member.ident, None, member.pid))
                return
            member.last_seen = time.monotonic()
            if not isinstance(message, msg.Heartbeat):
                self.events.put(ClusterEvent(member.role, member.ident, message, member.pid))

    def send(self, worker: int, message: object) -> bool:
        """Send to a worker; False if its connection is already gone (the failure arrives as an event)."""
        return _send(self.workers.get(worker), message)

    def abort(self, worker: int, message: object) -> None:
        """An Abort goes on both connections: the second fails the worker's communication at once, even in the
        middle of a wait; the control connection keeps it in order with every other message, for the worker to
        acknowledge."""
        member = self.workers.get(worker)
        if member is not None and member.alive and member.aborts is not None:
            try:
                member.aborts.send(message)
            except OSError:
                pass  # the worker is gone: its failure arrives as an event
        self.send(worker, message)

    def send_agent(self, node: int, message: object) -> bool:
        return _send(self.agents.get(node), message)

    def respawn(self, node: int) -> set[int]:
        """Start fresh processes for every worker of ``node`` (their earlier ones must be dead); returns them."""
        workers = self.workers_of(node)
        incarnation = 1 + max(self.incarnation.get(w, 0) for w in workers)
        for worker in workers:
            self.workers.pop(worker, None)
            self.incarnation[worker] = incarnation
        self.send_agent(node, msg.SpawnWorkers(tuple(workers), incarnation))
        return set(workers)

    # -- membership --------------------------------------------------------------------------------------------
    def alive_workers(self) -> list[int]:
        return sorted(w for w, m in self.workers.items() if m.alive)

    def gpus_of_node(self) -> dict[int, int]:
        """The GPUs each live node's agent reported it sees."""
        return {n: m.gpus for n, m in self.agents.items() if m.alive}

    def alive_nodes(self) -> list[int]:
        return sorted(n for n, m in self.agents.items() if m.alive)

    def exited_agents(self) -> list[int]:
        """Nodes counted alive whose agent has ended (its closed connection may not have been handled yet)."""
        return sorted(n for n in self.alive_nodes() if self._agent_ended(n))

    def mark_dead(self, role: str, ident: int) -> None:
        table = self.workers if role == "worker" else self.agents
        if ident in table:
            table[ident].alive = False

    def silent_workers(self, timeout_s: float) -> list[int]:
        now = time.monotonic()
        return [w for w, m in self.workers.items() if m.alive and now - m.last_seen > timeout_s]

    def kill_worker(self, worker: int, sig: int = signal.SIGKILL) -> None:
        member = self.workers.get(worker)
        if member is not None and not member.closed:
            self.launcher.signal(member.node, member.pid, sig)

    def kill_node(self, node: int) -> None:
        """A lost machine: the agent and every worker of the node die at once, and its memory is gone."""
        agent = self.agents.get(node)
        workers = [m.pid for w in self.workers_of(node) if (m := self.workers.get(w)) is not None and not m.closed]
        if agent is not None:
            self.launcher.kill_node(node, agent.pid, workers)
        else:
            for pid in workers:
                self.launcher.signal(node, pid, signal.SIGKILL)
        self.lose_memory(node)

    def abandon_node(self, node: int) -> None:
        """Give up a node that failed to start: whatever of it runs is killed (its agent even before it registered),
        its members count as dead, its memory is freed. Nothing of it can register later."""
        self.kill_node(node)
        handle = self._agent_procs.get(node)
        if handle is not None and handle.poll() is None:
            handle.kill()
        self._starting.discard(node)
        self.mark_dead("agent", node)
        for worker in self.workers_of(node):
            self.mark_dead("worker", worker)
            self.incarnation[worker] = self.incarnation.get(worker, 0) + 1  # a late Hello is refused (``_admit``)

    def wait_gone(self, member: Member, timeout_s: float = 10.0) -> None:
        """Wait until a killed worker is gone: its connection closed, and (on this machine) its process ended."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if member.closed and not (self.launcher.same_machine and _running(member.pid)):
                return
            time.sleep(0.01)

    def lose_memory(self, node: int) -> None:
        """The host memory of a node that died: its agent cannot free it, so the coordinator does."""
        shm.remove(shm.node_dir(self.memory_root, node))

    # -- stopping ----------------------------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 10.0) -> None:
        self._closing = True
        for worker in self.alive_workers():
            self.send(worker, msg.Shutdown())
        for node in self.alive_nodes():
            self.send_agent(node, msg.Shutdown())
        deadline = time.monotonic() + grace_s
        for node, handle in self._agent_procs.items():
            try:
                handle.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                handle.kill()
            agent = self.agents.get(node)
            # What the launcher started may not be the agent (ssh, a detached start): its connection tells.
            while agent is not None and not agent.closed and time.monotonic() < deadline:
                time.sleep(0.02)
            if agent is not None and not agent.closed:
                self.launcher.kill_node(node, agent.pid, [])
        for member in self.workers.values():
            if not member.closed:  # stragglers of a failed run
                self.launcher.signal(member.node, member.pid, signal.SIGKILL)
        shm.remove(self.memory_root)  # agents free their own; this catches those that were killed
        self._server.close()
        self.launcher.close()
        # The job is over and its peers are gone: their connections go too, or a process running job after job
        # (a sweep, a test session) would keep every one of them open.
        for member in [*self.agents.values(), *self.workers.values()]:
            member.conn.close()
            if member.aborts is not None:
                member.aborts.close()
        for parts in self._connecting.values():
            for conn, _ in parts.values():
                conn.close()
        self._store = None  # a TCPStore has no close(): its server and sockets go with the last reference


def _send(member: Member | None, message: object) -> bool:
    if member is None or not member.alive:
        return False
    try:
        member.conn.send(message)
        return True
    except OSError:
        return False


def _running(pid: int) -> bool:
    """Whether ``pid`` has not ended. A zombie has: its memory, files and sockets are released, only its entry waits
    for its parent. A lost node's workers are reparented to this machine's init, which can take seconds to reap
    them, and a restart would wait for that."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
