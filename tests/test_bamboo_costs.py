"""What Bamboo's redundancy costs on a GPU cluster: the time a holder waits for its copy's reduced gradients and the
copy's optimizer step (``runtime.sim.timing``), and the memory of a stage with its copy (``redundancy.memory_with_copy``,
the one formula of the preflight and of a takeover)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from ftlab.experiments.job import compose_config, everyone, job_factory
from ftlab.policies.bamboo import redundancy as rc
from ftlab.policies.bamboo.policy import Bamboo
from ftlab.policies.grid import grid
from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.contract import Job
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.sim.timing import IterationTimer

GPU_JOB = ["mode=simulate", "policy=bamboo", "model=gpt3-medium", "cluster=azure-a100-4x8", "cluster.nodes=1",
           "train.activation_checkpointing=false", "train.global_batch=16", "train.micro_batch=2"]  # fmt: skip


def bamboo_job(job_overrides: list[str], *overrides: str) -> tuple[Job, Plan, dict[int, ins.Program]]:
    """A GPU job of ``overrides``, its grid with every copy that fits, and the programs that keep them."""
    cfg = OmegaConf.to_object(compose_config([*job_overrides, *GPU_JOB, *overrides]))
    job = job_factory(cfg, None)(everyone(cfg))  # type: ignore[arg-type]
    plan = grid(job.workers, job, generation=0, step=0)
    copies = rc.fitting_copies(plan, job)
    kept = rc.with_copies(plan, copies, 0, 0)
    return job, kept, rc.programs(kept, copies)


def test_a_holder_is_ready_once_its_copy_gradients_arrive_and_steps_its_copy(job_overrides: list[str]) -> None:
    job, plan, programs = bamboo_job(job_overrides, "train.stages=4", "train.precision=bf16")
    timing = IterationTimer(job.costs).time(plan, programs)
    duration = job.costs.durations(plan)
    ranges = plan.layer_ranges()
    last = plan.pipelines[0].stages[-1].worker  # keeps no copy (a deeper pipeline's ring does not wrap around)
    send = next(i for i in programs[last] if isinstance(i, ins.SendReduced))
    arrives = timing.reduce_end[last] + duration(last, send)
    assert duration(last, send) > 0
    assert timing.reduce_end[send.peer] >= arrives and timing.ready_s >= arrives
    stepped = job.costs.optimizer_s(*ranges[send.peer]) + job.costs.optimizer_s(send.start, send.stop)
    assert timing.optimizer_s >= stepped > max(job.costs.optimizer_s(*held) for held in ranges.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_stage_with_its_copy_holds_the_copys_state_and_its_autocast_cast(job_overrides: list[str], precision: str) -> None:
    job, plan, _ = bamboo_job(job_overrides, "train.stages=2", f"train.precision={precision}")
    costs, ranges = job.costs, plan.layer_ranges()
    copy, in_flight = rc.ring_copies(plan)[0]
    cast = 0.5 * costs.param_bytes(copy.start, copy.stop) if precision == "bf16" else 0.0
    own = costs.stage_memory(*ranges[copy.holder], in_flight)
    expected = own + costs.state_bytes(copy.start, copy.stop) + cast
    assert rc.memory_with_copy(job, ranges[copy.holder], in_flight, copy) == pytest.approx(expected)
    assert rc.memory_with_copy(job, ranges[copy.holder], in_flight, None) == own


def test_a_takeover_fits_by_the_preflight_formula(job_overrides: list[str]) -> None:
    job, plan, _ = bamboo_job(job_overrides, "train.stages=2", "train.precision=bf16")
    ranges = plan.layer_ranges()
    need = max(rc.memory_with_copy(job, ranges[k.holder], n, k) for k, n in rc.ring_copies(plan))
    assert Bamboo._fits(plan, job)
    tight = OmegaConf.to_object(compose_config([*job_overrides, *GPU_JOB, "train.stages=2", "train.precision=bf16",
                                                f"cluster.device_memory_gb={need / 2**30 * 0.999}"]))  # fmt: skip
    assert not Bamboo._fits(plan, job_factory(tight, None)(everyone(tight)))  # type: ignore[arg-type]
