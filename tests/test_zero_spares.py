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
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ftlab.experiments.job import JobResult
from tests.oracle import assert_on_fault_free_trajectory
from tests.support import explicit, node

STEPS = 8
JOB = ["experiment=plain", "cluster=local-4", "train.stages=2", "train.zero=1", f"train.steps={STEPS}",
       "protection=storage", "protection.every=2"]  # fmt: skip
"""Two pipelines of two stages: workers 0 and 2 share stage 0's optimizer state, workers 1 and 3 stage 1's."""


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> JobResult:
    from ftlab.experiments.job import compose_config, run_job

    d = tmp_path_factory.mktemp("fault-free")
    return run_job(compose_config([f"tracking.uri=sqlite:///{d}/mlflow.db", f"train.cache_dir={token_cache}",
                                   f"train.checkpoint_dir={d}", "progress=false", "policy=checkpoint_restart", *JOB]))


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
    assert [len(p.pipelines) for p in result.plans][0] == 2, "a group of two members shares each stage's state"
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
