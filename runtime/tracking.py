"""MLflow tracking, written by the coordinator alone.

A run is opened before any worker starts and closed on every path out of the job: FINISHED when training
completes, FAILED with the reason (as a tag and a ``failure.txt`` artifact) otherwise. ``events.jsonl`` is written
locally as the job goes, so a crash still leaves a complete audit trail, and uploaded when the run closes.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric, RunStatus
from mlflow.tracking import MlflowClient

from runtime.config import TrackingConfig


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


class Tracker:
    def __init__(self, cfg: TrackingConfig) -> None:
        self.client = MlflowClient(tracking_uri=cfg.uri)
        # Create the store and the experiment here, in the launching process: several processes creating a new
        # SQLite store at once collide.
        experiment = self.client.get_experiment_by_name(cfg.experiment)
        self.experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(cfg.experiment)
        )
        self.run_name = cfg.run_name
        self.run_id: str | None = None
        self.local = Path(tempfile.mkdtemp(prefix="ftlab-run-"))
        self.events_path = self.local / "events.jsonl"
        self._t0 = time.time()

    def start(self, config: dict[str, Any], tags: dict[str, str], config_yaml: str) -> str:
        run = self.client.create_run(self.experiment_id, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        params = {k: str(v)[:6000] for k, v in flatten(config).items()}
        items = list(params.items())
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=[mlflow.entities.Param(k, v) for k, v in items[i : i + 100]])
        self.log_text("config.yaml", config_yaml)
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queued: MLflow writes them from its own thread, off the training loop's critical path."""
        assert self.run_id is not None
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch, synchronous=False)

    def log_text(self, path: str, text: str) -> None:
        assert self.run_id is not None
        self.client.log_text(self.run_id, text, path)

    def log_file(self, local: Path, folder: str | None = None) -> None:
        assert self.run_id is not None
        self.client.log_artifact(self.run_id, str(local), folder)

    def event(self, kind: str, **fields: Any) -> None:
        record = {"t": round(time.time() - self._t0, 6), "wall": time.time(), "kind": kind, **fields}
        with open(self.events_path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def finish(self, failure: str | None = None) -> None:
        if self.run_id is None:
            return
        mlflow.flush_async_logging()  # every queued metric is in the store before the run closes
        if self.events_path.exists():
            self.log_file(self.events_path)
        if failure is not None:
            self.client.set_tag(self.run_id, "failure_reason", failure[:5000])
            self.log_text("failure.txt", failure)
        status = RunStatus.FAILED if failure is not None else RunStatus.FINISHED
        self.client.set_terminated(self.run_id, RunStatus.to_string(status))
        self.run_id = None
