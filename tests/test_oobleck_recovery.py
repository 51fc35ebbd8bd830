"""Oobleck recovers node failures in place on real processes and stays on the fault-free trajectory.

Six (or eight) local nodes, each device granted 40 MB so every pipeline spans two nodes and a failure forces a
reconfiguration that copies layers between survivors. Each scenario is compared with a fault-free run of the same
job: the loss at every step and the final parameters must match within the equivalence tolerance (pipelines change
shape, so floating-point sums change order), no committed step may be lost, and no surviving process may restart.

The scenarios name nodes and expect pipelines of two nodes each, so Oobleck plans from the analytic cost model here
(an A100's, the same every run) rather than from a profile measured on this noisy machine: a measured profile can
make three-node pipelines the faster choice, and then the node that should receive layers receives none.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftlab.runtime.state import checkpoint
from ftlab.experiments.job import JobResult, compose_config, run_job
from ftlab.runtime.control.coordinator import JobStopped
from tests.holds import holds, up_before  # noqa: F401 - holds: a fixture
from tests.oracle import LOSS_RTOL, assert_on_fault_free_trajectory, committed_losses
from tests.support import analytic_profiles, explicit

STEPS = 10


def oobleck(nodes: int, f: int) -> list[str]:
    return [
        "experiment=plain", "policy=oobleck", f"policy.fault_threshold={f}", f"cluster.nodes={nodes}",
        "cluster.device_memory_gb=0.04", f"train.steps={STEPS}", "protection=storage", f"protection.every={STEPS}",
    ]  # fmt: skip


def assert_recovered_in_place(result: JobResult, fault_free: JobResult) -> None:
    """On the fault-free trajectory, and no step executed twice: recovered in place, no work lost."""
    assert [r.step for r in result.steps] == list(range(STEPS)), "a step was executed twice: work was lost"
    assert_on_fault_free_trajectory(result, fault_free, STEPS)


@pytest.fixture(scope="module", autouse=True)
def deterministic_plans() -> Iterator[None]:
    with analytic_profiles():
        yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> dict[int, JobResult]:
    """Fault-free runs of the 6-node (f=1) and 8-node (f=2) jobs."""
    runs = {}
    for nodes, f in ((6, 1), (8, 2)):
        d = tmp_path_factory.mktemp(f"reference-{nodes}")
        common = [f"tracking.uri=sqlite:///{d}/mlflow.db", f"train.cache_dir={token_cache}", f"train.checkpoint_dir={d}", "progress=false"]
        runs[nodes] = run_job(compose_config([*common, *oobleck(nodes, f)]))
    return runs


def assert_no_survivor_restarted(result: JobResult) -> None:
    assert all(len(pids) == 1 for pids in result.worker_pids.values()), result.worker_pids


def test_one_node_killed_is_recovered_in_place(run, reference: dict[int, JobResult]) -> None:  # noqa: ANN001
    result = run(*oobleck(6, 1), *explicit("{kind: node, node: 3, at_step: 4, phase: backward}"))
    assert_recovered_in_place(result, reference[6])
    assert_no_survivor_restarted(result)
    (fault,) = result.faults
    assert fault.lost_steps == 0 and fault.transfer_bytes > 0, "the merged pipeline needs layers copied"
    assert [len(p.pipelines) for p in result.plans] == [3, 2]
    assert sum(len(p.microbatches) for p in result.plans[-1].pipelines) == 8, "the global batch stays the same"


def test_two_nodes_killed_one_after_the_other_with_f2(run, reference: dict[int, JobResult]) -> None:  # noqa: ANN001
    result = run(*oobleck(8, 2), *explicit("{kind: node, node: 1, at_step: 3, phase: forward}", "{kind: node, node: 6, at_step: 6, phase: reduce}"))
    assert_recovered_in_place(result, reference[8])
    assert_no_survivor_restarted(result)
    assert [f.lost_steps for f in result.faults] == [0, 0]
    assert len(result.plans[-1].pipelines) >= 3, "f + 1 pipelines remain"


def test_two_nodes_killed_at_the_same_moment(run, reference: dict[int, JobResult]) -> None:  # noqa: ANN001
    result = run(*oobleck(8, 2), *explicit("{kind: node, node: 2, at_step: 5}", "{kind: node, node: 5, at_step: 5}"))
    assert_recovered_in_place(result, reference[8])
    assert_no_survivor_restarted(result)
    assert len(result.plans) == 2, "both failures were handled by one reconfiguration"


def test_a_node_killed_while_layers_are_being_copied(run, reference: dict[int, JobResult]) -> None:  # noqa: ANN001
    # After node 3 dies at step 4, node 0 receives layers 2..4 for the merged pipeline; it is killed mid-copy.
    result = run(*oobleck(6, 1), *explicit("{kind: node, node: 3, at_step: 4}", "{kind: node, node: 0, at_step: 4, phase: transfer}"))
    assert_recovered_in_place(result, reference[6])
    assert_no_survivor_restarted(result)
    assert len(result.faults) == 2 and all(f.lost_steps == 0 for f in result.faults)
    assert 0 not in result.plans[-1].workers and 3 not in result.plans[-1].workers


def test_a_join_after_a_failure_is_instantiated_from_the_templates(
    run, holds: Path, reference: dict[int, JobResult]  # noqa: ANN001
) -> None:
    faults = explicit("{kind: node, node: 3, at_step: 2}", "{kind: join, node: 6, at_step: 5}")
    result = up_before(holds, [6], 7, lambda: run(*oobleck(6, 1), *faults))  # boots from step 5, offered by step 8
    assert_recovered_in_place(result, reference[6])
    assert 6 in result.plans[-1].workers and 3 not in result.plans[-1].workers
    assert len(result.plans) == 3


def test_when_recovery_in_place_is_impossible_it_stops_with_a_checkpoint_to_resume_from(
    run, tmp_path: Path, reference: dict[int, JobResult]  # noqa: ANN001
) -> None:
    kills = explicit("{kind: node, node: 1, at_step: 2}", "{kind: node, node: 3, at_step: 4}", "{kind: node, node: 5, at_step: 6}")
    with pytest.raises(JobStopped, match="cannot recover in place") as info:
        run(*oobleck(6, 1), *kills)
    message = str(info.value)
    assert "resume with train.resume_from=" in message
    saved = Path(message.split("train.resume_from=")[1].strip())
    found = checkpoint.find(saved)
    assert found is not None and found[0] == 6, "the last committed step before the third failure"
    resumed_job = [o for o in oobleck(6, 1) if not o.startswith("policy")] + ["policy=checkpoint_restart"]
    resumed = run(*resumed_job, f"train.resume_from={saved}", "protection.every=2")
    assert [r.step for r in resumed.steps] == list(range(6, STEPS))
    assert [r.loss for r in resumed.steps] == pytest.approx(committed_losses(reference[6], STEPS)[6:], rel=LOSS_RTOL)
