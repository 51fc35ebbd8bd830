"""MLflow tracking, written by the coordinator's process alone.

A run is opened before any worker starts and closed on every path out of the job: FINISHED when training
completes, FAILED with the reason (as a tag and a ``failure.txt`` artifact) otherwise. ``RunRecorder`` turns the
job's event stream into the run's record: per-step and per-fault metrics, and the plans and ``events.jsonl`` (both
written locally as the job goes, so a crash still leaves a complete audit trail, and uploaded when the run closes).

A SQLite store keeps its artifacts beside the database file (``<dir>/mlartifacts``), not in the working directory.
MLflow loads when a store is first opened, not when this module is imported: a job refused by its checks is
answered before the seconds MLflow's import takes (``experiments/main.py``).

Opening a store marks FAILED the runs whose coordinator died without closing them; a run carries its coordinator's
host, pid and heartbeat for that, and a resumed job continues the run it resumes (``stale_runs``).

The experiment is made to open on its runs, in MLflow's model-training navigation. MLflow's UI (3.17) takes an
experiment's kind from its workflow switch ("GenAI" or "Model training"): the address's ``workflowType`` parameter,
else the switch as this browser last left it, else GenAI, whose experiment page is an "Overview" of traces; the
experiment's ``mlflow.experimentKind`` tag only labels it (and decides in UIs without the switch). So the addresses
ftlab prints carry ``workflowType=machine_learning``: ``view_url`` opens the runs table sorted by goodput, and
``compare_url`` the side-by-side comparison of some runs.

The runs table shows no metric column until a user chooses some, in state each browser keeps for itself; a view
stored on the experiment is the only way to bring columns along, and the UI shows a "shared view" banner over any
such view. So the key figures are a saved view, named in the table's "Views" menu, that a user opens by choice
(``figures_url`` opens it directly), and the runs table ``view_url`` opens has no banner.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftlab.runtime.control import events as ev
from ftlab.runtime.control.update import StepNumerics
from ftlab.runtime.core.config import TrackingConfig
from ftlab.runtime.core.contract import ConfigError
from ftlab.runtime.reporting.held_signals import store_access
from ftlab.runtime.reporting.stale_runs import (
    HEARTBEAT_S, HEARTBEAT_TAG, RESUMES_TAG, beat, continuation, coordinator_tags, reconcile, reopen,
)  # fmt: skip

if TYPE_CHECKING:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient


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


EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")  # mlflow/demo/generators/traces.py
WORKFLOW = ("workflowType", "machine_learning")
"""The address parameter that opens an MLflow page in the model-training navigation, whatever the browser's switch."""
PARENT_TAG = "mlflow.parentRunId"
NOTE_TAG = "mlflow.note.content"
"""The run's description in the UI (markdown)."""
VIEW_KEY = "ftlab"
VIEW_NAME = "ftlab: key figures"
KEY_FIGURES = (
    "summary/goodput_ratio",
    "summary/recovery_s_total",
    "summary/lost_steps_total",
    "summary/failures",
    "summary/samples_per_s",
    "summary/final_loss",
)


def _view_state() -> str:
    """The runs table with the key figures and the description as columns, best goodput first, child runs shown
    under their sweep (the UI's uiState and search facets, as its Share button stores them)."""
    columns = [f"metrics.`{name}`" for name in KEY_FIGURES] + ["attributes.`Description`"]
    return json.dumps({
        "selectedColumns": columns,
        "columnOrder": columns,
        "orderByKey": f"metrics.`{KEY_FIGURES[0]}`",
        "orderByAsc": False,
        "runsExpanded": {},
    })  # fmt: skip


def _view_tag(stored: str | None) -> str:
    """The key figures' saved view as the UI stores one (``mlflow.sharedViewState.<key>``): a name for the "Views"
    menu, creation and update times in milliseconds, and the state as a string. A stored tag that already holds this
    view is kept as it is, so its times stay those of its creation."""
    state = _view_state()
    try:
        envelope = json.loads(stored) if stored else None
    except ValueError:
        envelope = None
    if isinstance(envelope, dict) and envelope.get("name") == VIEW_NAME and envelope.get("state") == state:
        return str(stored)
    now = int(time.time() * 1000)
    return json.dumps({"name": VIEW_NAME, "createdAt": now, "updatedAt": now, "state": state})


@store_access
def ensure_experiment(client: MlflowClient, name: str, uri: str) -> str:
    """The experiment's id, created (store and all) if it does not exist, and marked to open on its runs.

    Call it in the launching process before jobs start: several processes creating a new SQLite store at once
    collide ("table ... already exists")."""
    experiment = client.get_experiment_by_name(name)
    experiment_id = (
        experiment.experiment_id if experiment else client.create_experiment(name, artifact_location=artifact_location(uri))
    )
    tags = experiment.tags if experiment else {}
    if tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:
        client.set_experiment_tag(experiment_id, *EXPERIMENT_KIND)
    view_tag = f"mlflow.sharedViewState.{VIEW_KEY}"
    view = _view_tag(tags.get(view_tag))
    if tags.get(view_tag) != view:
        client.set_experiment_tag(experiment_id, view_tag, view)
    return experiment_id


def view_url(server: str, experiment_id: str) -> str:
    """The runs table of the experiment in the model-training navigation, best goodput first, on an MLflow server
    at ``server``."""
    query = urllib.parse.urlencode({WORKFLOW[0]: WORKFLOW[1], "orderByKey": f"metrics.`{KEY_FIGURES[0]}`",
                                    "orderByAsc": "false"})  # fmt: skip
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"


def figures_url(server: str, experiment_id: str) -> str:
    """The runs table with the key figures as columns: the saved view, under MLflow's "shared view" banner."""
    query = urllib.parse.urlencode({WORKFLOW[0]: WORKFLOW[1], "viewStateShareKey": VIEW_KEY})
    return f"{server.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"


def compare_url(server: str, experiment_id: str, run_ids: list[str]) -> str:
    """MLflow's side-by-side comparison of the given runs (every param and metric, one column per run), in the
    model-training navigation."""
    runs = json.dumps(run_ids, separators=(",", ":"))
    workflow = "=".join(WORKFLOW)
    return f"{server.rstrip('/')}/#/compare-runs?runs={runs}&experiments=[\"{experiment_id}\"]&{workflow}"


# Metrics are written at most this often. A write is a store transaction; one per step would cost a fast job a
# large share of the coordinator's time.
_METRIC_FLUSH_S = 1.0
_METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch call


def open_store(uri: str, experiment: str) -> tuple[MlflowClient, str]:
    """A client of the store at ``tracking.uri`` and the experiment's id (``ensure_experiment``), the store's runs
    of dead coordinators marked FAILED (``stale_runs.reconcile``). A store MLflow cannot open (an unknown scheme, a
    server that does not answer) is a ``ConfigError`` saying what to give instead: nothing can be recorded without
    it, so nothing may start."""
    advice = "give sqlite:///PATH.db (a store in a local file, the default) or the http(s):// address of a running " \
        "MLflow server"  # fmt: skip
    unanswered = _server_silent(uri)
    if unanswered:
        raise ConfigError(f"tracking.uri={uri}: no server answers there ({unanswered}); start it, or {advice}")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=uri)
        experiment_id = ensure_experiment(client, experiment, uri)
        reconcile(client)
        return client, experiment_id
    except MlflowException as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"tracking.uri={uri}: MLflow cannot open this store ({why}); {advice}") from None


def _server_silent(uri: str, timeout_s: float = 5.0) -> str | None:
    """Why a tracking server's address does not answer, or None (it does, or the store is not a server). MLflow's
    own client retries a silent server with back-off for minutes before it gives up."""
    if urllib.parse.urlsplit(uri).scheme not in ("http", "https"):
        return None
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # it answered (a proxy's or an authenticating server's refusal is MLflow's to report)
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))
    return None


class Tracker:
    def __init__(self, cfg: TrackingConfig) -> None:
        self.client, self.experiment_id = open_store(cfg.uri, cfg.experiment)
        self.cfg = cfg
        self.run_id: str | None = None
        self.local = Path(tempfile.mkdtemp(prefix="ftlab-run-"))
        self.events_path = self.local / "events.jsonl"
        self._metrics: list[Metric] = []
        self._flushed_at = time.monotonic()
        self._beat_at = time.monotonic()

    @store_access
    def start(
        self, config: dict[str, Any], tags: dict[str, str], config_yaml: str, name: str | None = None, note: str = "",
        resumes: str | None = None,
    ) -> str:  # fmt: skip
        """Open the run: ``tracking.run_name`` or ``name``, a child of ``tracking.parent_run_id`` when the job is one
        of a sweep, with ``note`` as its description. A job resumed from a checkpoint of run ``resumes`` continues
        that run where it can, else is linked to it (``stale_runs.continuation``)."""
        tags = {**tags, **coordinator_tags()}
        if self.cfg.parent_run_id:
            tags[PARENT_TAG] = self.cfg.parent_run_id
        if self.cfg.sweep_id:
            tags["sweep_id"] = self.cfg.sweep_id
        if note:
            tags[NOTE_TAG] = note
        params = {k: str(v)[:6000] for k, v in flatten(config).items()}
        in_sweep = bool(self.cfg.parent_run_id)
        how = continuation(self.client, resumes, self.experiment_id, in_sweep, params) if resumes else None
        if how == "continue":
            assert resumes is not None
            reopen(self.client, resumes, tags)
            self.run_id = resumes
            return resumes
        if how == "link":
            tags[RESUMES_TAG] = str(resumes)
            tags.setdefault(PARENT_TAG, str(resumes))
        run = self.client.create_run(self.experiment_id, run_name=self.cfg.run_name or name, tags=tags)
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        items = list(params.items())
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in items[i : i + 100]])
        self.log_text("config.yaml", config_yaml)
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffered, and written from the caller's thread when the last write is a second old.

        The coordinator reports a step while the workers compute the next one, so a write lands where it delays no
        iteration. MLflow's asynchronous logging would write from its own thread at any moment, for instance just
        when the workers report and the coordinator should answer them.
        """
        from mlflow.entities import Metric

        assert self.run_id is not None
        now = int(time.time() * 1000)
        self._metrics += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if time.monotonic() - self._flushed_at >= _METRIC_FLUSH_S:
            self.flush()

    @store_access
    def flush(self) -> None:
        """Write the buffered metrics, and with them the heartbeat when it is due (``stale_runs``)."""
        from mlflow.entities import RunTag

        assert self.run_id is not None
        heartbeat = []
        if time.monotonic() - self._beat_at >= HEARTBEAT_S:
            heartbeat, self._beat_at = [RunTag(HEARTBEAT_TAG, beat())], time.monotonic()
        batches = [self._metrics[i : i + _METRICS_PER_BATCH] for i in range(0, len(self._metrics), _METRICS_PER_BATCH)]
        for batch in batches or [[]]:
            if batch or heartbeat:
                self.client.log_batch(self.run_id, metrics=batch, tags=heartbeat)
                heartbeat = []
        self._metrics.clear()
        self._flushed_at = time.monotonic()

    @store_access
    def describe(self, note: str) -> None:
        """Replace the run's description (markdown, shown on the run's page and in the runs table)."""
        assert self.run_id is not None
        self.client.set_tag(self.run_id, NOTE_TAG, note)

    @store_access
    def set_tag(self, key: str, value: str) -> None:
        assert self.run_id is not None
        self.client.set_tag(self.run_id, key, value)

    @store_access
    def log_text(self, path: str, text: str) -> None:
        assert self.run_id is not None
        self.client.log_text(self.run_id, text, path)

    @store_access
    def log_file(self, local: Path, folder: str | None = None) -> None:
        assert self.run_id is not None
        self.client.log_artifact(self.run_id, str(local), folder)

    def write_artifact(self, path: str, text: str) -> None:
        """Write an artifact locally now and upload it when the run closes (with ``events.jsonl``): a simulated
        day writes hundreds of plans, and an upload each is a store transaction and a file copy."""
        local = self.local / "artifacts" / path
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(text)

    def write_event(self, record: dict[str, Any]) -> None:
        with open(self.events_path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    @store_access
    def finish(self, failure: str | None = None) -> None:
        """Upload what was written locally, close the run, and remove the local scratch folder: a machine that runs
        thousands of jobs (a sweep, the soak campaign, a test suite) would otherwise keep a folder from each."""
        if self.run_id is None:
            shutil.rmtree(self.local, ignore_errors=True)
            return
        from mlflow.entities import RunStatus

        self.flush()
        if self.events_path.exists():
            self.log_file(self.events_path)
        if (self.local / "artifacts").exists():
            self.client.log_artifacts(self.run_id, str(self.local / "artifacts"))
        if failure is not None:
            self.client.set_tag(self.run_id, "failure_reason", failure[:5000])
            self.log_text("failure.txt", failure)
        status = RunStatus.FAILED if failure is not None else RunStatus.FINISHED
        self.client.set_terminated(self.run_id, RunStatus.to_string(status))
        self.run_id = None
        shutil.rmtree(self.local, ignore_errors=True)  # uploaded: the store holds it now


class RunRecorder:
    """The event stream as an MLflow run: metrics of every step and every fault, each plan, ``events.jsonl``.

    A step's metrics include its update's (``train/grad_norm``, and in fp16 ``train/loss_scale`` and the running
    count ``train/skipped_steps``) where the workers report their gradients' norms (``update.StepNumerics``).

    A step without a loss (a simulated one) logs no ``train/loss``. With ``repeats=False`` a run of steps whose
    metrics are all equal is logged as its first and last step, which draws the same chart: the simulator's steps
    of one plan are identical, and a day of them would otherwise be tens of thousands of equal points.
    """

    def __init__(self, tracker: Tracker, seq_len: int, clock_origin: float, repeats: bool = True) -> None:
        self.tracker = tracker
        self.seq_len = seq_len
        self.origin = clock_origin
        """The backend-clock time written as t = 0 in events.jsonl."""
        self.repeats = repeats
        self._last: dict[str, float] | None = None
        self._held: tuple[dict[str, float], int] | None = None
        """The newest step, not logged because it equals the last logged one."""
        self._predicted: dict[str, float] = {}
        """The newest decision's predictions, logged beside the measured recovery they predict."""

    def _log_step(self, metrics: dict[str, float], step: int) -> None:
        if not self.repeats and self._last is not None and _same(metrics, self._last):
            self._held = (metrics, step)
            return
        self.close()
        self.tracker.log_metrics(metrics, step)
        self._last = metrics

    def close(self) -> None:
        """Log the step a run of equal ones ended with."""
        if self._held is not None:
            self.tracker.log_metrics(*self._held)
            self._held = None

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
                if math.isnan(event.loss):
                    del metrics["train/loss"]
                if event.numerics is not None:
                    metrics |= _numerics(event.numerics)
                self._log_step(metrics, event.step)
            case ev.SnapshotTaken():
                # At the index of the last step the snapshot holds, as train/loss of that step.
                self.tracker.log_metrics({"ft/snapshot_copy_s": event.copy_s, "ft/snapshot_cpu_s": event.cpu_s,
                                          "ft/snapshot_bytes": event.nbytes}, event.step - 1)  # fmt: skip
            case ev.StateRestored():
                self.tracker.log_metrics({"ft/restore_s": event.seconds, "ft/restore_bytes": event.nbytes},
                                         event.generation)  # fmt: skip
                self.tracker.set_tag("restore_source", event.source)
            case ev.Decided():
                # The measured ft/recover_s runs from the signal to the first step committed after the recovery.
                self._predicted = {}
                if event.predicted_iter_s is not None:
                    self._predicted["ft/predicted_iter_s"] = event.predicted_iter_s
                    if event.predicted_pause_s is not None:
                        self._predicted["ft/predicted_recover_s"] = event.predicted_pause_s + event.predicted_iter_s
            case ev.Reviewed(outcome=outcome) if outcome != "keep":
                # A switch without a failure: its predictions at the step it was decided (every review, kept or
                # not, is in events.jsonl with what it weighed).
                predicted = {"review/predicted_pause_s": event.predicted_pause_s,
                             "review/predicted_iter_s": event.predicted_iter_s}  # fmt: skip
                self.tracker.log_metrics({k: v for k, v in predicted.items() if v is not None} | {"review/switch": 1.0},
                                         event.step)  # fmt: skip
            case ev.WarningHeeded():  # the notice, the policy's reason and its actions: events.jsonl
                self.tracker.log_metrics({"ft/warning_left_s": event.left_s,
                                          "ft/warning_saves": float(len(event.actions))}, event.step)  # fmt: skip
            case ev.StateSaved():
                # Every step the checkpoint holds is in the store now: a coordinator killed later loses the metrics
                # of steps its resumed job redoes, and no others.
                self.tracker.flush()
            case ev.SaveFailed():
                self.tracker.log_metrics({"ft/save_failed": 1.0}, event.step)  # its reason: events.jsonl
            case ev.PlanConfigured():
                self.tracker.write_artifact(f"plans/generation-{event.generation:03d}.json", event.plan.to_json())
            case ev.Recovered():
                self.close()
                metrics = {
                    "ft/detect_s": event.detect_s,
                    "ft/recover_s": event.recover_s,
                    "ft/lost_steps": event.lost_steps,
                    "ft/transfer_bytes": event.transfer_bytes,
                    **self._predicted,
                }
                self.tracker.log_metrics({k: v for k, v in metrics.items() if v is not None}, event.fault)
        if event.logged:
            self.tracker.write_event(
                {"t": round(event.at - self.origin, 6), "wall": time.time(), "kind": event.kind, **event.fields()}
            )


def _numerics(n: StepNumerics) -> dict[str, float]:
    """A committed update's metrics: those it has (no norm for a skipped step, no loss scale but in fp16)."""
    metrics = {"train/grad_norm": n.grad_norm, "train/loss_scale": n.loss_scale, "train/skipped_steps": n.skipped_steps}
    return {k: float(v) for k, v in metrics.items() if v is not None}


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal metrics, to the rounding of times taken on a clock far from zero (a simulated day)."""
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=1e-9) for k in a)
