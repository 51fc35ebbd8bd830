"""``policy=elastic`` on real processes: a killed node drops its replica and the whole ones go on in place; a joined
node forms a new replica healed from a live one; a lone survivor restarts with every layer; all stay on the
fault-free trajectory (``tests/oracle.py``).

Six local nodes of one worker each and ``train.stages=2``: three replicas (0, 1), (2, 3), (4, 5).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftlab.experiments.job import JobResult
from ftlab.runtime.control import events as ev
from ftlab.runtime.processes.hold import HOLD_DIR_ENV, registered_point, step_point
from tests.oracle import assert_on_fault_free_trajectory
from tests.support import explicit, node, run_apart

STEPS = 10
JOB = ["experiment=plain", "policy=elastic", "cluster=local-6", "train.stages=2", f"train.steps={STEPS}",
       "protection=storage", f"protection.every={STEPS}"]  # fmt: skip


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> JobResult:
    return run_apart(tmp_path_factory, token_cache, *JOB)


def assert_in_place(result: JobResult) -> None:
    """No committed step re-run, no process restarted."""
    assert [r.step for r in result.steps] == list(range(STEPS)), "a step was executed twice: work was lost"
    assert all(len(pids) == 1 for pids in result.worker_pids.values()), result.worker_pids


def test_a_killed_node_drops_its_replica_and_the_whole_ones_go_on(run, fault_free: JobResult) -> None:  # noqa: ANN001
    result = run(*JOB, *explicit(node(3, 4, "backward")))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    assert_in_place(result)
    assert [p.workers for p in result.plans[-1].pipelines] == [(0, 1), (4, 5)]
    assert result.faults[0].lost_steps == 0 and result.faults[0].transfer_bytes == 0, "nothing copied"


@pytest.fixture
def node_6_up_by_step_7(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A joining node boots beside training: the coordinator is held before step 6 until node 6's worker has
    registered, so the join is offered at that boundary or the next, by an event rather than a guessed time."""
    holds = tmp_path / "holds"
    holds.mkdir()
    monkeypatch.setenv(HOLD_DIR_ENV, str(holds))
    step, registered = holds / f"{step_point(6)}.hold", holds / f"{registered_point(6, 0)}.hold"
    step.touch()
    registered.touch()
    done = threading.Event()

    def release() -> None:
        reached = holds / f"{registered_point(6, 0)}.reached"
        while not reached.exists() and not done.wait(0.01):
            pass
        registered.unlink(missing_ok=True)
        step.unlink(missing_ok=True)

    releaser = threading.Thread(target=release, daemon=True)
    releaser.start()
    yield
    done.set()
    releaser.join()


@pytest.mark.usefixtures("node_6_up_by_step_7")
def test_a_joined_node_forms_a_replica_healed_from_a_live_one(run, fault_free: JobResult) -> None:  # noqa: ANN001
    result = run(*JOB, *explicit(node(3, 2, "forward"), "{kind: join, node: 6, at_step: 4}"))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    assert_in_place(result)
    assert [len(p.pipelines) for p in result.plans] == [3, 2, 3]
    # Worker 2 idled since step 2 (its layers are stale): it and the newcomer receive every layer of their stages.
    assert [p.workers for p in result.plans[-1].pipelines] == [(0, 1), (4, 5), (2, 6)]
    copied = [e for e in result.events if isinstance(e, ev.LayersCopied)]
    assert len(copied) == 1 and copied[0].copies == 8 and copied[0].nbytes > 0


def test_one_survivor_of_a_two_stage_layout_restarts_alone(run, fault_free: JobResult) -> None:  # noqa: ANN001
    """Five of six nodes die at once: no replica is whole and one worker cannot hold a stage of two, so the job
    restarts on that worker with every layer from the newest checkpoint (Roles.restarts: any live node)."""
    result = run(*JOB, *explicit(*(node(n, 4, "backward") for n in range(5))))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    (decided,) = [e for e in result.events if isinstance(e, ev.Decided)]
    assert decided.outcome == "restart"
    assert [p.workers for p in result.plans[-1].pipelines] == [(5,)]
