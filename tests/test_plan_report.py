"""``ftlab mode=plan``: the report of templates, pipelines, batch split and predicted time, logged to MLflow, for
small jobs measured here and paper-scale jobs from an analytic GPU profile; impossible settings say what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from ftlab.experiments.plan_report import plan_job, plan_report
from ftlab.experiments.config import JobConfig
from ftlab.experiments.job import components, compose_config, everyone, job_factory
from ftlab.runtime.processes import cluster as cluster_module
from ftlab.runtime.core.config import TrackingConfig
from ftlab.runtime.core.contract import ConfigError
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.reporting.tracking import Tracker

PAPER_SCALE = [
    "experiment=plain", "model=gpt3-6.7b", "policy=oobleck", "cluster.nodes=16", "cluster.workers_per_node=8",
    "cluster.device=A100-80GB", "cluster.device_memory_gb=80",
]  # fmt: skip


@pytest.fixture(autouse=True)
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning never starts a node."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("mode=plan started a node")

    monkeypatch.setattr(cluster_module.LocalCluster, "start_node", refuse)


def job_config(job_overrides: list[str], *overrides: str) -> JobConfig:
    return OmegaConf.to_object(compose_config(["mode=plan", *job_overrides, *overrides]))


def only_run(tmp_path: Path):  # noqa: ANN201 - an mlflow Run
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
    assert len(runs) == 1
    return client, runs[0]


def artifact(client: MlflowClient, run_id: str, path: str, tmp_path: Path) -> str:
    return Path(client.download_artifacts(run_id, path, str(tmp_path / "downloads"))).read_text()


def test_oobleck_plan_of_a_small_job_is_printed_and_logged(job_overrides: list[str], tmp_path: Path) -> None:
    overrides = ["experiment=plain", "model=gpt2-tiny", "cluster=local-6", "policy=oobleck", "mode=plan"]
    report = plan_job(compose_config([*job_overrides, *overrides]))
    d = report.data
    f = d["policy"]["fault_threshold"]
    assert f == 1 and d["profile"]["kind"] == "measured" and not d["tensor_parallel"]
    assert len(d["pipelines"]) >= f + 1
    assert sum(p["microbatches"] for p in d["pipelines"]) == 16 // 2
    assert sorted(n for p in d["pipelines"] for n in p["nodes"]) == list(range(6))  # every node, once
    assert d["iteration_s"] == max(p["iteration_s"] for p in d["pipelines"]) > 0
    assert d["samples_per_s"] == pytest.approx(16 / d["iteration_s"])
    for section in ("Pipeline templates", "Chosen pipelines", "Predicted iteration", "samples/s"):
        assert section in report.text
    assert report.plan is not None and len(report.plan.pipelines) == len(d["pipelines"])

    client, run = only_run(tmp_path)
    assert run.info.status == "FINISHED" and run.info.run_id == report.run_id
    assert run.data.tags["mode"] == "plan" and run.data.tags["policy"] == "oobleck"
    assert artifact(client, report.run_id, "plan.txt", tmp_path) == report.text
    assert json.loads(artifact(client, report.run_id, "plan.json", tmp_path)) == json.loads(json.dumps(d))
    assert "Template of" in artifact(client, report.run_id, "templates.txt", tmp_path)
    assert Plan.from_json(artifact(client, report.run_id, "plans/generation-000.json", tmp_path)) == report.plan
    assert run.data.metrics["plan/pipelines"] == len(d["pipelines"])
    assert run.data.metrics["plan/iteration_s"] == pytest.approx(d["iteration_s"])
    assert run.data.metrics["plan/samples_per_s"] == pytest.approx(d["samples_per_s"])


def test_the_reported_plan_is_the_one_training_starts_from(job_overrides: list[str]) -> None:
    cfg = job_config(job_overrides, "experiment=plain", "cluster=local-6", "policy=oobleck")
    report = plan_report(cfg)
    policy, protection = components(cfg)
    job = job_factory(cfg, start=None)(everyone(cfg))
    assert policy.plan(job, protection).plan == report.plan


def test_paper_scale_plans_from_the_analytic_profile(job_overrides: list[str], tmp_path: Path) -> None:
    cfg = job_config(job_overrides, *PAPER_SCALE)
    tracker = Tracker(TrackingConfig(uri=f"sqlite:///{tmp_path}/mlflow.db"))
    run_id = tracker.start({}, {"mode": "plan"}, "")
    report = plan_report(cfg, tracker)
    tracker.finish()
    d = report.data
    assert d["profile"]["kind"] == "analytic" and d["tensor_parallel"]
    assert d["model"]["layers"] == 34 and d["cluster"]["nodes"] * d["cluster"]["workers_per_node"] == 128
    assert len(d["pipelines"]) >= 2
    assert sum(p["microbatches"] for p in d["pipelines"]) == cfg.train.global_batch // cfg.train.micro_batch
    assert sum(p["template_nodes"] for p in d["pipelines"]) == 16
    assert any(len(s["gpus"]) > 1 for t in d["templates"] for s in t["stages"])  # tensor parallel in a node
    assert all(s["memory_gib"] <= 80 for t in d["templates"] for s in t["stages"])
    assert report.plan is None  # tensor-parallel stages have no runtime plan
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert artifact(client, run_id, "plan.txt", tmp_path) == report.text
    assert "A100-80GB" in report.text


def test_gpu_cluster_preset_plans(job_overrides: list[str]) -> None:
    cfg = job_config(job_overrides, "experiment=plain", "cluster=a100-16x8", "model=gpt3-6.7b", "policy=oobleck")
    assert plan_report(cfg).data["profile"]["kind"] == "analytic"


def test_grid_policies_report_their_plan_and_a_simulated_time(job_overrides: list[str]) -> None:
    cfg = job_config(
        job_overrides, "experiment=plain", "cluster=local-8", "policy=checkpoint_restart", "protection=storage",
        "train.stages=4",
    )
    report = plan_report(cfg)
    d = report.data
    assert d["kind"] == "plan" and [len(p["stages"]) for p in d["pipelines"]] == [4, 4]
    assert sum(p["microbatches"] for p in d["pipelines"]) == 8
    assert d["iteration_s"] > 0 and "Plan: 4 stages x 2 pipelines" in report.text


IMPOSSIBLE = [
    # f + 1 replicas of 102 GiB of weights and optimizer state do not fit two 80 GiB GPUs
    ([*PAPER_SCALE, "cluster.nodes=2", "cluster.workers_per_node=1"], ["cluster.nodes", "policy.fault_threshold"]),
    (["experiment=plain", "cluster=local-6", "policy=oobleck", "policy.fault_threshold=6"], ["policy.fault_threshold"]),
    (["experiment=plain", "policy=oobleck", "policy.fault_threshold=3", "train.global_batch=6"],
     ["train.global_batch"]),
    (["experiment=plain", "model=gpt2-small"], ["cluster.device=A100-80GB"]),  # too big to measure here
    (["experiment=plain", "cluster.device=TPU-v9"], ["A100-80GB"]),
    (["experiment=plain", "train.global_batch=15"], ["multiple of train.micro_batch"]),
]


@pytest.mark.parametrize(("overrides", "advice"), IMPOSSIBLE, ids=[" ".join(o[-2:]) for o, _ in IMPOSSIBLE])
def test_impossible_settings_say_what_to_change(
    job_overrides: list[str], tmp_path: Path, overrides: list[str], advice: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        plan_job(compose_config(["mode=plan", *job_overrides, *overrides]))
    for words in advice:
        assert words in str(info.value)
    _, run = only_run(tmp_path)
    assert run.info.status == "FAILED" and advice[0] in run.data.tags["failure_reason"]
