"""``ftlab``: the Hydra app that runs one job (or, with ``-m``, a sweep of jobs) from the composed config.

Composition and the checks before any worker starts import no torch, transformers, DeepSpeed or MLflow: a typo or
an impossible setting is answered in seconds, its message printed first and its FAILED run recorded after it (MLflow
and its store take seconds more). The training machinery loads only for a job that passed them.

A single job that fails prints its message (no traceback for a user error) and exits non-zero. In a sweep a failing
job never ends the sweep: its failure is recorded (its MLflow run is FAILED with the reason, and its outcome goes
to the sweep, ``experiments/sweep.py``), and the next job runs; the sweep prints how many jobs failed at the end and
``ftlab`` exits non-zero if any did. (Hydra's launchers would stop at a ``sys.exit``, and the basic sweeper re-raises
the first failed job's exception after its batch, so the task function returns instead of raising.)
"""

from __future__ import annotations

import math
import os
import sys
import traceback
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from ftlab.experiments import sweep
from ftlab.experiments.config import register
from ftlab.experiments.stop_signals import Stopped, exit_status, stop_on_signals
from ftlab.faults.schedules import FaultConfigError
from ftlab.runtime.control.backend import WorkerCrashed
from ftlab.runtime.core.contract import ConfigError

if TYPE_CHECKING:
    from ftlab.experiments.job import JobResult, Refused

register()

MODES = ("train", "plan", "simulate")


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message already says what to change (or what happened): shown without a traceback."""
    from ftlab.runtime.control.coordinator import JobStopped

    return ConfigError, FaultConfigError, JobStopped, WorkerCrashed, FileNotFoundError


def report(result: JobResult, tracking_uri: str) -> None:
    s = result.summary
    loss = s["summary/final_loss"]
    lines = [
        f"\nftlab: {int(s['summary/steps'])} steps, "
        + ("" if math.isnan(loss) else f"final loss {loss:.4f}, ")  # a simulation computes no loss
        + f"{s['summary/samples_per_s']:.1f} samples/s after start-up",
        f"failures {int(s['summary/failures'])}, recovery {s['summary/recovery_s_total']:.2f} s in all, "
        f"goodput {s['summary/goodput_ratio']:.2f} of the fault-free rate "
        f"({s['summary/fault_free_samples_per_s']:.1f} samples/s)",
    ]
    if s["summary/faults_unfired"]:
        lines.append(f"{int(s['summary/faults_unfired'])} scheduled faults did not fire (see the warnings above)")
    for i, fault in enumerate(result.faults):
        lines.append(
            f"  fault {i} ({fault.kind}): detected in {fault.detect_s or 0:.3f} s, recovered in "
            f"{fault.recover_s or 0:.2f} s, {fault.lost_steps} committed steps lost, "
            f"{fault.transfer_bytes / 2**20:.1f} MiB of layers copied"
        )
    lines.append(f"MLflow run {result.run_id}: mlflow ui --backend-store-uri {tracking_uri}")
    print("\n".join(lines))


def run(cfg: DictConfig) -> str:
    """Run (or plan) the job; its MLflow run id. A job its checks refuse raises ``Refused`` before MLflow loads."""
    from ftlab.experiments.job import Refused

    if cfg.mode not in MODES:
        raise Refused(ConfigError(
            f"mode={cfg.mode}: use mode=train (run the job), mode=plan (show its plan) or mode=simulate (run it on "
            f"a simulated cluster)"
        ))  # fmt: skip
    if cfg.mode == "plan":
        from ftlab.experiments.plan_report import plan_job

        planned = plan_job(cfg, defer_refusal=True)
        print(planned.text, end="")
        print(f"MLflow run {planned.run_id}: mlflow ui --backend-store-uri {cfg.tracking.uri}")
        return planned.run_id
    if cfg.mode == "simulate":
        from ftlab.experiments.simulate import simulate_job

        result = simulate_job(cfg, defer_refusal=True)
    else:
        from ftlab.experiments.job import run_job

        result = run_job(cfg, defer_refusal=True)
    report(result, cfg.tracking.uri)
    return result.run_id


def record_refusal(cfg: DictConfig, refused: Refused) -> None:
    """The refused job's FAILED run, recorded once its message is out; a store that cannot take it is said too."""
    from ftlab.experiments.job import failed_run

    try:
        failed_run(cfg, refused.error, refused.tags)
    except user_errors() as exc:
        print(f"ftlab: the refusal is not recorded: {exc}", file=sys.stderr)


def parallel_jobs() -> int:
    """Jobs this sweep runs at once on this machine: the joblib launcher's ``n_jobs`` (-1: one per CPU), else 1."""
    launcher = HydraConfig.get().launcher
    if "joblib" not in str(launcher.get("_target_", "")):
        return 1
    n_jobs = int(launcher.get("n_jobs") or 1)
    return len(os.sched_getaffinity(0)) if n_jobs < 0 else n_jobs


def join_sweep(cfg: DictConfig, context: sweep.SweepContext) -> None:
    """Make the job's run a child of the sweep's, when it writes to the sweep's experiment; its progress is the
    sweep's bar, not a bar of its own; its share of the CPUs accounts for the jobs beside it. (The joblib launcher
    also limits each job process's own math threads to its share.)"""
    with open_dict(cfg):
        cfg.progress = False
        cfg.cluster.parallel_jobs = parallel_jobs()
        if cfg.tracking.uri == context.tracking_uri and cfg.tracking.experiment == context.experiment:
            cfg.tracking.parent_run_id = context.parent_run_id
            cfg.tracking.sweep_id = context.sweep_id


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from ftlab.experiments.job import Refused

    context = sweep.current_sweep() if HydraConfig.get().mode == RunMode.MULTIRUN else None
    if context is None:
        try:
            run(cfg)
        except Refused as refused:
            print(f"ftlab: {refused}", file=sys.stderr, flush=True)
            record_refusal(cfg, refused)
            sys.exit(1)
        except user_errors() as exc:
            print(f"ftlab: {exc}", file=sys.stderr)
            sys.exit(1)
        return
    num = int(HydraConfig.get().job.num)
    overrides = list(HydraConfig.get().overrides.task)
    sweep.job_started(context, num)
    join_sweep(cfg, context)
    try:
        run_id = run(cfg)
    except Exception as exc:  # noqa: BLE001 - every failure is the job's, recorded, and the sweep goes on
        error = exc.error if isinstance(exc, Refused) else exc
        if not isinstance(error, user_errors()):
            traceback.print_exc()
        print(f"ftlab: job {num} failed: {error}", file=sys.stderr, flush=True)
        if isinstance(exc, Refused):
            record_refusal(cfg, exc)
        sweep.job_ended(context, sweep.JobOutcome(num, overrides, "FAILED", f"{type(error).__name__}: {error}"))
        return
    sweep.job_ended(context, sweep.JobOutcome(num, overrides, "FINISHED", run_id=run_id))


def cli() -> None:
    """The ``ftlab`` command: the Hydra app, then a non-zero exit if a sweep had failed jobs. Stopped from outside
    (Ctrl-C, SIGTERM, SIGHUP: ``stop_signals``), it says so in a line, having marked the job's run FAILED, and exits
    with the shell's status for the signal."""
    stop_on_signals()
    try:
        main()
    except user_errors() as exc:  # a sweep's own settings, refused before its first job (its store, for one)
        print(f"ftlab: {exc}", file=sys.stderr)
        sys.exit(1)
    except (KeyboardInterrupt, Stopped) as exc:
        print(f"ftlab: {str(exc) or 'stopped by SIGINT'}", file=sys.stderr)
        sys.exit(exit_status(exc))
    if sweep.failed_jobs:
        sys.exit(1)


if __name__ == "__main__":
    cli()
