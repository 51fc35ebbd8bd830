"""``policy=varuna`` on real processes: a killed node restarts every worker from the newest checkpoint, morphed over
the survivors, and the run stays on the fault-free trajectory (``tests/oracle.py``)."""

from __future__ import annotations

from tests.oracle import assert_on_fault_free_trajectory
from tests.support import explicit, node

STEPS = 10
JOB = ["experiment=plain", "policy=varuna", "cluster=local-6", f"train.steps={STEPS}", "protection=storage",
       "protection.every=5"]  # fmt: skip


def test_a_killed_node_restarts_morphed_from_the_checkpoint_on_the_fault_free_curve(run, tmp_path) -> None:  # noqa: ANN001
    fault_free = run(*JOB, f"train.checkpoint_dir={tmp_path}/fault-free")
    result = run(*JOB, f"train.checkpoint_dir={tmp_path}/killed", *explicit(node(3, 7, "backward")))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    (fault,) = result.faults
    assert fault.lost_steps == 2, "restarted from the checkpoint of step 5"
    assert 3 not in result.plans[-1].workers and any(len(pids) > 1 for pids in result.worker_pids.values())
