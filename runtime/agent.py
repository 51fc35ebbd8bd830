"""The node agent: one per node. Starts the node's workers, watches them, and heartbeats to the coordinator.

The agent imports no torch, so a node comes up fast and its own death is noticed the moment its control connection
closes. Workers are started with PR_SET_PDEATHSIG so that a killed agent takes its workers with it, exactly like a
lost machine; the agent likewise dies with the coordinator.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

from ftlab.runtime import messages as msg

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Agent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.conn = msg.connect(args.coordinator_port)
        self._send_lock = threading.Lock()
        self.workers: dict[int, subprocess.Popen[bytes]] = {}

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
            sys.executable, "-m", "ftlab.runtime.worker",
            "--coordinator-port", str(self.args.coordinator_port),
            "--node", str(self.args.node),
            "--worker", str(worker),
            "--heartbeat-s", str(self.args.heartbeat_s),
            "--threads", str(self.args.threads),
            "--incarnation", str(incarnation),
        ]  # fmt: skip
        proc = subprocess.Popen(command, preexec_fn=die_with_parent)
        self.workers[worker] = proc
        threading.Thread(target=self._watch, args=(worker, proc), daemon=True, name=f"watch-{worker}").start()

    def _watch(self, worker: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        try:
            self.send(msg.WorkerExited(worker, code, proc.pid))
        except OSError:
            pass  # the coordinator is gone; so are we shortly

    def _heartbeat(self) -> None:
        while True:
            try:
                self.send(msg.Heartbeat())
            except OSError:
                return
            time.sleep(self.args.heartbeat_s)

    def serve(self) -> None:
        self.send(msg.Hello("agent", self.args.node, os.getpid()))
        for worker in self.args.workers:
            self.spawn(worker, incarnation=0)
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return  # the coordinator is gone; PDEATHSIG takes the workers down with us
            if isinstance(message, msg.SpawnWorkers):
                for worker in message.workers:
                    self.spawn(worker, message.incarnation)
            elif isinstance(message, msg.Shutdown):
                for proc in self.workers.values():
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                return


def main() -> None:
    parser = argparse.ArgumentParser(description="ftlab node agent (started by the coordinator)")
    parser.add_argument("--coordinator-port", type=int, required=True)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--workers", type=int, nargs="*", default=[])
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    Agent(args).serve()


if __name__ == "__main__":
    main()
