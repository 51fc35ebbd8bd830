"""REFT on real processes: checkpoint-restart resumes from the in-memory snapshot, and stays on the fault-free run.

Nodes are SIGKILLed (agent, workers and the node's memory) in several phases of an iteration and in the middle of a
snapshot's copy; with a snapshot every step no committed step is lost. In each protection mode a member of a
sharding group is lost and its shards are rebuilt from peers' copies or decoded from parity: every shard a worker
loads is checked against the CRC its owner reported, so a restore that completes is bit-exact. Two nodes of one
group lost fall back to the flush to storage. A corrupted record is caught by its checksum and never loaded. No
shared-memory segment outlives a job, whether it ends, stops at a failure, or its coordinator is interrupted or
killed.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ftlab.experiments.job import JobResult
from ftlab.runtime.state import shm
from ftlab.runtime.core.contract import MemorySource
from ftlab.runtime.control.coordinator import JobStopped
from ftlab.runtime.processes.local_backend import LocalBackend
from tests.oracle import LOSS_RTOL, assert_on_fault_free_trajectory, committed_losses
from tests.support import a100_profile, explicit, snapshot_history

STEPS = 8
REFT = ["experiment=plain", "policy=checkpoint_restart", "protection=reft", f"protection.flush_every={STEPS}",
        f"train.steps={STEPS}"]  # fmt: skip


def segments(coordinator: int | None = None) -> set[str]:
    """The nodes' memories of jobs coordinated by this process (or ``coordinator``): other jobs may run beside."""
    return {p.name for p in shm.ROOT.glob(f"ftlab-{coordinator or os.getpid()}-*")}


@pytest.fixture(autouse=True)
def no_segment_left() -> object:
    yield
    assert segments() == set(), "a job left its nodes' memory in /dev/shm"


@pytest.fixture(scope="module")
def fault_free_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the fault-free run keeps its MLflow store and checkpoints."""
    return tmp_path_factory.mktemp("fault-free")


@pytest.fixture(scope="module")
def fault_free(fault_free_dir: Path, token_cache: Path) -> JobResult:
    from ftlab.experiments.job import compose_config, run_job

    d = fault_free_dir
    overrides = [f"tracking.uri=sqlite:///{d}/mlflow.db", f"train.cache_dir={token_cache}", f"train.checkpoint_dir={d}",
                 "progress=false", *REFT]  # fmt: skip
    return run_job(compose_config(overrides))


def events_of(result: JobResult, tmp_path: Path) -> list[dict]:
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    local = client.download_artifacts(result.run_id, "events.jsonl", str(tmp_path))
    return [json.loads(line) for line in Path(local).read_text().splitlines()]


def restores(events: list[dict]) -> list[dict]:
    return [e for e in events if e["kind"] == "restore"]


@pytest.mark.parametrize("phase", ["backward", pytest.param("optimizer", marks=pytest.mark.slow), "snapshot"])
def test_a_node_killed_in_any_phase_resumes_from_memory_with_no_step_lost(
    run, tmp_path: Path, fault_free: JobResult, phase: str  # noqa: ANN001
) -> None:
    # "step 5 (snapshot)": the copy of the snapshot of 5 committed steps, killed between a record's bytes and its
    # commit record. Node 1 holds one of the two replicas of the second stage; node 3, the other, has its shards.
    result = run(*REFT, *explicit(f"{{kind: node, node: 1, at_step: 5, phase: {phase}}}"))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    (fault,) = result.faults
    assert fault.lost_steps == 0
    events = events_of(result, tmp_path)
    (restore,) = restores(events)
    assert restore["source"] == "memory" and restore["step"] == (6 if phase == "optimizer" else 5)
    assert [len(p.pipelines) for p in result.plans] == [2, 1], "restarted on the 3 surviving nodes"


def test_each_snapshot_records_its_copy_threads_cpu(fault_free: JobResult, fault_free_dir: Path) -> None:
    # The workers' copy threads' CPU time, added up: a thread's CPU never exceeds its copy's time, and the copy of
    # megabytes of state takes some.
    history = snapshot_history(f"sqlite:///{fault_free_dir}/mlflow.db", fault_free.run_id)
    writers = len(fault_free.plans[0].workers)
    assert history["cpu_s"] and history["cpu_s"].keys() == history["copy_s"].keys() == history["bytes"].keys()
    for step, cpu_s in history["cpu_s"].items():
        assert 0 < cpu_s <= writers * history["copy_s"][step], step


MODES = [("arc", "memory"), ("aec", "parity"), ("arc+aec", "memory"), ("aor", "memory")]


@pytest.mark.parametrize(("mode", "source"), MODES, ids=[m for m, _ in MODES])
def test_each_mode_rebuilds_a_lost_member_of_its_group(
    run, tmp_path: Path, fault_free: JobResult, mode: str, source: str  # noqa: ANN001
) -> None:
    # One stage, three replicas: node 1's shard is kept on node 0 (ARC), decoded from the parities of nodes 0 and 2
    # (AEC), or (AOR, under ZeRO-1) node 0's copy of it holds the optimizer chunk node 0 recomputed every step from
    # node 1's gradient chunk. The kill lands in the backward pass: with ZeRO-1 a kill during the commit's
    # all-gather would tear the step being committed on the survivors (see runtime.processes.zero).
    zero = ["train.zero=1"] if mode == "aor" else []
    result = run(*REFT, "cluster.nodes=3", "train.stages=1", f"protection.mode={mode}", *zero,
                 *explicit("{kind: node, node: 1, at_step: 4, phase: backward}"))  # fmt: skip
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    (restore,) = restores(events_of(result, tmp_path))
    assert (restore["source"], restore["step"]) == (source, 4)
    assert result.faults[0].lost_steps == 0


def test_a_node_running_two_members_of_a_group_is_restored_from_memory(
    run, tmp_path: Path, fault_free: JobResult  # noqa: ANN001
) -> None:
    # Two nodes of two workers, one stage: node 1 runs members 2 and 3 of the one group. Their shards' copies are
    # kept on node 0 (each member copies the shard two ahead); the next member's copy would have died with them.
    result = run(*REFT, "cluster.nodes=2", "cluster.workers_per_node=2", "train.stages=1",
                 *explicit("{kind: node, node: 1, at_step: 4, phase: backward}"))  # fmt: skip
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    (restore,) = restores(events_of(result, tmp_path))
    assert (restore["source"], restore["step"]) == ("memory", 4)
    assert result.faults[0].lost_steps == 0


def test_two_nodes_of_one_group_lost_fall_back_to_the_flush(run, tmp_path: Path, fault_free: JobResult) -> None:  # noqa: ANN001
    result = run(*REFT, "protection.flush_every=3",
                 *explicit("{kind: node, node: 0, at_step: 5}", "{kind: node, node: 2, at_step: 5}"))  # fmt: skip
    assert committed_losses(result, STEPS) == pytest.approx(committed_losses(fault_free, STEPS), rel=LOSS_RTOL)
    events = events_of(result, tmp_path)
    decided = next(e for e in events if e["kind"] == "recovery_decision")
    assert decided["restore"] == "storage of step 3"
    assert "lost shards [0, 1] of layers 0..3" in decided["restore_reason"]
    (restore,) = restores(events)
    assert restore["source"] == "storage" and restore["reason"] == decided["restore_reason"]
    assert result.faults[0].lost_steps == 2 and result.faults[1].lost_steps == 2


def test_a_corrupted_record_is_caught_by_its_checksum_and_never_loaded(
    run, tmp_path: Path, fault_free: JobResult, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    """Worker 1's process dies, so node 1's memory survives; before the restore a shard that another node also
    keeps has bytes flipped. The inventory finds it, the restore leaves it out and uses the other copy."""
    verify = LocalBackend.verify
    flipped = []

    def corrupt_then_verify(self: LocalBackend, source: MemorySource) -> object:
        target = next(r for r in source.records if r.kind == "shard" and any(
            o.kind == "copy" and (o.layers, o.index) == (r.layers, r.index) for o in source.records))  # fmt: skip
        path = shm.node_dir(self.cluster.memory_root, target.node) / target.name
        with open(path, "r+b") as f:
            slot, _ = shm.find_slot(memoryview(f.read(shm.PAGE)), source.step)  # type: ignore[misc]
            f.seek(shm.slot_offset(slot, target.nbytes) + 1000)
            f.write(b"\xde\xad\xbe\xef")
        flipped.append({"node": target.node, "record": target.name, "step": source.step})
        return verify(self, source)

    monkeypatch.setattr(LocalBackend, "verify", corrupt_then_verify)
    result = run(*REFT, *explicit("{kind: process, node: 1, worker: 0, at_step: 4}"))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    events = events_of(result, tmp_path)
    corrupted = [{k: e[k] for k in ("node", "record", "step")} for e in events if e["kind"] == "record_corrupted"]
    assert corrupted == flipped and len(flipped) == 1
    (restore,) = restores(events)
    assert restore["source"] == "memory"


def test_oobleck_falls_back_to_a_restart_from_memory(
    run, tmp_path: Path, fault_free: JobResult, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    """Two 2-node pipelines (f = 1): a worker process dies, so Oobleck counts its node lost and cannot recover in
    place with three whole nodes; it restarts on all four nodes, whose memory survived, from the snapshot."""
    from ftlab.experiments import job as job_module

    monkeypatch.setattr(job_module, "job_profile", a100_profile)
    result = run(*REFT, "policy=oobleck", "policy.fault_threshold=1", "cluster.device_memory_gb=0.04",
                 *explicit("{kind: process, node: 1, worker: 0, at_step: 4, phase: backward}"))  # fmt: skip
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    events = events_of(result, tmp_path)
    decided = next(e for e in events if e["kind"] == "recovery_decision")
    assert decided["outcome"] == "restart" and decided["restore"] == "memory of step 4"
    assert restores(events)[0]["source"] == "memory" and result.faults[0].lost_steps == 0


def test_a_job_stopped_by_a_failure_leaves_no_memory(run) -> None:  # noqa: ANN001
    with pytest.raises(JobStopped):
        run("experiment=plain", "protection=reft", "train.steps=4", *explicit("{kind: node, node: 2, at_step: 2}"))


def answer_ctrl_c() -> None:
    """Run in the job's process before ``ftlab`` starts: SIGINT as a terminal leaves it. A test run started in the
    background hands its children SIGINT ignored, and Python keeps it ignored, so Ctrl-C would never reach the job."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_snapshotting_job(job_overrides: list[str], start_new_session: bool = False) -> subprocess.Popen[bytes]:
    """A long REFT job run as ``ftlab``, once its nodes' memory holds a snapshot."""
    command = [sys.executable, "-m", "ftlab.experiments.main", *job_overrides, *REFT, "train.steps=1000"]
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=start_new_session, preexec_fn=answer_ctrl_c)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not list(shm.ROOT.glob(f"ftlab-{job.pid}-*/node-*/L*")):
            assert time.monotonic() < deadline, "the job wrote no snapshot"
            assert job.poll() is None, "the job ended early"
            time.sleep(0.2)
    except BaseException:
        if start_new_session:
            os.killpg(job.pid, signal.SIGKILL)  # its agents and workers too
        else:
            job.kill()
        raise
    return job


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["interrupted", "coordinator-killed"])
def test_an_interrupted_or_killed_coordinator_leaves_no_memory(job_overrides: list[str], sig: int) -> None:
    coordinator = start_snapshotting_job(job_overrides)
    try:
        coordinator.send_signal(sig)
        coordinator.wait(timeout=300)  # generous: a loaded machine slows the shutdown, which is not what is tested
        deadline = time.monotonic() + 120
        while segments(coordinator.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # a killed coordinator's agents free their nodes' memory on their own SIGTERM
        assert segments(coordinator.pid) == set(), "the job left its nodes' memory in /dev/shm"
    finally:
        if coordinator.poll() is None:
            os.kill(coordinator.pid, signal.SIGKILL)


HOLD = ("import sys, time; from pathlib import Path; from ftlab.runtime.state import shm; "
        "shm.claim(Path(sys.argv[1])); print(flush=True); time.sleep(600)")
"""A process that holds a node's memory, as an agent does, until it is killed."""


def test_memory_nobody_holds_is_freed_and_memory_held_is_kept(tmp_path: Path) -> None:
    held, orphaned = shm.node_dir(tmp_path / "ftlab-11-aa", 0), shm.node_dir(tmp_path / "ftlab-12-bb", 3)
    foreign = tmp_path / "ftlab-constants-x" / "node-0"  # not a job's: never touched
    foreign.mkdir(parents=True)
    holders = [subprocess.Popen([sys.executable, "-c", HOLD, str(d)], stdout=subprocess.PIPE) for d in (held, orphaned)]
    try:
        for holder in holders:
            holder.stdout.readline()  # type: ignore[union-attr]
        (orphaned / "record").write_bytes(b"x" * 100)
        assert shm.remove_stale(tmp_path) == [] and orphaned.is_dir()
        holders[1].kill()
        holders[1].wait()
        assert shm.remove_stale(tmp_path) == [orphaned]
        assert not orphaned.parent.exists() and held.is_dir() and foreign.is_dir()
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def test_memory_of_a_job_killed_outright_is_freed_by_the_next_job_on_the_host(
    job_overrides: list[str], tmp_path: Path
) -> None:
    from ftlab.experiments.job import compose_config, run_job

    # The coordinator, its agents and their workers all SIGKILLed at once (a scheduler's kill of the whole tree, the
    # OOM killer): nobody is left to free the nodes' memory.
    killed = start_snapshotting_job(job_overrides, start_new_session=True)
    # Any ftlab job starting on this host frees such memory (a soak campaign's, beside this suite): held here as its
    # live agents hold it, it stays until this test's own next job, which is then let free it.
    held = [os.open(node, os.O_RDONLY | os.O_DIRECTORY) for node in shm.ROOT.glob(f"ftlab-{killed.pid}-*/node-*")]
    for fd in held:
        fcntl.flock(fd, fcntl.LOCK_SH)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    deadline = time.monotonic() + 60
    while subprocess.run(["pgrep", "-s", str(killed.pid)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "the killed job's workers outlived it"
        time.sleep(0.1)  # its workers die with their agents (PR_SET_PDEATHSIG)
    assert segments(killed.pid), "the killed job left no memory: there is nothing to test"
    for fd in held:
        os.close(fd)
    run_job(compose_config([*job_overrides, *REFT, "train.steps=1"]))
    assert segments(killed.pid) == set(), "the next job left the killed job's memory in /dev/shm"
