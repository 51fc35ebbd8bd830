"""Real faults against real processes, recovered by checkpoint-restart, checked against a fault-free run.

A node is killed (SIGKILL of its agent and workers) in each phase of an iteration and in the middle of a checkpoint
write; a worker process is killed; a worker hangs (SIGSTOP); a node joins. Every job must finish with the
fault-free run's loss at every step (within the equivalence tolerance: a restart may use another grid), and every
committed checkpoint must load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ftlab.runtime.state import checkpoint
from ftlab.runtime.training.layer_state import decode
from ftlab.experiments.job import JobResult
from ftlab.runtime.control.coordinator import JobStopped
from tests.holds import holds, up_before  # noqa: F401 - holds: a fixture
from tests.oracle import LOSS_RTOL, committed_losses
from tests.support import run_apart

STEPS = 8
COMMON = ["experiment=plain", "policy=checkpoint_restart", "protection=storage", "protection.every=3", f"train.steps={STEPS}"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> list[float]:
    return committed_losses(run_apart(tmp_path_factory, token_cache, *COMMON), STEPS)



def events_of(result: JobResult, tmp_path: Path) -> list[dict]:
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    local = client.download_artifacts(result.run_id, "events.jsonl", str(tmp_path))
    return [json.loads(line) for line in Path(local).read_text().splitlines()]


def assert_checkpoints_sound(result: JobResult) -> None:
    committed = [d for d in Path(result.checkpoint_dir).glob("step-*") if (d / checkpoint.MANIFEST).exists()]
    assert committed, "no committed checkpoint"
    for directory in committed:
        manifest = json.loads((directory / checkpoint.MANIFEST).read_text())
        for layer in range(manifest["num_layers"]):
            state = decode(checkpoint.layer_path(directory, layer).read_bytes())
            assert state["module"] and state["optimizer"]["state"], f"{directory} layer {layer} is empty"


def explicit(*events: str) -> list[str]:
    return ["faults=explicit", f"faults.events=[{', '.join(events)}]"]


@pytest.mark.parametrize(
    "phase", ["forward", "checkpoint", *(pytest.param(p, marks=pytest.mark.slow) for p in ("backward", "reduce", "optimizer"))]
)
def test_a_node_killed_in_any_phase_is_recovered_on_the_fault_free_curve(
    run, tmp_path: Path, fault_free: list[float], phase: str  # noqa: ANN001
) -> None:
    # Checkpoints are written after steps 3 and 6; "step 6 (checkpoint)" is the writing of the second one.
    result = run(*COMMON, *explicit(f"{{kind: node, node: 1, at_step: {6 if phase == 'checkpoint' else 5}, phase: {phase}}}"))
    assert committed_losses(result, STEPS) == pytest.approx(fault_free, rel=LOSS_RTOL)
    (fault,) = result.faults
    assert fault.kind == "node" and fault.detect_s is not None and fault.recover_s is not None
    # Step 5 commits before its optimizer phase; a torn checkpoint 6 is never used: both resume from step 3.
    assert fault.lost_steps == (3 if phase in ("optimizer", "checkpoint") else 2)
    assert [len(p.pipelines) for p in result.plans] == [2, 1], "restarted on the 3 surviving nodes"
    kinds = [e["kind"] for e in events_of(result, tmp_path)]
    assert kinds.index("fault_injected") < kinds.index("failure_detected") < kinds.index("recovered")
    assert_checkpoints_sound(result)
    assert result.summary["summary/failures"] == 1 and 0 < result.summary["summary/goodput_ratio"] < 1


def test_a_killed_worker_process_is_recovered_and_its_node_keeps_serving(run, fault_free: list[float]) -> None:  # noqa: ANN001
    result = run(*COMMON, *explicit("{kind: process, node: 2, worker: 0, at_step: 4}"))
    assert committed_losses(result, STEPS) == pytest.approx(fault_free, rel=LOSS_RTOL)
    assert [len(p.pipelines) for p in result.plans] == [2, 2], "the node survived, so its restarted worker rejoins"
    assert result.faults[0].kind == "process"


def test_replicas_restoring_from_storage_pass_each_layer_along_a_chain(run, fault_free: list[float]) -> None:  # noqa: ANN001
    # Data parallel alone: after the restart the three surviving replicas each load the whole model, the first reading
    # each layer from storage and passing it to the second, which passes it to the third.
    result = run(*COMMON, "train.stages=1", *explicit("{kind: node, node: 2, at_step: 4, phase: backward}"))
    assert committed_losses(result, STEPS) == pytest.approx(fault_free, rel=LOSS_RTOL)
    assert [len(p.pipelines) for p in result.plans] == [4, 3]


def test_a_hung_worker_is_detected_fenced_and_recovered(run, tmp_path: Path, fault_free: list[float]) -> None:  # noqa: ANN001
    result = run(*COMMON, "cluster.heartbeat_timeout_s=2", *explicit("{kind: hang, node: 3, worker: 0, at_step: 4}"))
    assert committed_losses(result, STEPS) == pytest.approx(fault_free, rel=LOSS_RTOL)
    events = events_of(result, tmp_path)
    hung = next(e for e in events if e["kind"] == "fault_injected")
    assert any(e["kind"] == "hang_detected" and e["worker"] == 3 for e in events)
    assert result.faults[0].detect_s is not None and result.faults[0].detect_s >= 2, "noticed by the heartbeat timeout"
    assert hung["workers"] == [3]


def test_a_stall_that_fails_peers_with_no_death_gets_a_failed_worker_fenced(run, tmp_path: Path, fault_free: list[float]) -> None:  # noqa: ANN001
    # Worker 3 stops for 6 s at step 4 and goes on: its peers' operations time out after 2 s and report failures that
    # no death explains. Each failed worker waits for an abort that only a failure brings, so without a fence the job
    # would wait for ever; the first to report is fenced once the heartbeat timeout passes, and the job recovers.
    result = run(*COMMON, "cluster.comm_timeout_s=2", "cluster.heartbeat_timeout_s=12",
                 *explicit("{kind: hang, node: 3, worker: 0, at_step: 4, for_s: 6}"))  # fmt: skip
    assert committed_losses(result, STEPS) == pytest.approx(fault_free, rel=LOSS_RTOL)
    events = events_of(result, tmp_path)
    failed = [e for e in events if e["kind"] == "comm_error"]
    fenced = [e for e in events if e["kind"] == "comm_error_fenced"]
    assert failed and fenced, "the stall failed its peers' operations, and a failed worker was fenced"
    assert fenced[0]["worker"] == failed[0]["worker"] and fenced[0]["waited_s"] >= 12
    assert not any(e["kind"] == "hang_detected" for e in events), "a 6 s stall is no hang under a 12 s timeout"
    assert any(e["kind"] == "failure_detected" and fenced[0]["worker"] in e["workers"] for e in events)


def test_a_hang_and_a_node_loss_in_one_step_are_one_recovery(run, fault_free: list[float]) -> None:  # noqa: ANN001
    # The node's loss starts the abort; the hung worker never acknowledges it, and is found only at the heartbeat
    # timeout, after the others did. Their acknowledgements must outlive that interruption of the wait (seed
    # 31338's soak scenario 27 waited for them again, forever).
    result = run(*COMMON, "cluster.heartbeat_timeout_s=2",
                 *explicit("{kind: hang, node: 0, worker: 0, at_step: 4}", "{kind: node, node: 3, at_step: 4, phase: forward}"))  # fmt: skip
    assert committed_losses(result, STEPS) == pytest.approx(fault_free, rel=LOSS_RTOL)
    assert sorted(f.kind for f in result.faults) == ["hang", "node"]


def test_a_joined_node_is_absorbed_at_the_next_restart(run, holds: Path, fault_free: list[float]) -> None:  # noqa: ANN001
    # Node 4 boots beside training from step 3 on; it is up before step 5 ends (``up_before``), so it is a member by
    # the restart of step 6.
    faults = explicit("{kind: node, node: 1, at_step: 2}", "{kind: join, node: 4, at_step: 3}",
                      "{kind: process, node: 0, worker: 0, at_step: 6}")  # fmt: skip
    result = up_before(holds, [4], 5, lambda: run(*COMMON, *faults))
    assert committed_losses(result, STEPS) == pytest.approx(fault_free, rel=LOSS_RTOL)
    final = result.plans[-1]
    assert 4 in final.workers and 1 not in final.workers and len(final.pipelines) == 2


def test_policy_none_stops_at_the_first_failure_and_marks_the_run_failed(run, tmp_path: Path) -> None:  # noqa: ANN001
    with pytest.raises(JobStopped, match="policy=none does not recover"):
        run("train.steps=6", *explicit("{kind: node, node: 2, at_step: 3}"))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (record,) = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
    assert record.info.status == "FAILED"
    assert "node 2 failed" in record.data.tags["failure_reason"]


def children() -> set[str]:
    return set(Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text().split())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_no_process_outlives_a_job(run) -> None:  # noqa: ANN001
    before = children()  # e.g. multiprocessing's resource tracker, started by an earlier test
    result = run(*COMMON, "train.steps=4", *explicit("{kind: node, node: 3, at_step: 2}"))
    assert children() - before == set(), "agents left behind by the job"
    workers = [pid for pids in result.worker_pids.values() for pid in pids]
    assert len(workers) > 4, "the restart started new worker processes"
    assert [pid for pid in workers if alive(pid)] == [], "workers left behind by the job"
