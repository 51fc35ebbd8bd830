"""Sweeps (``ftlab -m ...``): one MLflow parent run per sweep, a progress bar, and a comparison when it ends.

A Hydra callback (``SweepCallback``, named in ``conf/hydra/ftlab.yaml``) runs in the launching process:

- before any job starts it creates the MLflow store and experiment (several jobs creating a SQLite store at once
  collide) and the sweep's parent run (its overrides as params, its sweep id as a tag, and this process with a
  heartbeat kept up while the sweep runs, so that the next ``ftlab`` on the store marks the parent KILLED if this
  process is killed outright: ``stale_runs``), and writes both ids to a
  sweep state folder that it names to the jobs in ``FTLAB_SWEEP`` (an environment variable: the basic launcher runs
  jobs in this process, joblib in processes it starts, submitit wherever SLURM puts them, and every one of them
  inherits the environment, while Hydra's sweep folder is worked out again in each job process);
- each job (``experiments/main.py``) makes its run a child of the parent and writes its outcome (finished, or failed
  with the reason) to ``jobs/<num>.json`` in that folder, so a failing job is recorded and the sweep goes on;
- a progress bar (rich) counts the outcomes as they appear: jobs done, failed, running;
- when the sweep ends, the parent run gets the comparison of its children (``comparison.md``, ``.csv`` and ``.png``:
  goodput, recovery time and lost steps per policy across the swept fault rates, the shape of Oobleck's Table 2),
  the sweep prints how many jobs failed, and ``ftlab`` exits non-zero if any did (``failed_jobs``).

Jobs of a sweep that differ only in their seed share a column: the table shows their mean.
"""

from __future__ import annotations

import atexit
import csv
import io
import json
import math
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ftlab.runtime.reporting.held_signals import store_access
from ftlab.runtime.reporting.stale_runs import SWEEP_TAGS, coordinator_tags, keep_beating

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

SWEEP_ENV = "FTLAB_SWEEP"
SWEEP_FILE = "sweep.json"

failed_jobs: int = 0
"""Jobs that failed in the last sweep this process ran: ``ftlab`` exits non-zero when there are any."""


@dataclass(frozen=True)
class SweepContext:
    """What a job needs to know about the sweep it belongs to."""

    sweep_id: str
    parent_run_id: str
    tracking_uri: str
    experiment: str
    folder: str


@dataclass(frozen=True)
class JobOutcome:
    num: int
    overrides: list[str]
    status: str
    """FINISHED or FAILED"""
    reason: str = ""
    run_id: str | None = None


def current_sweep() -> SweepContext | None:
    """The sweep this process's job belongs to, if it runs in one."""
    folder = os.environ.get(SWEEP_ENV)
    if not folder or not (Path(folder) / SWEEP_FILE).is_file():
        return None
    return SweepContext(**json.loads((Path(folder) / SWEEP_FILE).read_text()))


def job_started(sweep: SweepContext, num: int) -> None:
    jobs = Path(sweep.folder) / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    (jobs / f"{num}.running").touch()


def job_ended(sweep: SweepContext, outcome: JobOutcome) -> None:
    """Record the job's outcome where the launching process counts it (written whole, then renamed into place)."""
    jobs = Path(sweep.folder) / "jobs"
    temp = jobs / f".{outcome.num}.json.tmp"
    temp.write_text(json.dumps(asdict(outcome)))
    temp.replace(jobs / f"{outcome.num}.json")
    (jobs / f"{outcome.num}.running").unlink(missing_ok=True)


def outcomes(folder: Path) -> list[JobOutcome]:
    return sorted(
        (JobOutcome(**json.loads(p.read_text())) for p in (folder / "jobs").glob("*.json")), key=lambda o: o.num
    )


def count_jobs(overrides: list[str]) -> int | None:
    """How many jobs the basic sweep of these overrides runs (the product of the sweeps' lengths); None when it
    cannot be told without the config (a glob)."""
    total = 1
    try:
        for override in OverridesParser.create().parse_overrides(overrides):
            if override.is_sweep_override():
                total *= len(list(override.sweep_string_iterator()))
    except Exception:  # noqa: BLE001 - an override only the sweeper can expand: show no total
        return None
    return total


# -- the callback --------------------------------------------------------------------------------------------------
class SweepCallback(Callback):
    def __init__(self) -> None:
        self._progress: SweepProgress | None = None
        self._sweep: SweepContext | None = None
        self._stop_heartbeat: Callable[[], None] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Launchers pickle the callbacks into every job; the progress and heartbeat threads stay in this process.
        return {"_progress": None, "_sweep": None, "_stop_heartbeat": None}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from ftlab.runtime.reporting.tracking import open_store

        global failed_jobs
        failed_jobs = 0
        overrides = [str(o) for o in config.hydra.overrides.task]
        uri, experiment = str(config.tracking.uri), str(config.tracking.experiment)
        client, experiment_id = open_store(uri, experiment)
        sweep_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        total = count_jobs(overrides)
        parent_run_id = open_parent_run(client, experiment_id, sweep_id, overrides, total)
        self._stop_heartbeat = keep_beating(client, parent_run_id)
        folder = Path(str(config.hydra.sweep.dir)) / "ftlab-sweep"
        folder.mkdir(parents=True, exist_ok=True)
        self._sweep = SweepContext(sweep_id, parent_run_id, uri, experiment, str(folder))
        (folder / SWEEP_FILE).write_text(json.dumps(asdict(self._sweep)))
        for stale in (folder / "jobs").glob("*"):  # a sweep folder given twice (hydra.sweep.dir=...) starts afresh
            stale.unlink()
        (folder / "jobs").mkdir(exist_ok=True)
        os.environ[SWEEP_ENV] = str(folder)
        print(f"ftlab sweep {sweep_id}: {total or 'several'} jobs, MLflow parent run {parent_run_id}", flush=True)
        self._progress = SweepProgress(folder, total)
        self._progress.start()
        atexit.register(self._abandoned)

    @store_access
    def _abandoned(self) -> None:
        """The process exits with the sweep unfinished (an override Hydra refused, Ctrl-C, SIGTERM): close the parent
        run as KILLED rather than leave it running, and every child run still running as FAILED. A job in this
        process has marked its own run already; a job process of a launcher (joblib's workers) is killed outright
        when the sweep is stopped, and could not."""
        if self._sweep is None:
            return
        from mlflow.entities import RunStatus
        from mlflow.tracking import MlflowClient

        from ftlab.runtime.reporting.tracking import PARENT_TAG

        self._heartbeat_stopped()
        sweep = self._sweep
        client = MlflowClient(sweep.tracking_uri)
        experiment = client.get_experiment_by_name(sweep.experiment)
        running = client.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{sweep.parent_run_id}' and attributes.status = 'RUNNING'",
        ) if experiment is not None else []  # fmt: skip
        for run in running:
            client.set_tag(run.info.run_id, "failure_reason", f"sweep {sweep.sweep_id} was stopped before this job ended")
            client.set_terminated(run.info.run_id, RunStatus.to_string(RunStatus.FAILED))
        client.set_terminated(sweep.parent_run_id, RunStatus.to_string(RunStatus.KILLED))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global failed_jobs
        if self._sweep is None:
            return
        if self._progress is not None:
            self._progress.stop()
        self._heartbeat_stopped()
        os.environ.pop(SWEEP_ENV, None)
        sweep, folder = self._sweep, Path(self._sweep.folder)
        done = outcomes(folder)
        total = count_jobs([str(o) for o in config.hydra.overrides.task]) or len(done)
        failed = [o for o in done if o.status != "FINISHED"]
        failed_jobs = len(failed) + max(0, total - len(done))
        common = set.intersection(*(set(o.overrides) for o in done)) if len(done) > 1 else set()
        lines = [f"ftlab sweep {sweep.sweep_id}: {total} jobs, {failed_jobs} failed"]
        for o in failed:
            swept = " ".join(x for x in o.overrides if x not in common)
            lines.append(f"  job {o.num} ({swept}): {o.reason.splitlines()[0] if o.reason else 'failed'}")
        if total > len(done):
            lines.append(f"  {total - len(done)} jobs ended without reporting (killed?)")
        lines += record_comparison(sweep, total, failed_jobs)
        self._sweep = None  # closed: nothing left for _abandoned
        print("\n".join(lines), flush=True)

    def _heartbeat_stopped(self) -> None:
        if self._stop_heartbeat is not None:
            self._stop_heartbeat()
            self._stop_heartbeat = None


@store_access
def open_parent_run(client: MlflowClient, experiment_id: str, sweep_id: str, overrides: list[str], total: int) -> str:
    """The sweep's parent run, with its overrides as parameters; its id."""
    parent = client.create_run(
        experiment_id,
        run_name=f"sweep-{sweep_id}",
        tags={
            **SWEEP_TAGS,
            **coordinator_tags(),  # this process keeps the parent run (``stale_runs``)
            "sweep_id": sweep_id,
            "sweep_overrides": " ".join(overrides),
            "mlflow.note.content": f"Sweep of {total or 'several'} jobs: `ftlab -m {' '.join(overrides)}`. "
            "The comparison of its jobs is written here when the sweep ends.",
        },
    )
    for override in overrides:
        key, _, value = override.partition("=")
        client.log_param(parent.info.run_id, f"sweep.{key.lstrip('+~')}", value[:6000])
    return parent.info.run_id


@store_access
def record_comparison(sweep: SweepContext, total: int, failed: int) -> list[str]:
    """Write the comparison of the sweep's child runs to the parent run and close it; lines for the user."""
    from mlflow.entities import RunStatus
    from mlflow.tracking import MlflowClient

    from ftlab.runtime.reporting.tracking import (
        NOTE_TAG, PARENT_TAG, compare_url, ensure_experiment, figures_url, view_url,
    )

    client = MlflowClient(sweep.tracking_uri)
    experiment_id = ensure_experiment(client, sweep.experiment, sweep.tracking_uri)
    children = client.search_runs(
        [experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{sweep.parent_run_id}'", max_results=10_000
    )
    children = sorted(children, key=lambda r: r.info.start_time)
    table = Comparison.of([(r.data.tags, r.data.metrics, r.info.status) for r in children])
    markdown = table.markdown()
    local = Path(sweep.folder)
    (local / "comparison.md").write_text(markdown)
    (local / "comparison.csv").write_text(table.csv())
    figure = table.figure(local / "comparison.png", f"sweep {sweep.sweep_id}")
    run = sweep.parent_run_id
    for path in (local / "comparison.md", local / "comparison.csv", figure):
        client.log_artifact(run, str(path))
    client.log_metric(run, "sweep/jobs", total)
    client.log_metric(run, "sweep/failed_jobs", failed)
    client.set_tag(run, NOTE_TAG, f"{client.get_run(run).data.tags.get(NOTE_TAG, '')}\n\n{markdown}")
    if failed:
        client.set_tag(run, "failure_reason", f"{failed} of {total} jobs failed")
    status = RunStatus.FAILED if failed else RunStatus.FINISHED
    client.set_terminated(run, RunStatus.to_string(status))
    server = "http://127.0.0.1:5000"
    return [
        f"comparison: {figure} (and on the parent run {run})",
        f"MLflow: mlflow ui --backend-store-uri {sweep.tracking_uri}, then open {view_url(server, experiment_id)}",
        f"  with the key figures as columns (a saved view): {figures_url(server, experiment_id)}",
        f"  or compare the jobs side by side: {compare_url(server, experiment_id, [r.info.run_id for r in children])}",
    ]


# -- the comparison ------------------------------------------------------------------------------------------------
FIGURES = (
    ("goodput", "summary/goodput_ratio", "goodput (of the fault-free rate)"),
    ("recovery_s", "recovery_s_per_fault", "recovery per fault (s)"),
    ("lost_steps", "summary/lost_steps_total", "committed steps lost"),
)


@dataclass
class Comparison:
    """Rows: policy (+ protection); columns: fault rates; cells: the mean of each figure over the finished jobs of
    that pair (seeds), with how many of its jobs finished and failed. A pair whose every job failed (policy=none
    stops at the first fault) reads "failed"."""

    rows: list[str]
    columns: list[str]
    cells: dict[tuple[str, str], dict[str, float]]
    """(row, column) -> figure -> mean, plus ``finished`` and ``jobs``."""

    @staticmethod
    def of(runs: list[tuple[dict[str, str], dict[str, float], str]]) -> Comparison:
        rows: list[str] = []
        columns: list[str] = []
        values: dict[tuple[str, str], list[tuple[dict[str, float], str]]] = {}
        for tags, metrics, status in runs:
            row = tags.get("policy", "?") + ("" if tags.get("protection", "none") == "none" else f"+{tags['protection']}")
            column = tags.get("fault_rate", tags.get("faults", "?"))
            rows += [row] if row not in rows else []
            columns += [column] if column not in columns else []
            values.setdefault((row, column), []).append((metrics, status))
        cells = {}
        for key, jobs in values.items():
            finished = [m for m, status in jobs if status == "FINISHED" and "summary/goodput_ratio" in m]
            failed = sum(1 for _, status in jobs if status == "FAILED")
            cell: dict[str, float] = {"jobs": len(jobs), "finished": len(finished), "failed": failed}
            for name, metric, _ in FIGURES:
                if finished:
                    cell[name] = sum(_figure(m, metric) for m in finished) / len(finished)
            cells[key] = cell
        return Comparison(rows, columns, cells)

    def text(self, row: str, column: str, name: str) -> str:
        cell = self.cells.get((row, column))
        if cell is None:
            return ""
        if not cell["finished"]:
            return "failed" if name == "goodput" and cell["failed"] else "-"
        spec = {"goodput": ".2f", "recovery_s": ".2f", "lost_steps": ".1f"}[name]
        partial = f" ({int(cell['finished'])}/{int(cell['jobs'])})" if cell["finished"] < cell["jobs"] else ""
        return f"{cell[name]:{spec}}{partial}"

    def markdown(self) -> str:
        out = []
        for name, _, title in FIGURES:
            out.append(f"**{title}**\n")
            out.append("| policy | " + " | ".join(self.columns) + " |")
            out.append("| --- |" + " --- |" * len(self.columns))
            for row in self.rows:
                out.append(f"| {row} | " + " | ".join(self.text(row, c, name) for c in self.columns) + " |")
            out.append("")
        return "\n".join(out)

    def csv(self) -> str:
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(["policy", "fault_rate", "jobs", "finished", *(name for name, _, _ in FIGURES)])
        for (row, column), cell in self.cells.items():
            writer.writerow([row, column, int(cell["jobs"]), int(cell["finished"]),
                             *(cell.get(name, "") for name, _, _ in FIGURES)])  # fmt: skip
        return buffer.getvalue()

    def figure(self, path: Path, title: str) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        if not any(cell["finished"] for cell in self.cells.values()):
            fig = plt.figure(figsize=(6, 1.5))
            fig.text(0.5, 0.5, f"{title}: no training job finished with figures", ha="center", va="center")
            fig.savefig(path, dpi=90)
            plt.close(fig)
            return path
        fig, axes = plt.subplots(1, len(FIGURES), figsize=(4.2 * len(FIGURES), 3.8), layout="constrained")
        width = 0.8 / max(1, len(self.rows))
        for ax, (name, _, label) in zip(axes, FIGURES):
            for i, row in enumerate(self.rows):
                xs = [j + (i - (len(self.rows) - 1) / 2) * width for j in range(len(self.columns))]
                ys = [self.cells.get((row, c), {}).get(name, math.nan) for c in self.columns]
                ax.bar(xs, ys, width, label=row)
                for x, c in zip(xs, self.columns):
                    cell = self.cells.get((row, c))
                    if cell is not None and cell["failed"] and not cell["finished"]:
                        ax.text(x, 0, "failed", rotation=90, ha="center", va="bottom", fontsize=7)
            ax.set_xticks(range(len(self.columns)), self.columns, rotation=20, ha="right", fontsize=8)
            ax.set_title(label, fontsize=10)
            if name == "goodput":
                ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        axes[0].legend(fontsize=8)
        fig.suptitle(title, fontsize=10)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        return path


def _figure(metrics: dict[str, float], metric: str) -> float:
    if metric == "recovery_s_per_fault":
        failures = metrics.get("summary/failures", 0.0)
        return metrics.get("summary/recovery_s_total", 0.0) / failures if failures else 0.0
    return metrics.get(metric, math.nan)


# -- progress ------------------------------------------------------------------------------------------------------
class SweepProgress:
    """Jobs done, failed and running, read from the sweep folder twice a second (jobs may run in other processes).

    On a terminal a rich progress bar; elsewhere a plain line whenever the counts change."""

    def __init__(self, folder: Path, total: int | None) -> None:
        from rich.console import Console

        self.folder = folder
        self.total = total
        self.console = Console(file=sys.stderr)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sweep-progress")
        self._last: tuple[int, int, int] | None = None

    def counts(self) -> tuple[int, int, int]:
        jobs = self.folder / "jobs"
        ended = outcomes(self.folder)
        failed = sum(1 for o in ended if o.status != "FINISHED")
        running = len(list(jobs.glob("*.running")))
        return len(ended), failed, running

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        if not self.console.is_terminal:
            while not self._stop.wait(0.5):
                self._plain()
            self._plain()
            return
        with Progress(
            TextColumn("[bold]sweep"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(), console=self.console,
        ) as progress:  # fmt: skip
            task = progress.add_task("sweep", total=self.total, status="")
            while True:
                stopping = self._stop.is_set()  # one last count after the sweep ends
                done, failed, running = self.counts()
                progress.update(task, completed=done, status=f"{failed} failed, {running} running")
                if stopping:
                    break
                self._stop.wait(0.5)

    def _plain(self) -> None:
        counts = self.counts()
        if counts != self._last:
            self._last = counts
            done, failed, running = counts
            self.console.print(
                f"sweep: {done}/{self.total or '?'} jobs done, {failed} failed, {running} running", highlight=False
            )
