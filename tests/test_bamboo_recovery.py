"""``policy=bamboo`` on real processes, held to the fault-free trajectory (``tests/oracle.py``): a killed node's
stage is taken over from the copy a neighbour keeps, with no restart and no step lost; a stage lost with the worker
keeping its copy restarts every worker from the protection's checkpoint.

Six local nodes of one worker each, ``train.stages=2``: pipelines (0, 1), (2, 3), (4, 5), each stage keeping a copy
of the other (kept current from step 1 on).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ftlab.experiments.job import JobResult
from tests.oracle import assert_on_fault_free_trajectory
from tests.support import explicit, node, run_apart

STEPS = 10
JOB = ["experiment=plain", "policy=bamboo", "cluster=local-6", "cluster.device_memory_gb=0.08", "train.stages=2",
       f"train.steps={STEPS}", "protection=storage", f"protection.every={STEPS}"]  # fmt: skip


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> JobResult:
    return run_apart(tmp_path_factory, token_cache, *JOB)


def test_a_killed_stage_is_taken_over_by_its_predecessor_without_a_restart(run, fault_free: JobResult) -> None:  # noqa: ANN001
    result = run(*JOB, *explicit(node(3, 5, "backward")))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    assert [r.step for r in result.steps] == list(range(STEPS)), "a committed step was run again"
    assert all(len(pids) == 1 for pids in result.worker_pids.values()), "a process restarted"
    last = result.plans[-1]
    assert [p.spans for p in last.pipelines] == [((0, 4), (4, 8)), ((0, 8),), ((0, 4), (4, 8))]
    assert last.pipelines[1].workers == (2,), "worker 2 runs the stage of worker 3 from its copy"
    fault = result.faults[0]
    assert fault.lost_steps == 0 and fault.transfer_bytes == 0, "nothing copied or restored: the copy was current"


def test_a_stage_and_the_worker_keeping_its_copy_lost_restart_from_the_checkpoint(run, tmp_path: Path) -> None:  # noqa: ANN001
    every = ["protection.every=5"]  # checkpoints of steps 5 and 10 (the oracle reads the last)
    fault_free = run(*JOB, *every, f"train.checkpoint_dir={tmp_path}/fault-free")
    result = run(*JOB, *every, f"train.checkpoint_dir={tmp_path}/killed",
                 *explicit(node(3, 3, "backward"), node(2, 7, "forward")))  # fmt: skip
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    assert result.faults[0].lost_steps == 0, "the first failure is taken over in place"
    assert result.faults[1].lost_steps == 2, "the second restarts from the checkpoint of step 5"
    assert any(len(pids) > 1 for pids in result.worker_pids.values()), "every worker restarted"


def test_a_killed_first_stage_is_taken_over_by_its_successor(run, fault_free: JobResult) -> None:  # noqa: ANN001
    result = run(*JOB, *explicit(node(4, 4, "reduce")))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    assert [r.step for r in result.steps] == list(range(STEPS)) and result.faults[0].lost_steps == 0
    assert [p.workers for p in result.plans[-1].pipelines] == [(0, 1), (2, 3), (5,)], "worker 5 kept stage 0's copy"
