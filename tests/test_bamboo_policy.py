"""``policy=bamboo``'s decisions in the simulator (the same policy code the processes run) and what it refuses before
any worker: a single failure is taken over by the predecessor that keeps the failed stage's copy, in place; a stage
lost with the worker keeping its copy, or a first stage (no copy), restarts from the protection's checkpoint."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from ftlab.experiments.job import JobResult, check_job, compose_config
from ftlab.experiments.simulate import simulate_job
from ftlab.policies.bamboo import redundancy as rc
from ftlab.runtime.control.coordinator import JobStopped
from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.contract import ConfigError
from ftlab.runtime.core.program_check import check_programs
from tests.support import explicit, node

JOB = ["mode=simulate", "policy=bamboo", "cluster=local-6", "cluster.device_memory_gb=0.08", "train.stages=2",
       "train.steps=10", "protection=storage", "protection.every=3"]  # fmt: skip


def simulate(job_overrides: list[str], *faults: str, stages: int = 2) -> JobResult:
    return simulate_job(compose_config([*job_overrides, *JOB, f"train.stages={stages}", *explicit(*faults)]))


def test_the_copies_are_made_at_the_first_boundary_and_their_programs_check(job_overrides: list[str]) -> None:
    result = simulate(job_overrides)
    first, copied = result.plans[0], result.plans[1]
    assert rc.copies_of(first) is None and copied.step == 1
    pairs = sorted((k.holder, k.owner) for k in rc.copies_of(copied).values())
    assert pairs == [(0, 1), (1, 0), (2, 3), (3, 2), (4, 5), (5, 4)], "two-stage pipelines: a ring of two"
    programs = rc.programs(copied, rc.copies_of(copied).values())
    check_programs(copied, programs)
    redundant = [i for i in programs[0] if isinstance(i, ins.ForwardRedundant)]
    assert [i.microbatch for i in redundant] == list(first.pipelines[0].microbatches), "every micro-batch sent"
    assert ins.kept_copy(programs[0]) == range(4, 8) and ins.kept_copy(programs[1]) == range(0, 4)
    assert not any(isinstance(i, ins.ForwardRedundant) for i in programs[1]), "no input tokens on a last stage"


def test_a_single_failure_is_taken_over_in_place(job_overrides: list[str]) -> None:
    result = simulate(job_overrides, node(3, 5, "backward"))
    last = result.plans[-1]
    assert [p.workers for p in last.pipelines] == [(0, 1), (2,), (4, 5)]
    assert last.pipelines[1].spans == ((0, 8),)
    assert result.faults[0].lost_steps == 0 and [s.step for s in result.steps] == list(range(10))
    assert sorted(rc.copies_of(last)) == [0, 1, 4, 5], "the copies of the untouched pipelines are kept"


def test_two_adjacent_failures_restart_from_the_checkpoint(job_overrides: list[str]) -> None:
    result = simulate(job_overrides, node(3, 5, "backward"), node(2, 7, "forward"))
    assert result.faults[0].lost_steps == 0
    assert result.faults[1].lost_steps == 1, "restarted from the checkpoint of step 6"
    restarted = result.plans[-2]
    assert rc.copies_of(restarted) is None and [p.workers for p in restarted.pipelines] == [(0, 1), (4, 5)]
    assert rc.copies_of(result.plans[-1]) is not None, "the restart's plan gets its copies back"


def test_a_first_stage_is_taken_over_by_its_successor_in_a_two_stage_pipeline(job_overrides: list[str]) -> None:
    result = simulate(job_overrides, node(2, 5, "backward"))
    assert result.faults[0].lost_steps == 0
    assert [p.workers for p in result.plans[-1].pipelines] == [(0, 1), (3,), (4, 5)]


def test_a_first_stage_of_a_deeper_pipeline_has_no_copy_and_restarts(job_overrides: list[str]) -> None:
    result = simulate(job_overrides, node(3, 5, "backward"), stages=3)
    assert 3 not in rc.copies_of(result.plans[1]), "the first stage of (3, 4, 5) has no copy"
    assert result.faults[0].lost_steps == 2, "restarted from the checkpoint of step 3"


def test_a_stage_lost_with_its_copy_before_the_first_checkpoint_restarts_from_scratch(job_overrides: list[str]) -> None:
    # Nodes 2 and 3 hold a stage and the copy of it, and die together before step 3's checkpoint: as
    # checkpoint-restart does, Bamboo restarts from step 0 (fewer steps lost than the interval), not a stop.
    result = simulate(job_overrides, node(2, 2, "backward"), node(3, 2, "backward"))
    assert [(p.step, [q.workers for q in p.pipelines]) for p in result.plans][2] == (0, [(0, 1), (4, 5)])
    assert {f.lost_steps for f in result.faults} == {2} and [s.step for s in result.steps] == [0, 1, *range(10)]
    with pytest.raises(JobStopped, match="protection=none keeps no saved state"):
        unprotected = [o for o in JOB if not o.startswith("protection")]
        simulate_job(compose_config([*job_overrides, *unprotected, "protection=none",
                                     *explicit(node(2, 2, "backward"), node(3, 2, "backward"))]))  # fmt: skip


def refused(job_overrides: list[str], *overrides: str) -> str:
    cfg = OmegaConf.to_object(compose_config([*job_overrides, *JOB, *overrides]))
    with pytest.raises(ConfigError) as info:
        check_job(cfg)  # type: ignore[arg-type]
    return str(info.value)


def test_bamboo_on_one_node_is_refused(job_overrides: list[str]) -> None:
    assert "at least two nodes" in refused(job_overrides, "cluster.nodes=1")


def test_bamboo_where_a_stage_and_its_copy_do_not_fit_is_refused(job_overrides: list[str]) -> None:
    message = refused(job_overrides, "cluster.device_memory_gb=0.04")
    assert "twice the model state" in message and "raise cluster.device_memory_gb" in message


def test_bamboo_with_one_stage_or_activation_checkpointing_is_refused(job_overrides: list[str]) -> None:
    assert "set train.stages to 2 or more" in refused(job_overrides, "train.stages=1")
    assert "train.activation_checkpointing=false" in refused(job_overrides, "train.activation_checkpointing=true")


RECYCLE_6_7B = ["model=gpt3-6.7b", "cluster=azure-a100-4x8", "train.precision=bf16", "train.stages=8",
                "train.global_batch=64", "train.micro_batch=2", "train.activation_checkpointing=false"]  # fmt: skip
"""ReCycle's Table 1 job of GPT-3 6.7B: (PP, DP) = (8, 4) on 4 x 8 A100-80GB, no activation checkpointing."""


def test_gpt3_6_7b_with_unfused_attention_dropout_is_refused_for_bamboo_where_recycle_fits(
    job_overrides: list[str],
) -> None:
    """ReCycle's Bamboo OOM: a stage with its successor's copy does not fit where attention keeps its probabilities,
    mask and dropped probabilities; the same grid without copies does, and so does Bamboo with fused attention."""
    job = [*job_overrides, "mode=simulate", *RECYCLE_6_7B, "protection=storage"]

    def check(*overrides: str) -> None:
        check_job(OmegaConf.to_object(compose_config([*job, *overrides])))  # type: ignore[arg-type]

    with pytest.raises(ConfigError, match="twice the model state"):
        check("policy=bamboo", "model.attention=eager_dropout")
    check("policy=recycle", "model.attention=eager_dropout")
    check("policy=bamboo")
