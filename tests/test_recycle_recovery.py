"""ReCycle keeps training through real failures, on real processes, on the fault-free trajectory.

Every scenario is held to the equivalence oracle against one fault-free run (any layout of the same global batch
trains the same model): the loss of every step within rel 1e-5, the final parameters within 2e-5. Rerouting
restarts no process (each worker keeps its one PID), copies no layer and loses no committed step; the rerouted
programs run decoupled backward (``BackwardInput`` now, ``BackwardWeight`` in a bubble), so these runs are also the
oracle's check of the executor's decoupled path. Kills land in every phase of an iteration, for a node and for a
worker process, and accumulate across stages; a node of two workers takes a whole pipeline; a node that joins takes
a failed role back; a stage that loses every replica restarts from storage or stops. The staggered optimizer runs
the same oracle with kills at its early optimizer step and while a stage that already stepped waits for the commit.

Plans come from the analytic cost model (an A100's), so the schedules are the same on every run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftlab.experiments.job import JobResult, compose_config, run_job
from ftlab.runtime.control.coordinator import JobStopped
from tests.holds import holds, up_before  # noqa: F401 - holds: a fixture
from tests.oracle import LOSS_RTOL, assert_on_fault_free_trajectory, committed_losses
from tests.support import analytic_profiles, explicit, node, process

STEPS = 10


def recycle(cluster: str = "local-4", every: int | None = STEPS) -> list[str]:
    """The job; ``every``: storage checkpoints every so many steps (the last one is the final state), or none."""
    protection = ["protection=storage", f"protection.every={every}"] if every else ["protection=none"]
    return ["experiment=plain", "policy=recycle", f"cluster={cluster}", "train.stages=2", f"train.steps={STEPS}",
            *protection]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def deterministic_plans() -> Iterator[None]:
    with analytic_profiles():
        yield


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> JobResult:
    d = tmp_path_factory.mktemp("fault-free")
    common = [f"tracking.uri=sqlite:///{d}/mlflow.db", f"train.cache_dir={token_cache}", f"train.checkpoint_dir={d}",
              "progress=false"]  # fmt: skip
    return run_job(compose_config([*common, *recycle()]))


def assert_rerouted_in_place(result: JobResult, failures: int) -> None:
    """No restart, no layer copied, no committed step lost, one plan per failure, decoupled programs ran."""
    assert [r.step for r in result.steps] == list(range(STEPS)), "a step ran twice: committed work was lost"
    assert all(len(pids) == 1 for pids in result.worker_pids.values()), result.worker_pids
    assert len(result.faults) == failures
    assert all(f.lost_steps == 0 and f.transfer_bytes == 0 for f in result.faults), result.faults
    assert len(result.plans) == failures + 1


@pytest.mark.parametrize(
    "kills",
    [
        pytest.param((node(1, 2, "forward"), process(2, 4, "backward"), node(5, 6, "reduce"), process(4, 8, "optimizer")),
                     id="node-forward,worker-backward,node-reduce,worker-optimizer"),
        pytest.param((process(1, 2, "forward"), node(2, 4, "backward"), process(5, 6, "reduce"), node(4, 8, "optimizer")),
                     id="worker-forward,node-backward,worker-reduce,node-optimizer", marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_nodes_and_workers_killed_in_every_phase_are_rerouted(run, fault_free: JobResult, kills: tuple[str, ...]) -> None:  # noqa: ANN001
    # 2 stages x 4 pipelines; the kills alternate between stage 1 (nodes 1, 5) and stage 0 (nodes 2, 4).
    result = run(*recycle("local-8"), *explicit(*kills))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    assert_rerouted_in_place(result, failures=4)
    final = result.plans[-1]
    assert set(final.workers) == {0, 3, 6, 7} and len(final.pipelines) > 2, "peers serve several pipelines"


def test_a_node_of_two_workers_takes_a_whole_pipeline(run, fault_free: JobResult) -> None:  # noqa: ANN001
    result = run(*recycle("local-4x2"), *explicit(node(1, 4, "backward")))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    assert_rerouted_in_place(result, failures=1)
    assert set(result.plans[-1].workers) == {0, 1, 4, 5, 6, 7}


def test_a_joined_node_takes_back_the_failed_role(run, holds: Path, fault_free: JobResult) -> None:  # noqa: ANN001
    faults = explicit(node(1, 2, "backward"), "{kind: join, node: 4, at_step: 5}")
    result = up_before(holds, [4], 7, lambda: run(*recycle(), *faults))  # boots from step 5, offered by step 8
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    assert [p.workers for p in result.plans[-1].pipelines] == [(0, 4), (2, 3)], "the fault-free grid again"
    assert len(result.plans) == 3 and result.faults[0].lost_steps == 0
    survivors = {w: pids for w, pids in result.worker_pids.items() if w != 1}
    assert all(len(pids) == 1 for pids in survivors.values())


def test_a_stage_that_lost_every_replica_restarts_from_storage(run, fault_free: JobResult) -> None:  # noqa: ANN001
    result = run(*recycle(every=3), *explicit(node(1, 2, "forward"), node(3, 5, "backward")))
    assert committed_losses(result, STEPS) == pytest.approx(committed_losses(fault_free, STEPS), rel=LOSS_RTOL)
    first, second = result.faults
    assert first.lost_steps == 0 and second.lost_steps == 2, "restarted from the checkpoint of step 3"
    assert [p.workers for p in result.plans[-1].pipelines] == [(0, 2)]


def test_a_stage_that_lost_every_replica_stops_without_protection(run) -> None:  # noqa: ANN001
    with pytest.raises(JobStopped, match=r"every worker of stage 1 \(layers 4..7\) failed") as info:
        run(*recycle(every=None), *explicit(node(1, 2, "forward"), node(3, 4, "forward")))
    assert "protection=storage" in str(info.value)


def test_staggered_optimizer_is_exact_and_undone_when_the_iteration_aborts(run, fault_free: JobResult) -> None:  # noqa: ANN001
    # Step 3: worker 1 dies at its early optimizer step (its Ready sent, stage 0 still at work), after its peer 3
    # stepped too; step 6: worker 2 dies at its gradient reduction while worker 3 (stage 1 alone by then) has
    # already stepped. Both steps abort and the survivors' early steps are undone, else the next steps would start
    # from the wrong weights (this test fails with the undo left out).
    result = run(*recycle(), "policy.staggered_optimizer=true", *explicit(node(1, 3, "optimizer"), node(2, 6, "reduce")))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    assert_rerouted_in_place(result, failures=2)
