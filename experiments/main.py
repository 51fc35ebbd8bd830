"""``ftlab``: the Hydra app that runs one job (or, with ``-m``, a sweep of jobs) from the composed config.

Composition and the checks before any worker starts import no torch, transformers or DeepSpeed: a typo or an
impossible setting is answered in seconds. The training machinery loads only for a job that passed them.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import hydra
from omegaconf import DictConfig

from ftlab.experiments.config import register
from ftlab.faults.schedules import FaultConfigError
from ftlab.runtime.backend import WorkerCrashed
from ftlab.runtime.contract import ConfigError

if TYPE_CHECKING:
    from ftlab.experiments.job import JobResult

register()

MODES = ("train", "plan")


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message already says what to change (or what happened): shown without a traceback."""
    from ftlab.runtime.coordinator import JobStopped

    return ConfigError, FaultConfigError, JobStopped, WorkerCrashed, FileNotFoundError


def report(result: JobResult, tracking_uri: str) -> None:
    s = result.summary
    lines = [
        f"\nftlab: {int(s['summary/steps'])} steps, final loss {s['summary/final_loss']:.4f}, "
        f"{s['summary/samples_per_s']:.1f} samples/s after start-up",
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


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        if cfg.mode not in MODES:
            raise ConfigError(f"mode={cfg.mode}: use mode=train (run the job) or mode=plan (show its plan)")
        if cfg.mode == "plan":
            from ftlab.experiments.plan_report import plan_job

            planned = plan_job(cfg)
            print(planned.text, end="")
            print(f"MLflow run {planned.run_id}: mlflow ui --backend-store-uri {cfg.tracking.uri}")
            return
        from ftlab.experiments.job import run_job

        result = run_job(cfg)
    except user_errors() as exc:
        print(f"ftlab: {exc}", file=sys.stderr)
        sys.exit(1)
    report(result, cfg.tracking.uri)


if __name__ == "__main__":
    main()
