"""One machine model: chosen once from the cluster, and the one the simulator charges with and a policy predicts with.

- The cluster's device and launcher choose the platform: a shared host only for the local launcher's processes on
  this machine's CPU; CUDA, a GPU type and the ssh and SLURM launchers get a device per worker.
- A simulated recovery pauses training exactly as long as adaptive predicted for the answer it carried out, for
  every candidate (reroute, reconfigure, restart from memory and from storage) on both platforms.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ftlab.experiments import job as job_module
from ftlab.experiments.config import JobConfig
from ftlab.experiments.job import compose_config, everyone, job_factory
from ftlab.experiments.simulate import simulate
from ftlab.runtime.control import events as ev
from ftlab.runtime.sim.machines import DeviceMachine, SharedHostMachine
from tests.support import a100_profile

STEPS = 10


@pytest.fixture(autouse=True)
def fixed_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """An analytic profile for every device, so no test waits for this machine to be measured."""
    monkeypatch.setattr(job_module, "job_profile", a100_profile)


def config(job_overrides: list[str], *overrides: str) -> JobConfig:
    return OmegaConf.to_object(compose_config([*job_overrides, *overrides]))


@pytest.mark.parametrize(
    ("cluster", "machine"),
    [
        (["cluster.device=cpu"], SharedHostMachine),
        (["cluster.device=cuda"], DeviceMachine),
        (["cluster.device=A40"], DeviceMachine),
        (["cluster.device=cpu", "cluster.launcher=ssh", "cluster.hosts=[a,b,c,d]"], DeviceMachine),
        (["cluster.device=cpu", "cluster.launcher=slurm"], DeviceMachine),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else value.__name__,
)
def test_the_cluster_chooses_the_machine(job_overrides: list[str], cluster: list[str], machine: type) -> None:
    cfg = config(job_overrides, *cluster)
    assert type(job_factory(cfg, None)(everyone(cfg)).machine()) is machine


PLATFORMS = {
    "shared-host": ["cluster.device=cpu", "sim.host_cores=2"],
    "devices": ["cluster.device=A100-40GB"],
}
CANDIDATES = {
    "reroute": ["protection=storage", "protection.every=3"],
    "reconfigure": ["protection=storage", "protection.every=3"],
    "restart-storage": ["protection=storage", "protection.every=3"],
    "restart-memory": ["protection=reft", "protection.interval=1", f"protection.flush_every={STEPS}"],
}


@pytest.mark.parametrize("platform", sorted(PLATFORMS))
@pytest.mark.parametrize("candidate", sorted(CANDIDATES))
def test_a_simulated_pause_is_what_adaptive_predicted(
    job_overrides: list[str], tmp_path: Path, platform: str, candidate: str
) -> None:
    """Node 2 of six dies in step 5's backward pass; adaptive, left one candidate, predicts the pause of its answer,
    and the simulator carries it out: from the kill to the new plan configured is the prediction. Snapshot copies
    far faster than an iteration, so none is in flight when the failure is noticed (an abort waits for them)."""
    cfg = config(
        job_overrides, "mode=simulate", "policy=adaptive", f"policy.candidates=[{candidate.split('-')[0]}]",
        "cluster.nodes=6", "cluster.device_memory_gb=0.04", f"train.steps={STEPS}", "sim.snapshot_bytes_per_s=1e13",
        "faults=explicit", "faults.events=[{kind: node, node: 2, at_step: 5, phase: backward}]",
        *PLATFORMS[platform], *CANDIDATES[candidate],
    )  # fmt: skip
    events = simulate(cfg).result.events
    (killed,) = [e for e in events if isinstance(e, ev.FaultInjected)]
    (decided,) = [e for e in events if isinstance(e, ev.Decided)]
    configured = [e for e in events if isinstance(e, ev.PlanConfigured) and e.generation == decided.generation]
    assert decided.predicted_pause_s is not None and len(configured) == 1
    if candidate.startswith("restart"):
        (restored,) = [e for e in events if isinstance(e, ev.StateRestored)]
        assert restored.source == candidate.split("-")[1]
    assert configured[0].at - killed.at == pytest.approx(decided.predicted_pause_s, rel=1e-9, abs=1e-12)
