"""A short real job fills its MLflow run; bad inputs are refused before any worker starts and mark the run FAILED."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ftlab.experiments.job import WARMUP_STEPS
from ftlab.runtime.control.coordinator import JobStopped
from ftlab.runtime.core.plan import Pipeline, Plan, PlanError, Stage

METRICS = ["train/loss", "perf/iter_s", "perf/samples_per_s", "perf/tokens_per_s", "cluster/alive_nodes", "cluster/pipelines"]


def only_run(tmp_path: Path):  # noqa: ANN201 - an mlflow Run
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def test_a_short_job_records_metrics_params_tags_and_artifacts(run, tmp_path: Path) -> None:  # noqa: ANN001
    result = run("train.steps=3")
    client, record = only_run(tmp_path)
    assert record.info.status == "FINISHED" and record.info.run_id == result.run_id
    for name in METRICS:
        history = client.get_metric_history(record.info.run_id, name)
        assert [m.step for m in history] == [0, 1, 2], name
    losses = [m.value for m in client.get_metric_history(record.info.run_id, "train/loss")]
    assert losses == pytest.approx([s.loss for s in result.steps])
    assert record.data.params["train.steps"] == "3" and record.data.params["model.hidden"] == "128"
    assert {k: record.data.tags[k] for k in ("policy", "model", "cluster", "faults")} == {
        "policy": "none", "model": "gpt2-tiny", "cluster": "local-4", "faults": "none",
    }  # fmt: skip
    artifacts = {a.path for a in client.list_artifacts(record.info.run_id)}
    assert {"config.yaml", "events.jsonl", "plans"} <= artifacts
    plan_files = [a.path for a in client.list_artifacts(record.info.run_id, "plans")]
    assert plan_files == ["plans/generation-000.json"]
    local = Path(client.download_artifacts(record.info.run_id, "plans/generation-000.json", str(tmp_path)))
    assert Plan.from_json(local.read_text()) == result.plans[0]
    events = Path(client.download_artifacts(record.info.run_id, "events.jsonl", str(tmp_path))).read_text()
    assert [json.loads(line)["kind"] for line in events.splitlines()] == ["plan"]


def open_sockets() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the directory's own descriptor, closed by now
        if target.startswith("socket:"):
            found.add(target)
    return found


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
def test_a_job_leaves_no_socket_or_server_thread_in_the_process_that_ran_it(run) -> None:  # noqa: ANN001
    # A sweep or a test session runs job after job in one process: each one's listening socket, rendezvous store
    # and every peer's connection must go with it.
    before = open_sockets()
    run("train.steps=2")
    assert open_sockets() <= before
    assert not [t.name for t in threading.enumerate() if t.name.startswith("control-")]


def test_a_plan_that_leaves_a_layer_without_replica_is_refused() -> None:
    short = Pipeline((Stage(0, 0, 3), Stage(1, 3, 6)), tuple(range(8)))
    with pytest.raises(PlanError, match="stops at layer 6, the model has 8 layers"):
        Plan(0, 8, 16, 2, (short,)).validate()


def test_a_plan_that_drops_a_microbatch_is_refused() -> None:
    pipeline = Pipeline((Stage(0, 0, 8),), tuple(range(7)))
    with pytest.raises(PlanError, match="exactly once"):
        Plan(0, 8, 16, 2, (pipeline,)).validate()



def test_the_timeline_shows_an_outage_as_zero_throughput() -> None:
    from ftlab.runtime.reporting.timeline import throughput_curve

    times, rates = throughput_curve([(0.0, 1.0, 10.0), (1.0, 2.0, 12.0), (5.0, 6.0, 11.0)])
    assert times == [0.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 6.0]
    assert rates == [10.0, 10.0, 12.0, 12.0, 0.0, 0.0, 11.0, 11.0]


def events_of(client: MlflowClient, run_id: str, tmp_path: Path) -> list[dict]:
    local = client.download_artifacts(run_id, "events.jsonl", str(tmp_path))
    return [json.loads(line) for line in Path(local).read_text().splitlines()]


def test_a_fault_free_run_reads_goodput_one_and_a_fault_past_the_job_is_a_warning(run, tmp_path: Path, caplog) -> None:  # noqa: ANN001
    result = run("train.steps=12", "faults=fixed", "faults.interval_steps=12", "faults.max_failures=1")
    assert result.summary["summary/failures"] == 0
    steps = result.steps
    assert [s.step for s in steps] == list(range(12)) and len({s.generation for s in steps}) == 1
    # Fault-free, the ratio falls short of 1 by the coordinator's gaps between iterations alone (how long those are
    # is the machine's business): the iterations after the warm-up over the time from its end to the last commit.
    warm = WARMUP_STEPS
    goodput = result.summary["summary/goodput_ratio"]
    assert goodput == pytest.approx(sum(s.iter_s for s in steps[warm:]) / (steps[-1].at - steps[warm - 1].at))
    assert 0 < goodput <= 1 + 1e-9
    assert result.summary["summary/lost_steps_total"] == 0 and result.summary["summary/recovery_s_total"] == 0
    assert result.summary["summary/faults_unfired"] == 1
    assert "fault not fired: the node fault at step 12" in caplog.text
    (missed,) = result.unfired  # what a bench checks: every fault it plans must fire
    assert missed.startswith("node fault at step 12:") and "train.steps" in missed
    client, record = only_run(tmp_path)
    (unfired,) = [e for e in events_of(client, record.info.run_id, tmp_path) if e["kind"] == "fault_unfired"]
    assert unfired["fault"]["at_step"] == 12 and "train.steps" in unfired["reason"]


def test_a_shipped_generated_schedule_fires_in_a_default_job(run, tmp_path: Path) -> None:  # noqa: ANN001
    """faults=fixed under the default train.steps: its first fault (step 10) fires on real processes; policy=none
    stops the job there, which is all this test needs."""
    with pytest.raises(JobStopped):
        run("faults=fixed")
    client, record = only_run(tmp_path)
    fired = [e for e in events_of(client, record.info.run_id, tmp_path) if e["kind"] == "fault_injected"]
    assert [e["fault"]["at_step"] for e in fired] == [10]
