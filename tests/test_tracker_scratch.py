"""A run's local scratch folder (events, plans, figures written before their upload) goes once the run is closed."""

from pathlib import Path

from mlflow.tracking import MlflowClient

from ftlab.runtime.core.config import TrackingConfig
from ftlab.runtime.reporting.tracking import Tracker


def test_a_finished_run_uploads_its_scratch_folder_and_removes_it(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(TrackingConfig(uri=uri))
    run_id = tracker.start({}, {}, "")
    tracker.write_event({"kind": "probe"})
    tracker.write_artifact("plans/plan-0.txt", "a plan")
    assert tracker.local.is_dir()
    tracker.finish(failure="a reason")
    assert not tracker.local.exists()
    client = MlflowClient(uri)
    uploaded = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "plans")}
    assert {"events.jsonl", "plans/plan-0.txt"} <= uploaded
    assert client.get_run(run_id).info.status == "FAILED"


def test_a_tracker_closed_without_a_run_leaves_no_folder() -> None:
    tracker = Tracker(TrackingConfig(uri="sqlite:///:memory:"))
    tracker.finish()
    assert not tracker.local.exists()
