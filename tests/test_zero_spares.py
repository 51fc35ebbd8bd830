"""ZeRO-1 (``train.zero=1``) under the restarting policies, on real processes: a node killed while its group's commit
all-gathers the stepped chunks.

Under ZeRO-1 the commit is a collective (``runtime.processes.zero``): a member lost during its all-gather leaves the
group's survivors with their own chunk stepped and the others not, so they drop their state. The coordinator has
already sent them the next request (it never waits for a commit), and only learns of the failure from the death: a
survivor that dropped its state answers that request with ``Failed`` and waits for the Abort, whether it is the next
step's ``RunStep`` or a checkpoint's ``SaveCheckpoint`` it would have written layers to. The restart from storage
then leaves that survivor a spare (the grid of the three nodes left uses two) and stays on the fault-free trajectory
(``tests/oracle.py``).

The kills are armed in the ``optimizer`` phase of the killed worker: it stops before the all-gather, so the other
member's all-gather fails every time, where a kill at a step's start (``at_step`` alone) races with it.

The policies that copy layers in place (``Policy.moves_layers``: oobleck, elastic, recycle, bamboo, adaptive with
such candidates) never meet this: ZeRO-1 is refused with them before any worker starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ftlab.experiments.job import JobResult, check_job, compose_config
from ftlab.policies.catalog import build_default, policy_classes
from ftlab.runtime.core.contract import ConfigError
from tests.oracle import assert_on_fault_free_trajectory
from tests.support import analytic_profiles, explicit, node, run_apart

STEPS = 8
JOB = ["experiment=plain", "cluster=local-4", "train.stages=2", "train.zero=1", f"train.steps={STEPS}",
       "protection=storage", "protection.every=2"]  # fmt: skip
"""Two pipelines of two stages: workers 0 and 2 share stage 0's optimizer state, workers 1 and 3 stage 1's."""


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> JobResult:
    return run_apart(tmp_path_factory, token_cache, "policy=checkpoint_restart", *JOB)


def restarted(result: JobResult) -> tuple[int, ...]:
    (decided,) = [e for e in result.events if e.kind == "recovery_decision"]
    assert decided.outcome == "restart", decided.reason
    (restored,) = [e for e in result.events if e.kind == "restore"]
    return restored.step, tuple(result.plans[-1].workers)


@pytest.mark.parametrize("policy", ["checkpoint_restart", "varuna"])
def test_a_member_torn_by_the_commit_answers_the_next_step_and_restarts_as_a_spare(
    run, fault_free: JobResult, policy: str  # noqa: ANN001
) -> None:
    """Node 1 killed before step 4's all-gather: worker 3, its partner, drops stage 1's state and is sent step 5;
    the restart from step 4's checkpoint runs on workers 0 and 2."""
    result = run(*JOB, f"policy={policy}", *explicit(node(1, 4, "optimizer")))
    # Varuna morphs over the measured profile: any first plan of two pipelines or more shares each stage's state.
    assert len(result.plans[0].pipelines) >= 2, "no ZeRO-1 group to tear"
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    step, workers = restarted(result)
    assert step == 4 and result.faults[0].lost_steps == 1
    if policy == "checkpoint_restart":
        assert workers == (0, 2), "worker 3 is the spare"


def test_a_writer_torn_by_the_commit_answers_the_checkpoint_and_restarts_from_the_one_before(
    run, fault_free: JobResult  # noqa: ANN001
) -> None:
    """Node 3 killed before step 3's all-gather: worker 1, its partner and stage 1's writer, drops its state and is
    asked for step 4's checkpoint, which is never completed; the restart from step 2's runs on workers 0 and 1."""
    result = run(*JOB, "policy=checkpoint_restart", *explicit(node(3, 3, "optimizer")))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    step, workers = restarted(result)
    assert (step, workers) == (2, (0, 1)) and result.faults[0].lost_steps == 2


@pytest.mark.parametrize("name", sorted(policy_classes()))
def test_zero1_is_refused_before_any_worker_by_every_policy_that_copies_layers(
    name: str, job_overrides: list[str]
) -> None:
    cfg = OmegaConf.to_object(compose_config([*job_overrides, *JOB, f"policy={name}"]))
    with analytic_profiles():
        if not build_default("policy", name).moves_layers:
            assert check_job(cfg).decision.plan.workers, f"policy={name} trains under ZeRO-1"
            return
        with pytest.raises(ConfigError, match=f"policy={name} copies layers .* use train.zero=0"):
            check_job(cfg)
