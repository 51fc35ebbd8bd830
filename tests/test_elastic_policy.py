"""``policy=elastic``'s decisions, on the simulator (the same policy code the processes run): survivors of broken
replicas form a whole one when they hold complementary stages, a restart when no layer set survives (on fewer stages
when fewer workers than ``train.stages`` live), a stop without saved state, and a layout that cannot fit refused
before any worker starts."""

from __future__ import annotations

import pytest

from ftlab.experiments.job import JobResult, compose_config
from ftlab.experiments.simulate import simulate_job
from ftlab.runtime.control import events as ev
from ftlab.runtime.control.coordinator import JobStopped
from ftlab.runtime.core.contract import ConfigError
from tests.support import explicit, node

STEPS = 8


def simulate(job_overrides: list[str], *overrides: str) -> JobResult:
    return simulate_job(compose_config([*job_overrides, "mode=simulate", "policy=elastic", "cluster=local-4",
                                   "train.stages=2", f"train.steps={STEPS}", *overrides]))  # fmt: skip


def decisions(result: JobResult) -> list[ev.Decided]:
    return [e for e in result.events if isinstance(e, ev.Decided)]


def test_survivors_holding_complementary_stages_form_a_replica_without_a_copy(job_overrides: list[str]) -> None:
    # Replicas (0, 1) and (2, 3); workers 1 and 2 die together: 0 holds stage 0, 3 stage 1.
    result = simulate(job_overrides, *explicit(node(1, 3, "backward"), node(2, 3, "backward")))
    (decided,) = decisions(result)
    assert decided.outcome == "replan" and decided.transfers == 0
    assert [p.workers for p in result.plans[-1].pipelines] == [(0, 3)]
    assert [r.step for r in result.steps] == list(range(STEPS))


def test_no_surviving_copy_of_a_stage_restarts_from_the_protection(job_overrides: list[str]) -> None:
    result = simulate(job_overrides, "protection=storage", "protection.every=2",
                      *explicit(node(1, 3, "backward"), node(3, 3, "backward")))  # fmt: skip
    (decided,) = decisions(result)
    assert decided.outcome == "restart" and decided.resume_step == 2
    assert [p.workers for p in result.plans[-1].pipelines] == [(0, 2)]


def test_fewer_survivors_than_stages_restart_on_one_stage_each(job_overrides: list[str]) -> None:
    # Three stages on four workers: replica (0, 1, 2) and worker 3 idle. Workers 0 and 1 die: two are left.
    result = simulate(job_overrides, "train.stages=3", "protection=storage", "protection.every=2",
                      *explicit(node(0, 3, "backward"), node(1, 3, "backward")))  # fmt: skip
    (decided,) = decisions(result)
    assert decided.outcome == "restart" and decided.resume_step == 2
    assert [p.workers for p in result.plans[-1].pipelines] == [(2, 3)]
    assert [r.step for r in result.steps][-1] == STEPS - 1


def test_no_surviving_copy_of_a_stage_stops_without_saved_state(job_overrides: list[str]) -> None:
    with pytest.raises(JobStopped, match="protection=storage"):
        simulate(job_overrides, *explicit(node(1, 3, "backward"), node(3, 3, "backward")))


def test_a_layout_no_replica_fits_is_refused_before_any_worker(job_overrides: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"lower train.stages to at most 4"):
        simulate(job_overrides, "train.stages=5")
