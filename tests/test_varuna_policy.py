"""``policy=varuna`` morphs over every live node where ``checkpoint_restart`` keeps its grid: the same failure on the
same cluster, in the simulator (the same policy code the processes run); and what it refuses before any worker."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from ftlab.experiments.job import JobResult, check_job, compose_config, everyone, job_factory
from ftlab.experiments.simulate import simulate_job
from ftlab.policies.varuna.morph import balanced_split
from ftlab.runtime.core.contract import ConfigError
from ftlab.runtime.core.plan import even_split
from tests.support import explicit, node

# Six A40 nodes of one GPU (Oobleck's evaluation cluster, cut down), in tf32 at 90% of its peak.
CLUSTER = ["mode=simulate", "cluster=a40-30x1", "train.precision=tf32", "cluster.device_efficiency=0.9",
           "cluster.nodes=6", "cluster.backend=gloo", "model=gpt2-small", "train.stages=2", "train.steps=6",
           "protection=storage", "protection.every=2"]  # fmt: skip


def simulate(job_overrides: list[str], policy: str, *extra: str) -> JobResult:
    return simulate_job(compose_config([*job_overrides, *CLUSTER, f"policy={policy}", *extra,
                                        *explicit(node(3, 3, "backward"))]))  # fmt: skip


def test_varuna_uses_every_surviving_node_where_checkpoint_restart_idles_one(job_overrides: list[str]) -> None:
    """At 32 micro-batches the machine predicts gpt2-small fastest on the five survivors as five one-stage replicas,
    faster than the 2 x 2 grid of train.stages=2."""
    grid = simulate(job_overrides, "checkpoint_restart", "train.global_batch=64")
    morphed = simulate(job_overrides, "varuna", "train.global_batch=64")
    survivors = 5
    assert len(grid.plans[-1].workers) == 4, "the 2 x 2 grid of train.stages leaves a survivor idle"
    assert len(morphed.plans[-1].workers) == survivors
    assert [r.step for r in morphed.steps][-1] == 5 and morphed.faults[0].lost_steps == 1, "restarted from step 2"


def refused(job_overrides: list[str], *overrides: str) -> str:
    cfg = OmegaConf.to_object(compose_config([*job_overrides, "policy=varuna", *overrides]))
    with pytest.raises(ConfigError) as info:
        check_job(cfg)  # type: ignore[arg-type]
    return str(info.value)


def test_varuna_without_saved_state_is_refused(job_overrides: list[str]) -> None:
    assert "add protection=storage" in refused(job_overrides, "protection=none")


def test_varuna_where_no_configuration_fits_memory_is_refused(job_overrides: list[str]) -> None:
    message = refused(job_overrides, "protection=storage", "cluster.device_memory_gb=0.02")  # each layer fits alone
    assert "no configuration of 4 workers fits" in message and "raise cluster.device_memory_gb" in message


def test_varuna_weighs_only_configurations_its_protection_can_protect(job_overrides: list[str]) -> None:
    """On five nodes the machine predicts one deep pipeline fastest, which REFT cannot protect (a single holder of
    every layer): Varuna takes the fastest configuration with two replicas of every stage instead of being
    refused, as it was on real processes under bench_policies' measured host."""
    five = [*job_overrides, *CLUSTER[:-2], "cluster.nodes=5", "policy=varuna"]  # CLUSTER less its protection
    fastest = check_job(OmegaConf.to_object(compose_config([*five, "protection=storage"])))  # type: ignore[arg-type]
    assert len(fastest.decision.plan.pipelines) == 1, "the case this test is about: one deep pipeline is fastest"
    protected = check_job(OmegaConf.to_object(compose_config([*five, "protection=reft"])))  # type: ignore[arg-type]
    assert all(len(p.stages) == 2 for p in protected.decision.plan.pipelines)
    assert len(protected.decision.plan.pipelines) == 2


def test_varuna_balances_stages_by_profiled_compute(job_overrides: list[str]) -> None:
    """gpt2-small's head (a vocabulary-wide matmul) costs several blocks: Varuna's partitioner gives the last stage
    fewer layers than an even split would, and its busiest stage computes less than the even split's."""
    cfg = OmegaConf.to_object(compose_config([*job_overrides, *CLUSTER, "policy=varuna"]))
    job = job_factory(cfg, None)(everyone(cfg))  # type: ignore[arg-type]
    costs = job.costs

    def busiest(bounds: list[tuple[int, int]]) -> float:
        return max(costs.forward_s(a, b) + costs.backward_s(a, b) for a, b in bounds)

    balanced, even = balanced_split(job, 4), even_split(len(job.specs), 4)
    assert balanced[-1][1] - balanced[-1][0] < even[-1][1] - even[-1][0]
    assert busiest(balanced) < busiest(even)
    assert [b[0] for b in balanced[1:]] == [b[1] for b in balanced[:-1]] and balanced[0][0] == 0
