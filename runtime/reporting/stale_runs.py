"""Runs whose coordinator died, and a resumed job's place in MLflow.

A coordinator killed outright (SIGKILL, the OOM killer, a lost head node) cannot close its run, which would stay
RUNNING for ever. So every run records its coordinator (host and pid) and a heartbeat: a tag rewritten at most every
``HEARTBEAT_S``, in the same store transaction as the metrics the coordinator flushes anyway. Whoever opens the store
next (``reconcile``) marks a RUNNING run FAILED, reason "coordinator lost", when its coordinator is gone: on this
host, when its process is gone; on any host, when its heartbeat is older than ``STALE_AFTER_S``, which is longer than
any phase a live coordinator spends without flushing (nodes starting, a recovery).

A sweep's parent run is kept by the sweep's own process (``experiments/sweep.py``), which writes nothing to it while
its jobs run: it records that process the same way, and a thread of it rewrites the heartbeat (``keep_beating``).
Found gone, it is marked KILLED, reason "sweep lost", as a sweep stopped from outside is closed; its children are runs
like any other, each marked by its own coordinator's tags (a child whose coordinator still runs goes on and closes its
run).

A job resumed from a checkpoint (``train.resume_from``; checkpoints live under ``<checkpoint_dir>/<run id>``)
continues the run that wrote it: the same run id, its metrics going on from the resumed step (``continuation``).
Where it cannot (that run is still RUNNING with a live coordinator, it is in another experiment, the job is one of a
sweep, whose runs are the sweep's children, or its settings differ beyond where it resumes from and where it records,
so that one run's params could not describe both), the new run is linked to it: tag ``RESUMES_TAG`` and, outside a
sweep, as its child, so the UI shows one job.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ftlab.runtime.reporting.held_signals import store_access

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

HOST_TAG = "ftlab.coordinator.host"
PID_TAG = "ftlab.coordinator.pid"
HEARTBEAT_TAG = "ftlab.heartbeat"
"""Seconds since the epoch when the run's process (its coordinator, or a sweep's) was last heard of."""
RESUMES_TAG = "ftlab.resumes_run"
"""On a run linked to the run whose checkpoint it resumed from: that run's id."""
SETTINGS_A_RESUME_MAY_CHANGE = ("train.resume_from", "tracking.", "progress")
"""Params (prefixes) in which a job continuing a run may differ from it."""
HEARTBEAT_S = 10.0
STALE_AFTER_S = 900.0
LOST = "coordinator lost"
SWEEP_TAGS = {"kind": "sweep"}
"""The tags that make a run a sweep's parent."""
SWEEP_LOST = "sweep lost"


def beat() -> str:
    """The heartbeat tag's value now."""
    return f"{time.time():.0f}"


def coordinator_tags() -> dict[str, str]:
    """Who writes this run: this process on this host, heard of now."""
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(os.getpid()), HEARTBEAT_TAG: beat()}


def keep_beating(client: MlflowClient, run_id: str, every_s: float = HEARTBEAT_S) -> Callable[[], None]:
    """Rewrite run ``run_id``'s heartbeat every ``every_s`` from a thread of its own, for a run its process writes
    nothing else to for long (a sweep's parent, while the jobs run); the function that stops it."""
    from mlflow.exceptions import MlflowException

    stop = threading.Event()

    def beating() -> None:
        while not stop.wait(every_s):
            try:
                client.set_tag(run_id, HEARTBEAT_TAG, beat())
            except MlflowException:
                pass  # a store busy with the jobs' writes: the next beat comes long before the run would look stale

    thread = threading.Thread(target=beating, daemon=True, name="heartbeat")
    thread.start()

    def stopped() -> None:
        stop.set()
        thread.join()

    return stopped


def _process_gone(pid: int) -> bool:
    """No process ``pid`` on this host, or only its zombie (killed, not yet reaped by its parent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's live process
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return False


def lost(tags: dict[str, str], now: float) -> str | None:
    """Why the process of a RUNNING run with these tags (its coordinator, or a sweep's) is gone, or None (alive, or a
    run that records no process)."""
    host, pid, heard = tags.get(HOST_TAG), tags.get(PID_TAG), tags.get(HEARTBEAT_TAG)
    if host is None or pid is None or heard is None:
        return None  # a run of an ftlab without heartbeats
    age = now - float(heard)
    what = SWEEP_LOST if _is_sweep(tags) else LOST
    if host == socket.gethostname() and _process_gone(int(pid)):
        return f"{what}: its process {pid} on {host} is gone (last heard of {age:.0f} s ago)"
    if age > STALE_AFTER_S:
        return f"{what}: no heartbeat from process {pid} on {host} for {age:.0f} s"
    return None


def _is_sweep(tags: dict[str, str]) -> bool:
    return all(tags.get(k) == v for k, v in SWEEP_TAGS.items())


@store_access
def reconcile(client: MlflowClient) -> list[str]:
    """Mark FAILED every RUNNING run of the store whose coordinator is gone (``lost``), KILLED a sweep's parent whose
    process is, ended at its last heartbeat; the ids of the runs marked."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    now = time.time()
    marked = []
    for run in client.search_runs(experiments, "attributes.status = 'RUNNING'", max_results=1000):
        why = lost(run.data.tags, now)
        if why is None:
            continue
        client.set_tag(run.info.run_id, "failure_reason", why)
        status = "KILLED" if _is_sweep(run.data.tags) else "FAILED"
        client.set_terminated(run.info.run_id, status, end_time=int(float(run.data.tags[HEARTBEAT_TAG]) * 1000))
        marked.append(run.info.run_id)
    return marked


@store_access
def continuation(
    client: MlflowClient, run_id: str, experiment_id: str, in_sweep: bool, params: dict[str, str]
) -> Literal["continue", "link"] | None:
    """What a job with ``params`` resumed from a checkpoint of run ``run_id`` does with that run: continue it, link
    to it, or neither (no such run in this store: the checkpoint came from elsewhere)."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        return None
    alive = run.info.status == "RUNNING" and lost(run.data.tags, time.time()) is None
    if alive or in_sweep or run.info.experiment_id != experiment_id or not _same_job(run.data.params, params):
        return "link"
    return "continue"


def _same_job(old: dict[str, str], new: dict[str, str]) -> bool:
    def job(params: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in params.items() if not k.startswith(SETTINGS_A_RESUME_MAY_CHANGE)}

    return job(old) == job(new)


@store_access
def reopen(client: MlflowClient, run_id: str, tags: dict[str, str]) -> None:
    """Mark run ``run_id`` RUNNING again with ``tags``: its earlier failure reason goes, its metrics and params stay."""
    from mlflow.entities import RunTag

    if "failure_reason" in client.get_run(run_id).data.tags:
        client.delete_tag(run_id, "failure_reason")
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    client.update_run(run_id, status="RUNNING")
