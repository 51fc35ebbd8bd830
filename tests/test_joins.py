"""A joining node boots beside training: steps are committed while it starts, and the plan grows only at the first
iteration boundary after it is up. A join that fails while starting is logged, never a failure of the job.

On real processes the join's start is held where a test can see it (``runtime.processes.hold``): the joining
worker before it registers, the coordinator before a step and once it has admitted a registration. The simulator
is held to the same behaviour by its own clock (``sim.node_start_s`` plus the processes' start).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ftlab.experiments.config import JobConfig
from ftlab.experiments.job import JobResult, compose_config
from ftlab.experiments.simulate import simulate
from ftlab.runtime.control import events as ev
from ftlab.runtime.processes import local_backend
from ftlab.runtime.processes.hold import registered_point, step_point, worker_point
from tests.holds import JobThread, hold_at, holds, release  # noqa: F401 - holds: a fixture
from tests.oracle import assert_on_fault_free_trajectory
from tests.support import analytic_profiles, explicit, node

STEPS = 10
OOBLECK = ["policy=oobleck", "cluster=local-6", "cluster.device_memory_gb=0.04", f"train.steps={STEPS}",
           "protection=storage", f"protection.every={STEPS}"]  # fmt: skip
JOINS_AT, HELD_UNTIL = 3, 6
"""Node 6 starts at step 3; its worker is held before it registers until the coordinator stands before step 6."""
JOINING_WORKER = 6


def of(result: JobResult, kind: type[ev.Event]) -> list:
    return [e for e in result.events if isinstance(e, kind)]


def committed_while_joining(result: JobResult) -> list[int]:
    """The steps committed after the join's node started and before it was offered to the policy."""
    (started,) = [e for e in of(result, ev.FaultInjected) if e.fault_kind == "join"]
    (joined,) = of(result, ev.NodesJoined)
    return [s.step for s in result.steps if started.at < s.at < joined.at]


# -- real processes ----------------------------------------------------------------------------------------------
def test_steps_are_committed_while_a_joining_node_starts(run, holds: Path, tmp_path: Path) -> None:  # noqa: ANN001
    fault_free = run(*OOBLECK, f"train.checkpoint_dir={tmp_path}/fault-free")
    for point in (worker_point(JOINING_WORKER, 0), registered_point(JOINING_WORKER, 0), step_point(HELD_UNTIL)):
        hold_at(holds, point)
    joins = explicit(node(3, 2, "backward"), f"{{kind: join, node: 6, at_step: {JOINS_AT}}}")
    running = JobThread(lambda: run(*OOBLECK, f"train.checkpoint_dir={tmp_path}/joined", *joins))
    # The joining worker stands before its registration while training reaches step HELD_UNTIL: every step from
    # the join's to there was committed with the node still starting.
    running.reached(holds, worker_point(JOINING_WORKER, 0))
    running.reached(holds, step_point(HELD_UNTIL))
    release(holds, worker_point(JOINING_WORKER, 0))
    running.reached(holds, registered_point(JOINING_WORKER, 0))  # admitted: up by the next iteration boundary
    release(holds, registered_point(JOINING_WORKER, 0))
    release(holds, step_point(HELD_UNTIL))
    result = running.result()

    assert set(range(JOINS_AT, HELD_UNTIL)) <= set(committed_while_joining(result))
    (joined,) = of(result, ev.NodesJoined)
    assert joined.step == HELD_UNTIL + 1, "offered at the first boundary after it registered"
    assert 6 in result.plans[-1].workers and 3 not in result.plans[-1].workers
    grown = [p for p in of(result, ev.PlanConfigured) if p.at > joined.at]
    assert grown and grown[0].step == joined.step, "the plan changed at that boundary, not before"
    assert not of(result, ev.NodeLostWhileStarting)
    assert_on_fault_free_trajectory(result, fault_free, STEPS)


def test_a_joining_node_killed_while_it_starts_is_logged_and_the_job_goes_on(run, holds: Path) -> None:  # noqa: ANN001
    hold_at(holds, worker_point(JOINING_WORKER, 0))  # it cannot be up before the kill, whatever this machine's speed
    result = run(*OOBLECK, *explicit(f"{{kind: join, node: 6, at_step: {JOINS_AT}}}", "{kind: node, node: 6, at_step: 5}"))
    (lost,) = of(result, ev.NodeLostWhileStarting)
    assert lost.node == 6 and lost.reason == "killed while it started"
    assert not of(result, ev.FailureDetected) and not of(result, ev.NodesJoined)
    assert [s.step for s in result.steps] == list(range(STEPS)), "no step lost, none repeated"
    assert len(result.plans) == 1


def test_a_joining_node_not_up_in_time_is_given_up_and_the_job_goes_on(
    run, holds: Path, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    monkeypatch.setattr(local_backend, "_RESTART_TIMEOUT_S", 0.0)  # late at the first boundary after its start
    hold_at(holds, worker_point(JOINING_WORKER, 0))  # and held: it cannot be up by then
    result = run(*OOBLECK, *explicit(f"{{kind: join, node: 6, at_step: {JOINS_AT}}}"))
    (lost,) = of(result, ev.NodeLostWhileStarting)
    assert lost.node == 6 and lost.reason == "it did not come up within 0 s"
    assert not of(result, ev.FailureDetected) and not of(result, ev.NodesJoined)
    assert [s.step for s in result.steps] == list(range(STEPS)) and len(result.plans) == 1


# -- the simulator -----------------------------------------------------------------------------------------------
SIM_STEPS = 20000
NODE_START_S = 2.0
"""Long against a simulated step of gpt2-tiny on A100s (milliseconds): the join spans many steps."""
SIM = ["mode=simulate", "policy=oobleck", "cluster=local-6", "cluster.device=A100-40GB", "cluster.device_memory_gb=0.04",
       f"train.steps={SIM_STEPS}", f"sim.node_start_s={NODE_START_S}"]  # fmt: skip


def simulated(job_overrides: list[str], *overrides: str) -> JobResult:
    cfg: JobConfig = OmegaConf.to_object(compose_config([*job_overrides, *SIM, *overrides]))
    with analytic_profiles():
        return simulate(cfg).result


def test_a_simulated_join_boots_beside_training(job_overrides: list[str]) -> None:
    result = simulated(job_overrides, *explicit(node(3, 2, "backward"), "{kind: join, node: 6, at_step: 20}"))
    (started,) = [e for e in of(result, ev.FaultInjected) if e.fault_kind == "join"]
    (joined,) = of(result, ev.NodesJoined)
    assert joined.at - started.at >= NODE_START_S, "offered once its start-up time has elapsed"
    assert len(committed_while_joining(result)) > 100, "training went on meanwhile"
    # The step the node started in took as long as its plan's later steps: the clock did not stop for it.
    fired_in = next(s for s in result.steps if s.step == 20)
    later = [s.iter_s for s in result.steps if s.generation == fired_in.generation and s.step > 20]
    assert fired_in.iter_s == pytest.approx(statistics.median(later))
    grown = next(p for p in of(result, ev.PlanConfigured) if p.at >= joined.at)
    assert grown.step == joined.step and 6 in result.plans[-1].workers
    assert grown.at - joined.at < NODE_START_S, "the join's pause is its configuration, not a node's start"


def test_a_simulated_joining_node_killed_while_it_starts_is_no_failure(job_overrides: list[str]) -> None:
    result = simulated(job_overrides, *explicit("{kind: join, node: 6, at_step: 20}", "{kind: node, node: 6, at_step: 30}"))
    (lost,) = of(result, ev.NodeLostWhileStarting)
    assert lost.node == 6 and lost.reason == "killed while it started"
    assert not of(result, ev.FailureDetected) and not of(result, ev.NodesJoined)
    assert len(result.plans) == 1 and result.steps[-1].step == SIM_STEPS - 1
