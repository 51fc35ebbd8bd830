"""The oracle with bf16 and global clipping: a run recovered from a kill equals the fault-free run, for every
policy with every protection (found by discovery, ``policies.catalog``), and with fp16's loss scaler across a
restart from storage.

Every job is bf16 with ``train.grad_clip=1.0`` (gpt2-tiny's gradient norm is near 5, so every step is clipped) on six
local nodes with 40 MB per device, so Oobleck's pipelines span two nodes, as in ``make fault-ci``. Kills land in
different phases: the forward and backward passes, the reduction, and the optimizer phase, which begins at the
coordinator's Commit, after the worker's Ready carried its gradient norms. One fault-free run of the same job is
the reference for all (every layout trains the same model: ``tests/test_precision.py``). The default suite runs a
few pairs; ``make test-slow`` runs every pair.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from ftlab.experiments.job import JobResult, compose_config, run_job
from ftlab.policies.catalog import policy_classes, protection_classes
from ftlab.runtime.control.coordinator import JobStopped
from ftlab.runtime.core.contract import ConfigError
from tests.oracle import assert_on_fault_free_trajectory, committed_losses
from tests.support import explicit, node

STEPS = 6
BF16_CLIP = ["train.precision=bf16", "train.grad_clip=1.0"]
SAVES = {
    "storage": ["protection.every=3"],
    "reft": ["protection.interval=1", "protection.flush_every=3"],
}
"""Every protection that saves writes a checkpoint of the last step, which the oracle reads."""
FAST = {("oobleck", "reft", "backward"), ("checkpoint_restart", "storage", "optimizer")}
PHASES = ("forward", "backward", "reduce", "optimizer")

Run = Callable[..., JobResult]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> Run:
    base = tmp_path_factory.mktemp("precision-recovery")
    runs = iter(range(1000))

    def run(*overrides: str) -> JobResult:
        d = base / str(next(runs))
        return run_job(compose_config([
            "experiment=plain", f"tracking.uri=sqlite:///{base}/mlflow.db", f"train.cache_dir={token_cache}",
            f"train.checkpoint_dir={d}", "progress=false", "cluster=local-6", "cluster.device_memory_gb=0.04",
            f"train.steps={STEPS}", *overrides,
        ]))  # fmt: skip

    return run


@pytest.fixture(scope="module")
def fault_free(job: Run) -> JobResult:
    return job(*BF16_CLIP, "protection=storage", f"protection.every={STEPS}")


def pairs() -> list[object]:
    """Every policy with every protection, each with a phase to kill in (they take turns); the FAST ones unmarked."""
    found = [(p, q) for p in sorted(policy_classes()) for q in sorted(protection_classes())]
    params = []
    for i, (policy, protection) in enumerate(found):
        phase = next((ph for p, q, ph in FAST if (p, q) == (policy, protection)), PHASES[i % len(PHASES)])
        marks = () if (policy, protection, phase) in FAST else (pytest.mark.slow,)
        params.append(pytest.param(policy, protection, phase, marks=marks, id=f"{policy}-{protection}-{phase}"))
    return params


@pytest.mark.parametrize(("policy", "protection", "phase"), pairs())
def test_a_recovered_bf16_clipped_run_equals_the_fault_free_one(
    job: Run, fault_free: JobResult, policy: str, protection: str, phase: str
) -> None:
    pair = [*BF16_CLIP, f"policy={policy}", f"protection={protection}", *SAVES.get(protection, []),
            *explicit(node(3, 3, phase))]  # fmt: skip
    try:
        try:
            result = job(*pair)
        except ConfigError as refused:  # a policy that keeps more state per device (Bamboo's copies) gets twice
            if "cluster.device_memory_gb" not in str(refused):
                raise
            result = job(*pair, "cluster.device_memory_gb=0.08")
    except ConfigError as refused:  # a policy that restarts, with nothing saved to restart from
        assert "protection=" in str(refused)
        return
    except JobStopped as stopped:  # a policy that does not recover
        assert not policy_classes()[policy].roles.recovers, str(stopped)
        return
    assert len(result.faults) == 1
    if protection in SAVES:
        assert_on_fault_free_trajectory(result, fault_free, STEPS)
    else:
        assert committed_losses(result, STEPS) == pytest.approx(committed_losses(fault_free, STEPS), rel=1e-5)


def test_fp16_restarted_from_storage_takes_up_the_scaler_of_that_step(job: Run) -> None:
    # 2**24 overflows the first steps' fp16 gradients: the scale halves each step until they fit. A restart from
    # step 2's checkpoint must redo steps 2 and 3 with step 2's scale, skips included, or the losses part.
    fp16 = ["train.precision=fp16", "train.initial_scale_power=24", "train.hysteresis=1", "train.grad_clip=1.0",
            "policy=checkpoint_restart", "protection=storage", "protection.every=2"]  # fmt: skip
    reference = job(*fp16)
    result = job(*fp16, *explicit(node(3, 3, "backward")))
    assert [r.step for r in result.steps].count(2) == 2, "the restart should redo step 2 from its checkpoint"
    assert_on_fault_free_trajectory(result, reference, STEPS)
    # What the run records of each update, as finally committed, is the fault-free run's: a redone skip counts once.
    scaler = {r.step: (r.numerics.loss_scale, r.numerics.skipped_steps) for r in result.steps}  # the last commits
    assert scaler == {r.step: (r.numerics.loss_scale, r.numerics.skipped_steps) for r in reference.steps}
    assert result.summary["summary/skipped_steps"] == reference.summary["summary/skipped_steps"] > 0
