"""MLflow tracking, written by the coordinator's process alone.

A run is opened before any worker starts and closed on every path out of the job: FINISHED when training
completes, FAILED with the reason (as a tag and a ``failure.txt`` artifact) otherwise. ``RunRecorder`` turns the
job's event stream into the run's record: per-step and per-fault metrics, the plans, and ``events.jsonl`` (written
locally as the job goes, so a crash still leaves a complete audit trail, and uploaded when the run closes).

A SQLite store keeps its artifacts beside the database file (``<dir>/mlartifacts``), not in the working directory.
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

from ftlab.runtime import events as ev
from ftlab.runtime.config import TrackingConfig


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def artifact_location(uri: str) -> str | None:
    """Beside the database for a SQLite store (MLflow's default is ./mlruns of whatever directory a job ran in)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts").as_uri()


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
            experiment.experiment_id
            if experiment
            else self.client.create_experiment(cfg.experiment, artifact_location=artifact_location(cfg.uri))
        )
        self.run_name = cfg.run_name
        self.run_id: str | None = None
        self.local = Path(tempfile.mkdtemp(prefix="ftlab-run-"))
        self.events_path = self.local / "events.jsonl"
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

        The coordinator reports a step while the workers compute the next one, so a write lands where it delays no
        iteration. MLflow's asynchronous logging would write from its own thread at any moment, for instance just
        when the workers report and the coordinator should answer them.
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

    def set_tag(self, key: str, value: str) -> None:
        assert self.run_id is not None
        self.client.set_tag(self.run_id, key, value)

    def log_text(self, path: str, text: str) -> None:
        assert self.run_id is not None
        self.client.log_text(self.run_id, text, path)

    def log_file(self, local: Path, folder: str | None = None) -> None:
        assert self.run_id is not None
        self.client.log_artifact(self.run_id, str(local), folder)

    def write_event(self, record: dict[str, Any]) -> None:
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


class RunRecorder:
    """The event stream as an MLflow run: metrics of every step and every fault, each plan, ``events.jsonl``."""

    def __init__(self, tracker: Tracker, seq_len: int, clock_origin: float) -> None:
        self.tracker = tracker
        self.seq_len = seq_len
        self.origin = clock_origin
        """The backend-clock time written as t = 0 in events.jsonl."""

    def __call__(self, event: ev.Event) -> None:
        match event:
            case ev.StepCommitted():
                samples = event.samples / event.iter_s
                metrics = {
                    "train/loss": event.loss,
                    "perf/iter_s": event.iter_s,
                    "perf/samples_per_s": samples,
                    "perf/tokens_per_s": samples * self.seq_len,
                    "cluster/alive_nodes": event.alive_nodes,
                    "cluster/pipelines": event.pipelines,
                }
                if event.snapshot_s is not None:
                    metrics["ft/snapshot_s"] = event.snapshot_s
                self.tracker.log_metrics(metrics, event.step)
            case ev.SnapshotTaken():
                # At the index of the last step the snapshot holds, as train/loss of that step.
                self.tracker.log_metrics({"ft/snapshot_copy_s": event.copy_s, "ft/snapshot_bytes": event.nbytes},
                                         event.step - 1)  # fmt: skip
            case ev.StateRestored():
                self.tracker.log_metrics({"ft/restore_s": event.seconds, "ft/restore_bytes": event.nbytes},
                                         event.generation)  # fmt: skip
                self.tracker.set_tag("restore_source", event.source)
            case ev.PlanConfigured():
                self.tracker.log_text(f"plans/generation-{event.generation:03d}.json", event.plan.to_json())
            case ev.Recovered():
                metrics = {
                    "ft/detect_s": event.detect_s,
                    "ft/recover_s": event.recover_s,
                    "ft/lost_steps": event.lost_steps,
                    "ft/transfer_bytes": event.transfer_bytes,
                }
                self.tracker.log_metrics({k: v for k, v in metrics.items() if v is not None}, event.fault)
        if event.logged:
            self.tracker.write_event(
                {"t": round(event.at - self.origin, 6), "wall": time.time(), "kind": event.kind, **event.fields()}
            )
