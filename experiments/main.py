"""``ftlab``: the Hydra app that runs one job (or, with ``-m``, a sweep of jobs) from the composed config."""

from __future__ import annotations

import sys

from runtime.cluster import name_deepspeed_accelerator

name_deepspeed_accelerator()  # before anything below imports DeepSpeed

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from experiments.plan_report import plan_job  # noqa: E402
from faults.schedules import FaultConfigError  # noqa: E402
from runtime.config import register  # noqa: E402
from runtime.launch import ConfigError, JobResult, run_job  # noqa: E402
from runtime.trainer import JobStopped  # noqa: E402

register()

# Errors whose message already says what to change: shown without a traceback.
_USER_ERRORS = (ConfigError, FaultConfigError, JobStopped, FileNotFoundError)


def report(result: JobResult, tracking_uri: str) -> None:
    s = result.summary
    lines = [
        f"\nftlab: {int(s['summary/steps'])} steps, final loss {s['summary/final_loss']:.4f}, "
        f"{s['summary/samples_per_s']:.1f} samples/s overall",
        f"failures {int(s['summary/failures'])}, recovery {s['summary/recovery_s_total']:.2f} s in all, "
        f"goodput {s['summary/goodput_ratio']:.2f} of the fault-free rate",
    ]
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
        if cfg.mode == "plan":
            planned = plan_job(cfg)
            print(planned.text, end="")
            print(f"MLflow run {planned.run_id}: mlflow ui --backend-store-uri {cfg.tracking.uri}")
            return
        if cfg.mode != "train":
            raise ConfigError(f"mode={cfg.mode}: use mode=train (run the job) or mode=plan (show its plan)")
        result = run_job(cfg)
    except _USER_ERRORS as exc:
        print(f"ftlab: {exc}", file=sys.stderr)
        sys.exit(1)
    report(result, cfg.tracking.uri)


if __name__ == "__main__":
    main()
