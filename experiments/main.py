"""``ftlab``: the Hydra app that runs one job (or, with ``-m``, a sweep of jobs) from the composed config."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from faults.schedules import FaultConfigError
from runtime.config import register
from runtime.launch import ConfigError, JobResult, run_job
from runtime.trainer import JobStopped

register()

# Errors whose message already says what to change: shown without a traceback.
_USER_ERRORS = (ConfigError, FaultConfigError, JobStopped, FileNotFoundError)


def report(result: JobResult, tracking_uri: str) -> None:
    s = result.summary
    print(
        f"\nftlab: {int(s['summary/steps'])} steps, final loss {s['summary/final_loss']:.4f}, "
        f"{s['summary/samples_per_s']:.1f} samples/s overall\n"
        f"MLflow run {result.run_id}: mlflow ui --backend-store-uri {tracking_uri}"
    )


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        result = run_job(cfg)
    except _USER_ERRORS as exc:
        print(f"ftlab: {exc}", file=sys.stderr)
        sys.exit(1)
    report(result, cfg.tracking.uri)


if __name__ == "__main__":
    main()
