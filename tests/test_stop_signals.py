"""``ftlab`` stopped from outside while it trains: ``kill`` (SIGTERM to the command), Ctrl-C and a closed terminal
(SIGINT, SIGHUP to its whole foreground group: the agents and workers too). The job's MLflow run ends FAILED with the
signal's name, no worker or agent outlives it, its node memories are gone, and the command says what stopped it in a
line, with the shell's exit status for the signal, and no process prints a traceback."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ftlab.experiments.soak import MARK, leftovers
from ftlab.runtime.state import shm

FTLAB = str(Path(sys.executable).with_name("ftlab"))


@pytest.mark.parametrize(
    "sig",
    [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow), pytest.param(signal.SIGHUP, marks=pytest.mark.slow)],
    ids=lambda s: signal.Signals(s).name,
)  # fmt: skip
def test_a_job_stopped_by_a_signal_is_failed_in_mlflow_and_leaves_nothing_behind(
    sig: int, tmp_path: Path, token_cache: Path
) -> None:
    mark = secrets.token_hex(4)
    command = [
        FTLAB, "experiment=plain", "cluster=local-4", "cluster.nodes=2", "train.steps=100000", "progress=true",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"train.cache_dir={token_cache}",
        f"train.checkpoint_dir={tmp_path}/checkpoints",
    ]  # fmt: skip
    env = {**os.environ, MARK: mark, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:  # a group of its own, as a terminal's foreground job  # fmt: skip
        assert proc.stderr is not None
        for line in proc.stderr:  # training has begun once the progress line reports a step
            if line.startswith("step "):
                break
        else:
            pytest.fail(f"the job ended before its first step: {proc.communicate()}")
        assert len(leftovers(mark)) >= 1 + 2 + 2, "the coordinator, two agents and two workers run"
        if sig == signal.SIGTERM:
            proc.send_signal(sig)
        else:
            os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, err
    assert err.strip().splitlines()[-1] == f"ftlab: stopped by {name}", err
    assert "Traceback" not in err, err
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
    assert run.info.status == "FAILED"
    assert name in run.data.tags["failure_reason"] or sig == signal.SIGINT, run.data.tags["failure_reason"]
    deadline = time.monotonic() + 120  # a process reaped by init after its parent's exit: a bound for a hang only
    while leftovers(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers(mark) == []
    assert list(shm.ROOT.glob(f"ftlab-{proc.pid}-*")) == []


@pytest.mark.slow
def test_a_joblib_sweep_stopped_by_sigterm_fails_its_running_jobs_and_kills_its_parent(
    tmp_path: Path, token_cache: Path
) -> None:
    """joblib's job processes are killed outright when the sweep's process stops, and cannot mark their runs: the
    sweep marks them as it ends."""
    store = f"sqlite:///{tmp_path}/mlflow.db"
    command = [
        FTLAB, "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "experiment=plain", "cluster=local-4",
        "cluster.nodes=2", "train.steps=100000", "train.seed=1,2", f"tracking.uri={store}",
        f"train.cache_dir={token_cache}", f"train.checkpoint_dir={tmp_path}/checkpoints",
        f"hydra.sweep.dir={tmp_path}/multirun",
    ]  # fmt: skip
    with subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:  # fmt: skip
        assert proc.stderr is not None
        for line in proc.stderr:  # the sweep's progress: both jobs have started
            if "2 running" in line:
                break
        else:
            pytest.fail(f"the sweep ended before its jobs ran: {proc.communicate()}")
        client = MlflowClient(store)
        experiment = client.get_experiment_by_name("ftlab").experiment_id
        deadline = time.monotonic() + 300
        while len(client.search_runs([experiment])) < 3 and time.monotonic() < deadline:  # the jobs' runs are open
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    runs = client.search_runs([experiment])
    (parent,) = [r for r in runs if r.data.tags.get("kind") == "sweep"]
    children = [r for r in runs if r is not parent]
    assert parent.info.status == "KILLED"
    assert len(children) == 2
    for child in children:
        assert child.info.status == "FAILED"
        assert "was stopped before this job ended" in child.data.tags["failure_reason"]


INTERRUPTED_WRITES = """
import os, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine
from ftlab.experiments.stop_signals import Stopped, stop_on_signals
from ftlab.runtime.core.config import TrackingConfig
from ftlab.runtime.reporting.tracking import Tracker

uri, sig, attempts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal: a test run in the background ignores it
statements, land_at, landed = 0, None, []


def land(conn, cursor, statement, parameters, context, executemany):
    # After each statement the store runs, in the main thread: the chosen one's write gets the signal before it ends.
    global statements
    if land_at is not None:
        statements += 1
        if statements == land_at:
            landed.append(statement.split()[0])
            os.kill(os.getpid(), sig)


event.listen(Engine, "after_cursor_execute", land)
for attempt in range(attempts):
    stop_on_signals()  # again: a stop leaves SIGTERM and SIGHUP to their default, as a second one should find them
    tracker = Tracker(TrackingConfig(uri=uri))
    tracker.start({}, {}, "")
    statements, land_at = 0, 1 + attempt  # each attempt at the next statement of the writes below
    try:
        while True:  # nothing but writes to the store: the signal lands in one
            tracker.log_metrics({"loss": 1.0}, 0)
            tracker.flush()
    except (KeyboardInterrupt, Stopped) as exc:
        land_at = None
        tracker.finish(failure=type(exc).__name__)
print(" ".join(landed))
"""
"""Runs that write metrics until a stop signal, one after the other; attempt k sends the signal right after the k-th
SQL statement its writes run, inside that write (after an insert, the write holds SQLite's lock until it commits),
and the statements it landed after are printed."""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_signal_in_the_middle_of_a_write_to_the_store_still_lets_the_run_be_failed(sig: int, tmp_path: Path) -> None:
    # Raised inside a write to SQLite, the signal's exception left the store locked, and the write of the FAILED
    # status waited for it forever: an interrupted job hung with its run RUNNING.
    uri, attempts = f"sqlite:///{tmp_path}/mlflow.db", 20
    writing = subprocess.Popen([sys.executable, "-c", INTERRUPTED_WRITES, uri, str(sig), str(attempts)],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        out, _ = writing.communicate(timeout=300)
        assert writing.returncode == 0
    except subprocess.TimeoutExpired:
        pytest.fail("a run could not be closed after the signal")
    finally:
        writing.kill()
        writing.wait()
    landed = out.split()
    assert len(landed) == attempts and "INSERT" in landed, landed  # every signal came from inside a write
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"] * attempts
    stopped_by = "KeyboardInterrupt" if sig == signal.SIGINT else "Stopped"
    assert {r.data.tags["failure_reason"] for r in runs} == {stopped_by}
