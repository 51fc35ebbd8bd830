"""The node agent: one per node. Starts the node's workers, watches them, heartbeats to the coordinator, and owns
the node's host memory for snapshots.

The agent imports no torch, so a node comes up fast and its own death is noticed the moment its control connection
closes. Workers are started with PR_SET_PDEATHSIG so that a killed agent takes its workers with it, exactly like a
lost machine; the agent likewise dies with the coordinator, by a SIGTERM it answers by ending its workers and then
freeing the node's memory.

The node's memory is a directory under /dev/shm (``runtime.state.shm``): its workers write their snapshot records there,
and they outlive a worker's crash but not the node. The agent creates it, answers inventories of it (which records
of a step pass their checksums, read without torch) and removes it whenever it ends: shut down, its coordinator
gone, or terminated. A node killed outright cannot clean up: the coordinator removes its memory, as the loss of the
machine would. A job killed outright, coordinator and agents alike, leaves its memories to the next agent that starts
on the host: an agent holds its node's memory (``shm.claim``) while it lives, and frees any memory nobody holds.

Started by hand or by a launcher on another host (``ftlab-agent``, ``runtime.processes.launchers``), the agent takes the
coordinator's address on its command line and the job's secret from ``--secret-file`` (``-``: standard input) or
``FTLAB_SECRET``, never from its arguments; it hands the secret to its workers through their environment. It leads a
process group of its own there (its workers are in it), so that a node is lost by signalling one group.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from pathlib import Path

from ftlab.runtime.processes import messages as msg
from ftlab.runtime.state import shm
from ftlab.runtime.processes.placement import visible_gpus

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def terminate_with_parent() -> None:
    """For agents: a SIGTERM when the coordinator dies, which the agent answers by freeing its node's memory."""
    die_with_parent(signal.SIGTERM)


class Agent:
    def __init__(self, args: argparse.Namespace, secret: str) -> None:
        self.args = args
        self.secret = secret
        self.conn = msg.connect(args.coordinator_addr, args.coordinator_port, secret)
        self._send_lock = threading.Lock()
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.memory = shm.node_dir(args.memory_root, args.node)

    def send(self, message: object) -> None:
        with self._send_lock:
            self.conn.send(message)

    def spawn(self, worker: int, incarnation: int) -> None:
        """Start ``worker``; an earlier process of it that still runs (one a restart interrupted while it started)
        is ended first, so it can never register in place of this one."""
        # Called from the main thread only: PDEATHSIG fires when the *thread* that forked the child exits.
        earlier = self.workers.get(worker)
        if earlier is not None and earlier.poll() is None:
            earlier.kill()
            earlier.wait()
        command = [
            sys.executable, "-m", "ftlab.runtime.processes.worker",
            "--coordinator-addr", self.args.coordinator_addr,
            "--coordinator-port", str(self.args.coordinator_port),
            "--host-addr", self.args.host_addr,
            "--device-index", str(self.args.device_offset + self.args.workers.index(worker)),
            "--node", str(self.args.node),
            "--worker", str(worker),
            "--heartbeat-s", str(self.args.heartbeat_s),
            "--threads", str(self.args.threads),
            "--incarnation", str(incarnation),
        ]  # fmt: skip
        env = {**os.environ, msg.SECRET_ENV: self.secret}
        proc = subprocess.Popen(command, env=env, preexec_fn=die_with_parent)
        self.workers[worker] = proc
        threading.Thread(target=self._watch, args=(worker, proc), daemon=True, name=f"watch-{worker}").start()

    def _watch(self, worker: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        try:
            self.send(msg.WorkerExited(worker, code, proc.pid))
        except OSError:
            pass  # the coordinator is gone; so are we shortly

    def end_workers(self) -> None:
        """Kill this node's workers and wait for them: before its memory is removed, so that no worker creates a record
        file in it meanwhile (which left the directory behind: a coordinator killed while the workers wrote their
        first snapshot left its job's memory in /dev/shm)."""
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.workers.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass  # stuck in the kernel with SIGKILL pending: it writes nothing more, the memory goes anyway

    def _heartbeat(self) -> None:
        while True:
            try:
                self.send(msg.Heartbeat())
            except OSError:
                return
            time.sleep(self.args.heartbeat_s)

    def serve(self) -> None:
        self.send(msg.Hello("agent", self.args.node, os.getpid(), host=self.args.host_addr, gpus=visible_gpus()))
        for worker in self.args.workers:
            self.spawn(worker, incarnation=0)
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return  # the coordinator is gone: main ends the workers, then frees the node's memory
            if isinstance(message, msg.SpawnWorkers):
                for worker in message.workers:
                    self.spawn(worker, message.incarnation)
            elif isinstance(message, msg.TakeInventory):
                intact, corrupt = shm.inventory(self.memory, message.step)
                self.send(msg.Inventory(self.args.node, message.step, intact, tuple(corrupt)))
            elif isinstance(message, msg.Shutdown):
                for proc in self.workers.values():
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                return


def host_address(coordinator_addr: str, coordinator_port: int) -> str:
    """The address of this host that the coordinator's host routes to (``--host-addr auto``): the source address
    of a UDP socket connected towards the coordinator (connecting a UDP socket sends nothing)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((coordinator_addr, coordinator_port))
        return probe.getsockname()[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="ftlab node agent: started by the coordinator, or on another host (ftlab-agent). The job's "
        f"secret comes from --secret-file or ${msg.SECRET_ENV}, never from the command line."
    )
    parser.add_argument("--coordinator-addr", default="127.0.0.1")
    parser.add_argument("--coordinator-port", type=int, required=True)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--workers", type=int, nargs="*", default=[])
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory-root", type=Path, required=True)
    parser.add_argument("--host-addr", default="127.0.0.1",
                        help="the address this node's workers are reachable on; auto: the one routed to the coordinator")  # fmt: skip
    parser.add_argument("--device-offset", type=int, default=0, help="the GPU index of this node's first worker")
    parser.add_argument("--secret-file", default=None, help="a file holding the job's secret; -: standard input")
    args = parser.parse_args(argv)
    if args.host_addr == "auto":
        args.host_addr = host_address(args.coordinator_addr, args.coordinator_port)
    return args


def main(argv: list[str] | None = None, own_group: bool = False) -> None:
    args = parse_args(argv)
    secret = msg.job_secret(args.secret_file)
    if own_group and os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # the node is this group: the agent and the workers it starts
    # Memories of earlier jobs killed outright, agents and all, are freed here, where they are: on this host.
    for stale in shm.remove_stale():
        log.warning("freed %s, left by a job that was killed outright", stale)
    memory = shm.node_dir(args.memory_root, args.node)
    shm.claim(memory)  # held until this process ends: a memory nobody holds is stale
    # A terminal's Ctrl-C and hangup go to its whole foreground group, which on one machine holds the agents and the
    # workers too. They are the coordinator's to answer, by shutting the job down in order; an agent or worker that
    # died of them first would look like a failure (and print its traceback). Ignored signals stay ignored in the
    # workers started from here. The coordinator's end still ends us: by SIGTERM (PR_SET_PDEATHSIG) or, for an agent
    # of another host, by its closed connection.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)

    agent: Agent | None = None

    def terminated(signum: int, frame: object) -> None:
        if agent is not None:
            agent.end_workers()
        shm.remove(memory)
        os._exit(0)

    signal.signal(signal.SIGTERM, terminated)
    try:
        agent = Agent(args, secret)
        agent.serve()
    finally:
        if agent is not None:
            agent.end_workers()
        shm.remove(memory)


def cli() -> None:
    """``ftlab-agent``: an agent on a host of its own, leading its own process group."""
    main(own_group=True)


if __name__ == "__main__":
    main()
