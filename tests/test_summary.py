"""The run's summary figures (``experiments.job.summarise``): goodput defined once, whatever the faults did."""

from __future__ import annotations

import pytest

from ftlab.experiments.job import summarise
from ftlab.runtime.control import events as ev
from ftlab.runtime.reporting.fault_ledger import FaultLedger


def committed(step: int, at: float, generation: int, iter_s: float = 0.5) -> ev.StepCommitted:
    return ev.StepCommitted(at=at, step=step, loss=1.0, iter_s=iter_s, compute_s=iter_s, generation=generation,
                            samples=16, alive_nodes=4, pipelines=2)  # fmt: skip


def test_a_fault_free_run_reads_one() -> None:
    steps = [committed(i, 0.5 * (i + 1), generation=0) for i in range(6)]
    summary = summarise(steps, FaultLedger(ev.EventBus()), first_generation=0)
    assert summary["summary/goodput_ratio"] == pytest.approx(1.0)
    assert summary["summary/median_iter_s"] == 0.5


def test_a_first_plan_that_failed_before_committing_a_step_leaves_its_successor_as_the_reference() -> None:
    """A fault in step 0 (scenario 14 of soak seed 20261124): generation 0 never committed; generation 1, slower after
    the recovery, stands in as the fault-free rate instead of dividing by nothing."""
    steps = [committed(i, 10.0 + 0.8 * i, generation=1, iter_s=0.8) for i in range(6)]
    summary = summarise(steps, FaultLedger(ev.EventBus()), first_generation=0)
    assert summary["summary/fault_free_samples_per_s"] == pytest.approx(16 / 0.8)
    assert summary["summary/median_iter_s"] == 0.8 and summary["summary/steps"] == 6
