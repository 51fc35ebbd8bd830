"""A stated calibration: the simulation runs at the device efficiency at which its fault-free plan reaches the stated
throughput, records it on the run, and refuses a throughput it cannot reach or a job it cannot calibrate."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from ftlab.experiments.calibration import TOLERANCE, fault_free_rate, search
from ftlab.experiments.job import check_settings, compose_config
from ftlab.experiments.simulate import simulate, simulate_job
from ftlab.runtime.core.contract import ConfigError

JOB = ["mode=simulate", "model=gpt3-medium", "cluster=a40-30x1", "train.precision=tf32", "train.global_batch=64",
       "train.micro_batch=2", "train.stages=4", "train.steps=4"]  # fmt: skip


def test_the_run_reaches_the_stated_throughput_and_records_the_efficiency(job_overrides: list[str]) -> None:
    cfg = OmegaConf.to_object(compose_config([*job_overrides, *JOB]))
    target = 0.6 * fault_free_rate(cfg, cfg.cluster.device_efficiency)
    result = simulate_job(compose_config([*job_overrides, *JOB, f"sim.calibrate_samples_per_s={target}"]))
    assert result.summary["summary/fault_free_samples_per_s"] == pytest.approx(target, rel=0.005)
    run = MlflowClient(cfg.tracking.uri).get_run(result.run_id)
    efficiency = float(run.data.params["cluster.device_efficiency"])
    assert 0 < efficiency < 0.45 and float(run.data.params["sim.calibrate_samples_per_s"]) == pytest.approx(target)
    assert run.data.tags["calibration"].startswith(f"cluster.device_efficiency={efficiency:.6g} ")
    assert fault_free_rate(cfg, efficiency) == pytest.approx(target, rel=TOLERANCE)


def test_a_throughput_beyond_the_full_peak_is_refused_with_both_numbers(job_overrides: list[str]) -> None:
    cfg = OmegaConf.to_object(compose_config([*job_overrides, *JOB, "sim.calibrate_samples_per_s=1e9"]))
    with pytest.raises(ConfigError, match=r"calibrate_samples_per_s=1e\+09: the job's fault-free plan reaches [0-9.]+ "
                                          r"samples/s even at cluster.device_efficiency=1"):  # fmt: skip
        simulate(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [(["mode=train"], "use it with mode=simulate"), (["mode=plan"], "use it with mode=simulate"),
     (["cluster=local-4", "model=gpt2-tiny"], "cluster.device=cpu is measured")],
)  # fmt: skip
def test_only_a_simulation_on_a_gpu_type_is_calibrated(
    job_overrides: list[str], overrides: list[str], message: str
) -> None:
    cfg = OmegaConf.to_object(compose_config([*job_overrides, *JOB, "sim.calibrate_samples_per_s=100", *overrides]))
    with pytest.raises(ConfigError, match=message):
        check_settings(cfg) if cfg.mode != "simulate" else simulate(cfg)


def test_the_search_settles_on_the_lowest_efficiency_past_a_jump() -> None:
    def jumping(efficiency: float) -> float:  # a plan that changes at 0.3, the rate jumping from 30 to 60
        return 100 * efficiency if efficiency < 0.3 else 200 * efficiency

    efficiency, reached = search(jumping, 45.0, 0.45)
    assert efficiency == pytest.approx(0.3) and reached >= 45.0


def test_the_search_finds_an_affine_step_time_in_a_few_plans() -> None:
    tried = []

    def rate(efficiency: float) -> float:  # 64 samples over 2 s of compute at full peak plus 0.5 s of the rest
        tried.append(efficiency)
        return 64 / (2 / efficiency + 0.5)

    efficiency, reached = search(rate, 10.0, 0.45)
    assert reached == pytest.approx(10.0, rel=TOLERANCE) and len(tried) <= 4
