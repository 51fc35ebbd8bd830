"""The races of restarting workers, on real processes: the causes of failures that came in bursts.

- A restart interrupted while its workers start (a node lost meanwhile) is followed by another restart: the
  interrupted start's processes must never register in place of the new ones (it used to crash a worker with
  "RunStep before Configure", configured as one process and stepped as another).
- A lost node's workers are reparented to this machine's init, which may take seconds to reap them: a restart does
  not wait for that (it used to add 1-1.6 s to every restart after a node was lost here).
- Nodes lost at the same instant while workers start are one failure (a spot trace removes nodes in bursts); the
  next plan must not count on any of them (it used to wait 120 s for a lost node's worker, then fail).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from ftlab.runtime.processes.cluster import LocalCluster, _running
from ftlab.runtime.control.events import EventBus
from ftlab.runtime.processes.local_backend import LocalBackend


@pytest.fixture
def backend() -> Iterator[LocalBackend]:
    cluster = LocalCluster(nodes=4, workers_per_node=1, heartbeat_s=0.5, threads_per_worker=1)
    cluster.start(timeout_s=300)
    try:
        yield LocalBackend(cluster, EventBus(), setup={}, heartbeat_timeout_s=30)
    finally:
        cluster.shutdown()


def worker_processes(incarnation: int) -> list[int]:
    """Live worker processes started as the given incarnation."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"ftlab.runtime.processes.worker" in command and command[command.index(b"--incarnation") + 1] == str(incarnation).encode():
            found.append(int(entry.name))
    return found


def test_a_restart_interrupted_while_workers_start_leaves_no_process_to_register_late(backend: LocalBackend) -> None:
    cluster = backend.cluster
    first_pid = cluster.workers[0].pid
    for worker in cluster.alive_workers():
        cluster.kill_worker(worker)
        cluster.mark_dead("worker", worker)
    cluster.respawn(0)  # incarnation 1 starts importing torch ...
    time.sleep(0.5)
    cluster.respawn(0)  # ... and a second restart replaces it before it registers
    cluster.wait_for_workers({0}, timeout_s=300)
    time.sleep(3)  # room for a late registration, which must not come
    assert cluster.incarnation[0] == 2
    assert worker_processes(incarnation=1) == [], "the interrupted start's process still runs"
    assert cluster.worker_pids[0] == [first_pid, cluster.workers[0].pid], "a process of the interrupted start registered"


def test_nodes_lost_together_while_workers_restart_are_one_failure(backend: LocalBackend) -> None:
    cluster = backend.cluster
    agents = [cluster.agents[n].pid for n in (1, 2)]
    timer = threading.Timer(1.0, lambda: [os.kill(pid, 9) for pid in agents])  # while the new workers import torch
    timer.start()
    failure = backend.restart_workers()
    timer.join()
    assert failure is not None and sorted(failure.nodes) == [1, 2]
    assert sorted(backend.membership().slots_of_node) == [0, 3], "a plan made now counts on neither lost node"


def test_a_killed_process_its_parent_has_not_reaped_has_ended() -> None:
    child = subprocess.Popen(["sleep", "60"])
    assert _running(child.pid)
    child.kill()  # never waited for below until checked: a zombie, as a lost node's worker is until init reaps it
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    assert not _running(child.pid)
    os.kill(child.pid, 0)  # still in the process table
    child.wait()
    assert not _running(child.pid)
