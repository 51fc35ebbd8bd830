"""A short real job fills its MLflow run; bad inputs are refused before any worker starts and mark the run FAILED."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ftlab.runtime.plan import Pipeline, Plan, PlanError, Stage

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


def test_a_plan_that_leaves_a_layer_without_replica_is_refused() -> None:
    short = Pipeline((Stage(0, 0, 3), Stage(1, 3, 6)), tuple(range(8)))
    with pytest.raises(PlanError, match="stops at layer 6, the model has 8 layers"):
        Plan(0, 8, 16, 2, (short,)).validate()


def test_a_plan_that_drops_a_microbatch_is_refused() -> None:
    pipeline = Pipeline((Stage(0, 0, 8),), tuple(range(7)))
    with pytest.raises(PlanError, match="exactly once"):
        Plan(0, 8, 16, 2, (pipeline,)).validate()



def test_the_timeline_shows_an_outage_as_zero_throughput() -> None:
    from ftlab.runtime.timeline import throughput_curve

    times, rates = throughput_curve([(0.0, 1.0, 10.0), (1.0, 2.0, 12.0), (5.0, 6.0, 11.0)])
    assert times == [0.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 6.0]
    assert rates == [10.0, 10.0, 12.0, 12.0, 0.0, 0.0, 11.0, 11.0]
