"""``protection.every_s``: storage checkpoints by the machine's clock, the same on real processes and in the
simulator, and the same interval in seconds at any iteration speed; a setting of both intervals, or of neither, is
refused before any worker starts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from omegaconf import OmegaConf

from ftlab.experiments.job import JobResult, check_job, compose_config, everyone, run_job
from ftlab.experiments.simulate import simulate_job
from ftlab.runtime.control import events as ev
from ftlab.runtime.core.contract import ConfigError
from tests.support import analytic_profiles

STEPS = 10


@pytest.fixture(autouse=True)
def deterministic_machine() -> Iterator[None]:
    with analytic_profiles():
        yield


def predicted_step_s(overrides: list[str]) -> float:
    """The machine's time for a step of the job's first plan: the clock ``every_s`` counts on."""
    cfg = OmegaConf.to_object(compose_config(overrides))
    checked = check_job(cfg)  # type: ignore[arg-type]
    job = checked.make_job(everyone(cfg))  # type: ignore[arg-type]
    return job.machine().step_s(checked.decision.plan, checked.decision.programs)


def saved_steps(result: JobResult) -> list[int]:
    return [e.step for e in result.events if isinstance(e, ev.StateSaved)]


def job(job_overrides: list[str], *extra: str) -> list[str]:
    return [*job_overrides, "protection=storage", "protection.every=null", f"train.steps={STEPS}", *extra]


@pytest.mark.parametrize("mode", ["simulate", "run"])
def test_checkpoints_follow_the_machines_clock_on_both_backends(job_overrides: list[str], mode: str) -> None:
    step_s = predicted_step_s(job(job_overrides, "protection.every_s=1"))
    # 2.4 steps' time: the clock crosses a multiple after steps 3, 5, 8 and 10 (2.4, 4.8, 7.2, 9.6).
    run = simulate_job if mode == "simulate" else run_job
    result = run(compose_config(job(job_overrides, f"mode={mode}", f"protection.every_s={2.4 * step_s!r}")))
    assert saved_steps(result) == [3, 5, 8, 10]


def test_an_interval_in_seconds_spans_more_steps_on_a_faster_machine(job_overrides: list[str]) -> None:
    slow = job(job_overrides, "mode=simulate", "cluster=a40-30x1", "cluster.nodes=4", "cluster.backend=gloo", "model=gpt2-small")
    fast = [*slow, "model=gpt2-tiny"]
    fast_step_s = predicted_step_s([*fast, "protection.every_s=1"])
    assert predicted_step_s([*slow, "protection.every_s=1"]) > 3 * fast_step_s, "the small model iterates faster"
    every_s = 2.9 * fast_step_s  # the fast job's clock crosses a multiple after steps 3, 6 and 9
    saved = {name: saved_steps(simulate_job(compose_config([*o, f"protection.every_s={every_s!r}"])))
             for name, o in (("slow", slow), ("fast", fast))}  # fmt: skip
    assert saved["fast"] == [3, 6, 9]
    assert saved["slow"] == list(range(1, STEPS + 1)), "each slow step outlasts the interval"


@pytest.mark.parametrize(
    ("overrides", "advice"),
    [
        (["protection.every=4", "protection.every_s=30"], "add protection.every=null"),
        (["protection.every=null"], "protection.every_s=60"),
        (["protection.every=null", "protection.every_s=0"], "more than 0"),
    ],
)
def test_bad_intervals_are_refused_before_any_worker(job_overrides: list[str], overrides: list[str], advice: str) -> None:
    with pytest.raises(ConfigError, match=advice):
        check_job(OmegaConf.to_object(compose_config([*job_overrides, "protection=storage", *overrides])))  # type: ignore[arg-type]
