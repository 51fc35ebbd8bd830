"""A run whose coordinator died is marked FAILED by the next ``ftlab`` on its store, and a resumed job continues it;
a sweep whose process died has its parent run marked KILLED, and its unfinished children FAILED.

The coordinator is the real ``ftlab`` command in a process of its own, held before step 4 (``runtime.processes.hold``:
its checkpoint of step 4 is written by then) and SIGKILLed there, as the OOM killer would. Its agents and workers
exit on their own; its run stays RUNNING until another ``ftlab`` opens the store. The sweep is ``ftlab -m`` in a
process group of its own, SIGKILLed whole while its second job is held before its first step.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ftlab.experiments.job import JobResult
from ftlab.runtime.processes.hold import HOLD_DIR_ENV, step_point
from ftlab.runtime.reporting.stale_runs import (
    HEARTBEAT_TAG, HOST_TAG, PID_TAG, STALE_AFTER_S, SWEEP_TAGS, continuation, coordinator_tags, keep_beating,
    lost, reconcile,
)  # fmt: skip
from tests.holds import HANG_S
from tests.oracle import LOSS_RTOL, committed_losses
from tests.support import run_apart

STEPS = 8
JOB = ["experiment=plain", "policy=checkpoint_restart", "protection=storage", "protection.every=2", f"train.steps={STEPS}"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> JobResult:
    return run_apart(tmp_path_factory, token_cache, *JOB)


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + HANG_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {HANG_S} s"
        time.sleep(0.05)


def test_a_killed_coordinators_run_is_failed_by_the_next_ftlab_and_the_resumed_job_continues_it(
    run, job_overrides: list[str], tmp_path: Path, fault_free: JobResult  # noqa: ANN001
) -> None:
    holds = tmp_path / "holds"
    holds.mkdir()
    (holds / f"{step_point(4)}.hold").touch()
    command = [sys.executable, "-m", "ftlab.experiments.main", *job_overrides, *JOB, f"hydra.run.dir={tmp_path}/hydra"]
    coordinator = subprocess.Popen(command, cwd=tmp_path, env={**os.environ, HOLD_DIR_ENV: str(holds)},
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for(holds / f"{step_point(4)}.reached")
    finally:
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("ftlab").experiment_id
    (killed,) = client.search_runs([experiment])
    assert killed.info.status == "RUNNING"  # nobody could close it
    assert killed.data.tags[PID_TAG] == str(coordinator.pid) and killed.data.tags[HOST_TAG] == socket.gethostname()

    # The next ftlab on the store (here one whose input is refused) marks it FAILED.
    refused = subprocess.run([*command, "train.global_batch=15"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=HANG_S)  # fmt: skip
    assert refused.returncode == 1
    killed = client.get_run(killed.info.run_id)
    assert killed.info.status == "FAILED"
    assert killed.data.tags["failure_reason"].startswith(f"coordinator lost: its process {coordinator.pid}")

    # Resumed from its checkpoint, the job continues the same run on the fault-free trajectory.
    run_dir = tmp_path / "checkpoints" / killed.info.run_id
    resumed = run(*JOB, f"train.resume_from={run_dir}")
    assert resumed.run_id == killed.info.run_id
    assert [r.step for r in resumed.steps] == list(range(4, STEPS))
    assert [r.loss for r in resumed.steps] == pytest.approx(committed_losses(fault_free, STEPS)[4:], rel=LOSS_RTOL)
    record = client.get_run(killed.info.run_id)
    assert record.info.status == "FINISHED" and "failure_reason" not in record.data.tags
    assert record.data.tags[PID_TAG] == str(os.getpid())  # the coordinator that continued it
    losses = {m.step for m in client.get_metric_history(killed.info.run_id, "train/loss")}
    assert set(range(4, STEPS)) <= losses
    assert len(client.search_runs([experiment])) == 2  # the killed (now finished) job's run and the refused one


def test_a_killed_sweeps_parent_is_killed_by_the_next_ftlab_with_its_unfinished_children(
    job_overrides: list[str], tmp_path: Path  # noqa: ANN001
) -> None:
    holds = tmp_path / "holds"
    holds.mkdir()
    (holds / f"{step_point(0)}.hold").touch()
    # Job 0 plans and finishes; job 1 trains, held before step 0 with its run open.
    ftlab = [sys.executable, "-m", "ftlab.experiments.main"]
    job = [*job_overrides, "cluster.nodes=1", "train.stages=1", "train.steps=2", f"hydra.sweep.dir={tmp_path}/multirun",
           f"hydra.run.dir={tmp_path}/hydra"]  # fmt: skip
    sweep = subprocess.Popen([*ftlab, "-m", *job, "mode=plan,train"], cwd=tmp_path,
                             env={**os.environ, HOLD_DIR_ENV: str(holds)}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        wait_for(holds / f"{step_point(0)}.reached")
    finally:
        os.killpg(sweep.pid, signal.SIGKILL)  # the sweep, its agents and workers
        sweep.wait()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("ftlab").experiment_id
    (parent,) = client.search_runs([experiment], "tags.kind = 'sweep'")
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    planned, trained = sorted(children, key=lambda r: r.info.start_time)
    assert parent.info.status == trained.info.status == "RUNNING" and planned.info.status == "FINISHED"
    assert parent.data.tags[PID_TAG] == trained.data.tags[PID_TAG] == str(sweep.pid)  # the jobs ran in the sweep

    refused = subprocess.run([*ftlab, *job, "train.global_batch=15"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=HANG_S)  # fmt: skip
    assert refused.returncode == 1
    parent, planned, trained = (client.get_run(r.info.run_id) for r in (parent, planned, trained))
    assert parent.info.status == "KILLED"
    assert parent.data.tags["failure_reason"].startswith(f"sweep lost: its process {sweep.pid} ")
    assert trained.info.status == "FAILED"
    assert trained.data.tags["failure_reason"].startswith(f"coordinator lost: its process {sweep.pid} ")
    assert planned.info.status == "FINISHED" and "failure_reason" not in planned.data.tags


def test_a_sweeps_heartbeat_keeps_its_parent_alive_elsewhere(tmp_path: Path) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("ftlab")
    old = f"{time.time() - STALE_AFTER_S - 1:.0f}"
    tags = {**SWEEP_TAGS, **coordinator_tags(), HOST_TAG: "another-host.invalid", HEARTBEAT_TAG: old}
    parent = client.create_run(experiment, tags=tags).info.run_id
    stop = keep_beating(client, parent, every_s=0.01)
    deadline = time.monotonic() + HANG_S
    while client.get_run(parent).data.tags[HEARTBEAT_TAG] == old:
        assert time.monotonic() < deadline, "no heartbeat was written"
        time.sleep(0.05)
    stop()
    assert reconcile(client) == []
    assert lost(tags, time.time()).startswith("sweep lost: no heartbeat from process")


def test_a_coordinator_is_lost_when_its_process_is_gone_here_or_its_heartbeat_is_old_elsewhere() -> None:
    now = time.time()
    here = coordinator_tags()
    assert lost(here, now) is None  # this very process
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert lost({**here, PID_TAG: str(gone.pid)}, now).startswith(f"coordinator lost: its process {gone.pid}")
    elsewhere = {**here, HOST_TAG: "another-host.invalid"}
    assert lost(elsewhere, now) is None
    old = {**elsewhere, HEARTBEAT_TAG: f"{now - STALE_AFTER_S - 1:.0f}"}
    assert lost(old, now).startswith("coordinator lost: no heartbeat from process")
    assert lost({}, now) is None  # a run of an ftlab without heartbeats


def test_a_resumed_job_links_to_a_run_it_cannot_continue(tmp_path: Path) -> None:
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("ftlab")
    params = {"policy.name": "oobleck", "train.resume_from": "None", "tracking.run_name": "first"}
    resumed = {**params, "train.resume_from": "/somewhere/step-000004", "tracking.run_name": "second"}
    alive = client.create_run(experiment, tags=coordinator_tags()).info.run_id
    client.log_param(alive, "policy.name", "oobleck")
    assert reconcile(client) == []
    assert continuation(client, alive, experiment, False, resumed) == "link"  # its coordinator still runs it
    stale = client.create_run(experiment, tags={**coordinator_tags(), HOST_TAG: "another-host.invalid",
                                                HEARTBEAT_TAG: "0"}).info.run_id  # fmt: skip
    for key, value in params.items():
        client.log_param(stale, key, value)
    assert reconcile(client) == [stale]
    assert continuation(client, stale, experiment, False, resumed) == "continue"
    assert continuation(client, stale, experiment, True, resumed) == "link"  # a sweep's job
    assert continuation(client, stale, experiment, False, {**resumed, "policy.name": "recycle"}) == "link"
    assert continuation(client, "0" * 32, experiment, False, resumed) is None
