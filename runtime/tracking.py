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


# Metrics are written at most this often. A write is a store transaction; one per step would cost a fast job a
# large share of the coordinator's time.
_METRIC_FLUSH_S = 1.0
_METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch call


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
        self._metrics: list[Metric] = []
        self._flushed_at = time.monotonic()

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
        """Buffered, and written from the caller's thread when the last write is a second old.

        The trainer logs while the workers compute, so a write lands where it delays no iteration. MLflow's
        asynchronous logging would write from its own thread at any moment, for instance just when the workers report
        and the coordinator should answer them.
        """
        assert self.run_id is not None
        now = int(time.time() * 1000)
        self._metrics += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if time.monotonic() - self._flushed_at >= _METRIC_FLUSH_S:
            self.flush()

    def flush(self) -> None:
        assert self.run_id is not None
        for i in range(0, len(self._metrics), _METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=self._metrics[i : i + _METRICS_PER_BATCH])
        self._metrics.clear()
        self._flushed_at = time.monotonic()

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
        self.flush()
        if self.events_path.exists():
            self.log_file(self.events_path)
        if failure is not None:
            self.client.set_tag(self.run_id, "failure_reason", failure[:5000])
            self.log_text("failure.txt", failure)
        status = RunStatus.FAILED if failure is not None else RunStatus.FINISHED
        self.client.set_terminated(self.run_id, RunStatus.to_string(status))
        self.run_id = None
