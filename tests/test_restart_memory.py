"""A restart on fewer workers than ``train.stages`` puts more layers on each stage than the first plan did. Where those
stages do not fit the devices, a policy that restarts stops the job and names the stage, rather than start a layout
that a real device could not hold; with room for them it restarts as ``Roles.restarts`` promises (held by
``test_restart_promise``). Held for every policy found that declares it, on the simulator."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ftlab.experiments.job import compose_config
from ftlab.experiments.simulate import simulate_job
from ftlab.policies import catalog
from ftlab.runtime.control.coordinator import JobStopped
from tests.support import explicit, node

STEPS = 8
KILLED_AT = 3
DEVICE_GB = 0.04
"""Fits three stages of gpt2-tiny (the first plan runs) but not one stage holding the whole model."""


def three_of_four_nodes_lost(job_overrides: list[str], policy: str, stages: int, *extra: str) -> list[str]:
    """A simulated job whose first plan fits its small devices, until three of its four nodes die."""
    return [
        *job_overrides, "mode=simulate", f"policy={policy}", "cluster=local-4", f"train.stages={stages}",
        f"train.steps={STEPS}", "protection=storage", "protection.every=2", "model=gpt2-tiny",
        f"cluster.device_memory_gb={DEVICE_GB}", *extra, *explicit(*(node(n, KILLED_AT, "backward") for n in range(3))),
    ]  # fmt: skip


@pytest.mark.parametrize("policy", catalog.policies_with(lambda roles: roles.recovers and roles.restarts))
def test_a_restart_whose_stages_do_not_fit_stops_the_job_and_names_the_stage(
    job_overrides: list[str], tmp_path: Path, policy: str
) -> None:
    stages = max(3, catalog.roles()[policy].state_copies)
    cfg = compose_config(three_of_four_nodes_lost(job_overrides, policy, stages))
    with pytest.raises(JobStopped, match=r"gpt2-tiny.* 0\.04 GiB.*raise cluster\.device_memory_gb") as stopped:
        simulate_job(cfg)
    # No survivor holds every layer, so the job says where its newest checkpoint is.
    newest = r"the newest checkpoint is step 2's: resume with train\.resume_from=\S+/step-000002\.$"
    assert re.search(newest, str(stopped.value)), str(stopped.value)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
    assert run.info.status == "FAILED"
    trained = [m.step for m in client.get_metric_history(run.info.run_id, "cluster/pipelines")]
    assert max(trained) == KILLED_AT - 1  # the first plan fitted and trained up to the kill, and nothing after it


def test_the_resume_path_of_a_stopped_job_is_absolute_when_the_checkpoint_dir_is_relative(
    job_overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user resumes from wherever they are, and ssh or SLURM nodes do not start in ftlab's directory."""
    monkeypatch.chdir(tmp_path)
    cfg = compose_config(
        three_of_four_nodes_lost(job_overrides, "checkpoint_restart", 3, "train.checkpoint_dir=relative/checkpoints")
    )
    with pytest.raises(JobStopped) as stopped:
        simulate_job(cfg)
    resume_from = re.search(r"train\.resume_from=(\S+)\.$", str(stopped.value))
    assert resume_from, str(stopped.value)
    assert Path(resume_from[1]).is_absolute(), resume_from[1]
    assert Path(resume_from[1]).parent.parent == tmp_path / "relative" / "checkpoints"  # <dir>/<run id>/step-N
