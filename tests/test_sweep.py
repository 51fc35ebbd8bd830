"""Sweeps through the ``ftlab`` command, as a user runs them: a failing job never ends a sweep, jobs run in parallel
(joblib) into one MLflow store under one parent run, and the parent gets the comparison of its jobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ftlab.experiments.sweep import Comparison, count_jobs

FTLAB = str(Path(sys.executable).with_name("ftlab"))


def ftlab(tmp_path: Path, token_cache: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``ftlab ARGS`` in ``tmp_path`` (its MLflow store and Hydra's outputs land there), on the session's token cache."""
    common = ["experiment=plain", f"train.cache_dir={token_cache}", f"train.checkpoint_dir={tmp_path}/checkpoints"]
    return subprocess.run(
        [FTLAB, *args, *common], cwd=tmp_path, capture_output=True, text=True, timeout=timeout, check=False
    )


def sweep_runs(tmp_path: Path):  # noqa: ANN201 - (client, parent run, child runs)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("ftlab")
    runs = client.search_runs([experiment.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("kind") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 1 + len(children), "every run of the sweep is the parent's child"
    return client, parent, children


def test_a_failing_job_never_ends_a_sweep(tmp_path: Path, token_cache: Path) -> None:
    done = ftlab(tmp_path, token_cache, "-m", "mode=plan,bogus,plan")
    assert done.returncode == 1, done.stderr
    assert "3 jobs, 1 failed" in done.stdout
    assert "job 1 (mode=bogus): ConfigError: mode=bogus: use mode=train" in done.stdout
    assert "Traceback" not in done.stderr
    client, parent, children = sweep_runs(tmp_path)
    assert sorted(r.info.status for r in children) == ["FAILED", "FINISHED", "FINISHED"]
    (failed,) = [r for r in children if r.info.status == "FAILED"]
    assert "mode=bogus" in failed.data.tags["failure_reason"]
    assert parent.info.status == "FAILED" and parent.data.tags["failure_reason"] == "1 of 3 jobs failed"
    assert parent.data.params["sweep.mode"] == "plan,bogus,plan"
    assert {r.data.tags["sweep_id"] for r in children} == {parent.data.tags["sweep_id"]}
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"comparison.png", "comparison.md", "comparison.csv"} <= artifacts
    assert client.get_experiment_by_name("ftlab").tags["mlflow.experimentKind"] == "custom_model_development"


def test_a_single_failing_job_exits_non_zero_with_its_message(tmp_path: Path, token_cache: Path) -> None:
    done = ftlab(tmp_path, token_cache, "mode=bogus")
    assert done.returncode == 1
    assert "ftlab: mode=bogus: use mode=train" in done.stderr and "Traceback" not in done.stderr


def test_a_joblib_sweep_fills_one_store_with_one_parent_and_its_children(tmp_path: Path, token_cache: Path) -> None:
    """Three training jobs at once (each on 2 nodes) on a store that did not exist: the sweep creates it first."""
    done = ftlab(
        tmp_path, token_cache, "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=3", "cluster.nodes=2",
        "train.steps=3", "faults.seed=0,1,2",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "3 jobs, 0 failed" in done.stdout
    client, parent, children = sweep_runs(tmp_path)
    assert [r.info.status for r in children] == ["FINISHED"] * 3 and parent.info.status == "FINISHED"
    assert sorted(r.info.run_name for r in children) == [f"none-none-none-{seed}" for seed in range(3)]
    assert all("summary/goodput_ratio" in r.data.metrics for r in children)
    assert "Goodput" in children[0].data.tags["mlflow.note.content"]


def test_the_comparison_has_a_row_per_policy_and_a_column_per_fault_rate() -> None:
    def run(policy: str, rate: str, goodput: float | None, status: str = "FINISHED"):  # noqa: ANN202
        metrics = {} if goodput is None else {
            "summary/goodput_ratio": goodput, "summary/failures": 2.0, "summary/recovery_s_total": 3.0,
            "summary/lost_steps_total": 4.0,
        }  # fmt: skip
        return {"policy": policy, "protection": "storage", "fault_rate": rate}, metrics, status

    table = Comparison.of([
        run("oobleck", "exponential-10steps", 0.9), run("oobleck", "exponential-10steps", 0.7),
        run("oobleck", "exponential-20steps", 0.95), run("none", "exponential-10steps", None, "FAILED"),
    ])  # fmt: skip
    assert table.rows == ["oobleck+storage", "none+storage"]
    assert table.columns == ["exponential-10steps", "exponential-20steps"]
    assert table.text("oobleck+storage", "exponential-10steps", "goodput") == "0.80"
    assert table.text("oobleck+storage", "exponential-10steps", "recovery_s") == "1.50"
    assert table.text("none+storage", "exponential-10steps", "goodput") == "failed"
    assert "| oobleck+storage | 0.80 | 0.95 |" in table.markdown()


@pytest.mark.parametrize(
    ("overrides", "jobs"),
    [(["policy=none,oobleck", "faults.mtbf_steps=5,10,20"], 6), (["train.seed=range(4)"], 4), (["a=1"], 1)],
)
def test_the_number_of_jobs_is_known_before_they_run(overrides: list[str], jobs: int) -> None:
    assert count_jobs(overrides) == jobs


def test_submitits_local_executor_runs_a_job_of_a_sweep(tmp_path: Path, token_cache: Path) -> None:
    """The launcher the SLURM preset uses, with submitit's local executor: the job runs in a process submitit
    starts, and its run is still the sweep's child."""
    done = ftlab(
        tmp_path, token_cache, "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10",
        "cluster.nodes=2", "train.steps=2", "faults.seed=0",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, parent, children = sweep_runs(tmp_path)
    assert [r.info.status for r in children] == ["FINISHED"] and parent.info.status == "FINISHED"
    assert list(tmp_path.glob("multirun/*/*/.submitit/*/*_log.out")), "the job ran under submitit"


def test_the_slurm_preset_is_submitits_slurm_launcher() -> None:
    from hydra import compose, initialize_config_dir

    from ftlab.experiments.config import register
    from ftlab.experiments.job import CONF_DIR

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.nodes == 1 and launcher.cpus_per_task == 16
