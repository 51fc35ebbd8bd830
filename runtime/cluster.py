"""The coordinator's view of a cluster of local processes: control server, rendezvous store, agents, membership.

Everything that arrives from agents and workers (messages, closed connections) becomes a ``ClusterEvent`` on one queue,
which the local backend consumes from a single thread: membership changes and step results are handled in the order they
happened, with no locks in the training logic.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any

import torch.distributed as dist

from ftlab.runtime import messages as msg
from ftlab.runtime import shm
from ftlab.runtime.agent import terminate_with_parent


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


class LocalCluster:
    def __init__(self, nodes: int, workers_per_node: int, heartbeat_s: float, threads_per_worker: int) -> None:
        self.workers_per_node = workers_per_node
        self.heartbeat_s = heartbeat_s
        self.threads_per_worker = threads_per_worker
        self.node_ids = list(range(nodes))
        self.secret = secrets.token_hex(16)
        self.events: queue.Queue[ClusterEvent] = queue.Queue()
        self.agents: dict[int, Member] = {}
        self.workers: dict[int, Member] = {}
        # By pid: workers whose second connection has not arrived yet, with their Hello.
        self._connecting: dict[int, tuple[Member, msg.Hello]] = {}
        self.worker_pids: dict[int, list[int]] = {}
        """Every process each worker id has had, in order: a restarted worker has several."""
        self.incarnation: dict[int, int] = {}
        """Worker id -> the start of it that may register now (0 until it is respawned)."""
        self._agent_procs: dict[int, subprocess.Popen[bytes]] = {}
        self._listener = Listener(("127.0.0.1", 0), authkey=self.secret.encode())
        self.port = self._listener.address[1]
        # The rendezvous store lives in the coordinator, which outlives every generation of workers.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.memory_root = shm.job_root(f"{os.getpid()}-{self.secret[:8]}")
        """The nodes' host memories (``node-N`` each, owned by its agent); removed when the job ends."""
        self._closing = False
        self.started = False
        threading.Thread(target=self._accept, daemon=True, name="control-accept").start()

    def workers_of(self, node: int) -> list[int]:
        return [node * self.workers_per_node + i for i in range(self.workers_per_node)]

    def node_of(self, worker: int) -> int:
        return worker // self.workers_per_node

    # -- starting ----------------------------------------------------------------------------------------------
    def start_node(self, node: int) -> None:
        env = {**os.environ, msg.SECRET_ENV: self.secret, "PYTHONUNBUFFERED": "1"}
        command = [
            sys.executable, "-m", "ftlab.runtime.agent",
            "--coordinator-port", str(self.port),
            "--node", str(node),
            "--heartbeat-s", str(self.heartbeat_s),
            "--threads", str(self.threads_per_worker),
            "--workers", *map(str, self.workers_of(node)),
            "--memory-root", str(self.memory_root),
        ]  # fmt: skip
        self._agent_procs[node] = subprocess.Popen(command, env=env, preexec_fn=terminate_with_parent)
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
            for node, proc in self._agent_procs.items():
                if proc.poll() is not None and node in watched:
                    raise NodeLost(node, proc.returncode)
            if time.monotonic() > deadline:
                missing = sorted(expected - set(self.workers))
                raise ClusterError(f"workers {missing} did not register within {timeout_s:.0f} s")
            time.sleep(0.05)

    # -- control connections -----------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closing:
            try:
                conn = msg.no_delay(self._listener.accept())
                hello = conn.recv()
            except (OSError, EOFError):
                continue  # a peer that failed authentication or vanished while connecting
            if not isinstance(hello, msg.Hello):
                conn.close()
                continue
            if hello.role != "agent" and hello.incarnation != self.incarnation.get(hello.worker, 0):
                conn.close()  # a process of an earlier start, which its agent ends: it must not replace this one
                continue
            if hello.role == "worker":
                # A worker counts once its second connection is there too: an Abort must reach it at any time.
                self._connecting[hello.pid] = Member(hello.role, hello.worker, hello.node, hello.pid, conn), hello
                continue
            if hello.role == "aborts":
                if hello.pid not in self._connecting:
                    conn.close()
                    continue
                member, hello = self._connecting.pop(hello.pid)
                member.aborts = conn
                self.worker_pids.setdefault(member.ident, []).append(member.pid)
            else:
                member = Member(hello.role, hello.node, hello.node, hello.pid, conn)
            (self.workers if member.role == "worker" else self.agents)[member.ident] = member
            if self.started:
                # How the backend learns of joins and restarts.
                self.events.put(ClusterEvent(member.role, member.ident, hello, member.pid))
            threading.Thread(target=self._read, args=(member,), daemon=True, name=f"read-{member.role}{member.ident}").start()

    def _read(self, member: Member) -> None:
        while True:
            try:
                message = member.conn.recv()
            except (EOFError, OSError):
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

    def alive_nodes(self) -> list[int]:
        return sorted(n for n, m in self.agents.items() if m.alive)

    def exited_agents(self) -> list[int]:
        """Nodes counted alive whose agent process has ended (its closed connection may not have been read yet)."""
        return sorted(n for n, proc in self._agent_procs.items() if proc.poll() is not None and n in self.alive_nodes())

    def mark_dead(self, role: str, ident: int) -> None:
        table = self.workers if role == "worker" else self.agents
        if ident in table:
            table[ident].alive = False

    def silent_workers(self, timeout_s: float) -> list[int]:
        now = time.monotonic()
        return [w for w, m in self.workers.items() if m.alive and now - m.last_seen > timeout_s]

    def kill_worker(self, worker: int, sig: int = signal.SIGKILL) -> None:
        member = self.workers.get(worker)
        if member is not None:
            _signal(member.pid, sig)

    def kill_node(self, node: int) -> None:
        """A lost machine: the agent and every worker of the node die at once, and its memory is gone."""
        agent = self.agents.get(node)
        if agent is not None:
            _signal(agent.pid, signal.SIGKILL)
        for worker in self.workers_of(node):
            self.kill_worker(worker)
        self.lose_memory(node)

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
        for proc in self._agent_procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()  # reap it: no zombie outlives the job
        for member in self.workers.values():
            _signal(member.pid, signal.SIGKILL)  # stragglers of a failed run; a no-op for those that exited
        shm.remove(self.memory_root)  # agents free their own; this catches those that were killed
        self._listener.close()


def _send(member: Member | None, message: object) -> bool:
    if member is None or not member.alive:
        return False
    try:
        member.conn.send(message)
        return True
    except OSError:
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
