"""Preemption warnings (``warning_s``): the schedule refuses what cannot be warned, the policy hears of the notice
before the kill (varuna and checkpoint_restart at once, giving the iteration in flight up, and checkpoint; the others
at the next iteration boundary, and go on), the kill comes when the warning said, and the run's events record both;
on the simulator and on real processes, held to the fault-free trajectory."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftlab.experiments.job import JobResult, compose_config
from ftlab.experiments.simulate import simulate_job
from ftlab.faults.schedules import ClusterShape, FaultConfigError, build_schedule
from ftlab.runtime.control import events as ev
from tests.oracle import assert_on_fault_free_trajectory

SIX = ClusterShape(nodes=6, workers_per_node=1)


def refusal(**faults: object) -> str:
    with pytest.raises(FaultConfigError) as info:
        build_schedule(faults, SIX)
    return str(info.value)


def test_what_cannot_be_warned_is_refused() -> None:
    assert "use kind: node" in refusal(schedule="explicit", events=[
        {"kind": "process", "node": 1, "worker": 0, "at_step": 3, "warning_s": 2.0}])
    assert "not in a phase" in refusal(schedule="explicit", events=[
        {"kind": "node", "node": 1, "at_step": 3, "phase": "backward", "warning_s": 2.0}])
    assert "> 0" in refusal(schedule="explicit", events=[{"kind": "node", "node": 1, "at_step": 3, "warning_s": 0}])
    assert "set faults.kind=node" in refusal(schedule="fixed", kind="process", interval_steps=3, max_failures=2,
                                             warning_s=1.0)  # fmt: skip


def test_a_warning_longer_than_the_gap_to_the_next_fault_is_refused() -> None:
    message = refusal(schedule="explicit", warning_s=30.0, events=[
        {"kind": "node", "node": 1, "at_time_s": 10.0}, {"kind": "node", "node": 2, "at_time_s": 20.0}])
    assert "longer than the 10 s until the next fault" in message and "lower warning_s to at most 10" in message


def test_preemptions_at_the_same_instant_are_warned_together() -> None:
    events = build_schedule({"schedule": "explicit", "warning_s": 30.0, "events": [
        {"kind": "node", "node": 1, "at_time_s": 10.0}, {"kind": "node", "node": 2, "at_time_s": 10.0}]},
        ClusterShape(nodes=4, workers_per_node=1))  # fmt: skip
    assert [e.warning_s for e in events] == [30.0, 30.0]


def test_the_schedule_warns_every_preemption_it_replays() -> None:
    events = build_schedule({"schedule": "trace", "trace": "p3", "trace_s_per_step": 120, "max_failures": 2,
                             "node_map": None, "warning_s": 30.0}, ClusterShape(nodes=8, workers_per_node=1))  # fmt: skip
    assert events and all(e.warning_s == 30.0 for e in events if e.kind == "node")
    own = build_schedule({"schedule": "explicit", "warning_s": 5.0, "events": [
        {"kind": "node", "node": 1, "at_step": 3, "warning_s": 2.0}, {"kind": "node", "node": 2, "at_step": 6}]}, SIX)
    assert [e.warning_s for e in own] == [2.0, 5.0], "an event's own warning stands"


def warned(job_overrides: list[str], policy: str, *extra: str) -> JobResult:
    return simulate_job(compose_config([
        *job_overrides, "mode=simulate", "cluster=local-6", f"policy={policy}", "train.steps=12",
        "protection=storage", "protection.every=100", "faults=explicit",
        "faults.events=[{kind: node, node: 3, at_step: 4, warning_s: 1.0}]", *extra,
    ]))  # fmt: skip


def heeded(result: JobResult) -> ev.WarningHeeded:
    (notice,) = [e for e in result.events if isinstance(e, ev.PreemptionWarned)]
    (heed,) = [e for e in result.events if isinstance(e, ev.WarningHeeded)]
    (kill,) = [e for e in result.events if isinstance(e, ev.FaultInjected)]
    assert notice.at < heed.at < kill.at and kill.at == pytest.approx(notice.at + 1.0), "killed when warned"
    return heed


def test_varuna_checkpoints_when_warned_and_restarts_from_it(job_overrides: list[str]) -> None:
    result = warned(job_overrides, "varuna")
    heed = heeded(result)
    assert heed.actions == ("SaveCheckpoint",)
    (restored,) = [e for e in result.events if isinstance(e, ev.StateRestored)]
    assert restored.step == heed.step, "the only checkpoint is the one taken when warned"


def test_varuna_gives_up_an_iteration_longer_than_the_grace_period_to_checkpoint_before_the_kill(
    job_overrides: list[str],
) -> None:
    # Iterations of several seconds against a 1 s grace period: the next iteration boundary comes after the kill, so
    # Varuna hears the warning at once, gives the iteration up, saves step 4 and runs it again until the kill.
    result = warned(job_overrides, "varuna", "train.global_batch=512")
    assert min(s.iter_s for s in result.steps) > 1.0, "the iteration outlasts the grace period"
    heed = heeded(result)
    assert heed.step_given_up and heed.step == 4 and heed.actions == ("SaveCheckpoint",)
    saved = next(e for e in result.events if isinstance(e, ev.StateSaved))
    (kill,) = [e for e in result.events if isinstance(e, ev.FaultInjected)]
    (restored,) = [e for e in result.events if isinstance(e, ev.StateRestored)]
    assert saved.step == restored.step == 4 and saved.at < kill.at, "the checkpoint beat the kill"
    assert result.faults[0].lost_steps == 0
    assert [s.step for s in result.steps] == list(range(12))


def test_a_policy_that_ignores_warnings_goes_on_until_the_kill(job_overrides: list[str]) -> None:
    result = warned(job_overrides, "elastic")
    heed = heeded(result)
    assert heed.actions == () and "does not act" in heed.reason
    assert result.faults[0].lost_steps == 0


def test_checkpoint_restart_warned_on_real_processes_stays_on_the_fault_free_trajectory(
    run, tmp_path: Path  # noqa: ANN001
) -> None:
    steps = 20
    job = ["experiment=plain", "policy=checkpoint_restart", "cluster=local-6", "train.stages=2", f"train.steps={steps}",
           "protection=storage", f"protection.every={steps}"]  # fmt: skip
    fault_free = run(*job, f"train.checkpoint_dir={tmp_path}/fault-free")
    result = run(*job, f"train.checkpoint_dir={tmp_path}/warned", "faults=explicit",
                 "faults.events=[{kind: node, node: 3, at_step: 3, warning_s: 1.0}]")  # fmt: skip
    assert_on_fault_free_trajectory(result, fault_free, steps)
    heed = next(e for e in result.events if isinstance(e, ev.WarningHeeded))
    (restored,) = [e for e in result.events if isinstance(e, ev.StateRestored)]
    assert heed.actions == ("SaveCheckpoint",) and restored.step == heed.step
    assert heed.step_given_up, "warned as step 3 began, it gave that iteration up to save at once"
