"""The races of restarting workers, on real processes: the causes of failures that came in bursts.

- A restart interrupted while its workers start (a node lost meanwhile) is followed by another restart: the
  interrupted start's processes must never register in place of the new ones (it used to crash a worker with
  "RunStep before Configure", configured as one process and stepped as another).
- A lost node's workers are reparented to this machine's init, which may take seconds to reap them: a restart does
  not wait for that (it used to add 1-1.6 s to every restart after a node was lost here).
- Nodes lost at the same instant while workers start are one failure (a spot trace removes nodes in bursts); the
  next plan must not count on any of them (it used to wait 120 s for a lost node's worker, then fail).

Each race happens at a known point, whatever the machine's speed: the restarted workers are held
(``runtime.processes.hold``) once they have imported torch and before they register, and the test acts while they wait.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ftlab.runtime.control.events import EventBus
from ftlab.runtime.processes.cluster import LocalCluster, _running
from ftlab.runtime.processes.hold import HOLD_DIR_ENV, worker_point
from ftlab.runtime.processes.local_backend import LocalBackend

HANG_S = 300
"""How long a test waits for a process to reach a point before it calls that a hang (as ``cluster.start`` does)."""


@pytest.fixture
def holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's hold directory (``runtime.processes.hold``), in the environment the cluster's agents inherit."""
    monkeypatch.setenv(HOLD_DIR_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def backend(holds: Path) -> Iterator[LocalBackend]:
    cluster = LocalCluster(nodes=4, workers_per_node=1, heartbeat_s=0.5, threads_per_worker=1)
    cluster.start(timeout_s=HANG_S)
    try:
        yield LocalBackend(cluster, EventBus(), setup={}, heartbeat_timeout_s=30)
    finally:
        for gate in holds.glob("*.hold"):
            gate.unlink()  # a worker still held goes on, to be shut down with the others
        cluster.shutdown()


def hold_at(holds: Path, point: str) -> None:
    (holds / f"{point}.hold").touch()


def release(holds: Path, point: str) -> None:
    (holds / f"{point}.hold").unlink()


def reached(holds: Path, point: str) -> int:
    """Wait until a process stands at a held ``point``; its pid."""
    mark = holds / f"{point}.reached"
    deadline = time.monotonic() + HANG_S
    while not mark.exists():
        assert time.monotonic() < deadline, f"no process reached {point}"
        time.sleep(0.01)
    return int(mark.read_text())


def worker_processes(cluster: LocalCluster, incarnation: int) -> list[int]:
    """Live worker processes of ``cluster`` (by its control server's port: other jobs may run on this host) started
    as the given incarnation."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if (b"ftlab.runtime.processes.worker" in command
                and command[command.index(b"--coordinator-port") + 1] == str(cluster.port).encode()
                and command[command.index(b"--incarnation") + 1] == str(incarnation).encode()):  # fmt: skip
            found.append(int(entry.name))
    return found


def test_a_restart_interrupted_while_workers_start_leaves_no_process_to_register_late(
    backend: LocalBackend, holds: Path
) -> None:
    cluster = backend.cluster
    first_pid = cluster.workers[0].pid
    interrupted_start = worker_point(0, incarnation=1)
    hold_at(holds, interrupted_start)
    for worker in cluster.alive_workers():
        cluster.kill_worker(worker)
        cluster.mark_dead("worker", worker)
    cluster.respawn(0)  # incarnation 1 starts ...
    interrupted = reached(holds, interrupted_start)  # ... has imported torch, and is about to register ...
    cluster.respawn(0)  # ... when a second restart replaces it
    cluster.wait_for_workers({0}, timeout_s=HANG_S)
    assert cluster.incarnation[0] == 2
    # Held before its Hello, the interrupted process has sent nothing: ended, it can never register.
    assert not _running(interrupted), "the interrupted start's process still runs"
    assert worker_processes(cluster, incarnation=1) == []
    registered = cluster.worker_pids[0]
    assert registered == [first_pid, cluster.workers[0].pid], "a process of the interrupted start registered"


def test_nodes_lost_together_while_workers_restart_are_one_failure(backend: LocalBackend, holds: Path) -> None:
    cluster = backend.cluster
    agents = [cluster.agents[n].pid for n in (1, 2)]
    starts = {node: worker_point(node, incarnation=1) for node in cluster.node_ids}  # one worker a node
    for point in starts.values():
        hold_at(holds, point)
    lost: list[BaseException] = []

    def lose_nodes_while_workers_start() -> None:
        try:
            for node in (1, 2):
                reached(holds, starts[node])  # the restarted workers have imported torch and not registered
            for pid in agents:
                os.kill(pid, signal.SIGKILL)
            for node in (0, 3):
                release(holds, starts[node])
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            lost.append(exc)

    killer = threading.Thread(target=lose_nodes_while_workers_start)
    killer.start()
    failure = backend.restart_workers()
    killer.join()
    assert not lost, lost
    assert failure is not None and sorted(failure.nodes) == [1, 2]
    assert sorted(backend.membership().slots_of_node) == [0, 3], "a plan made now counts on neither lost node"


def test_a_killed_process_its_parent_has_not_reaped_has_ended() -> None:
    child = subprocess.Popen(["sleep", "60"])
    assert _running(child.pid)
    child.kill()  # never waited for below until checked: a zombie, as a lost node's worker is until init reaps it
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # returns once it has ended, and leaves it unreaped
    assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    assert not _running(child.pid)
    os.kill(child.pid, 0)  # still in the process table
    child.wait()
    assert not _running(child.pid)
