"""ReCycle's planner: failure normalization, rerouting, and the programs of the MILP and the list scheduler."""

from __future__ import annotations

import itertools
import math

import pytest

from ftlab.policies.recycle import (
    NormalizationError,
    ReCycleError,
    StageCosts,
    heuristic,
    milp,
    normalize_failures,
    plan_recycle,
)
from ftlab.policies.recycle.normalization import cost, rebalance
from ftlab.policies.recycle.problem import Problem, jackson_preemptive
from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.plan import Plan, grid_plan
from ftlab.runtime.core.program_check import check_programs

UNIT = StageCosts(forward=1.0, backward_input=1.0, backward_weight=1.0, p2p=0.1)
SKEWED = StageCosts(forward=1.0, backward_input=1.5, backward_weight=0.5, p2p=0.2)


def grid(stages: int, replicas: int, per_pipeline: int) -> Plan:
    return grid_plan(list(range(stages * replicas)), stages, 2 * stages, per_pipeline * replicas, 1)


def failure_sets(plan: Plan, most: int) -> list[tuple[int, ...]]:
    """Every set of up to ``most`` failed workers that leaves each stage a survivor."""
    stage_of = {st.worker: s for _, s, st in plan.stages()}
    replicas = len(plan.pipelines)
    return [
        failed
        for k in range(most + 1)
        for failed in itertools.combinations(plan.workers, k)
        if all(sum(stage_of[w] == s for w in failed) < replicas for s in set(stage_of.values()))
    ]


def peak_activations(program: ins.Program) -> int:
    """The most micro-batches whose activations the worker holds at once (forward until weight gradient)."""
    held = peak = 0
    for instr in program:
        held += isinstance(instr, ins.ForwardPass) - isinstance(instr, (ins.BackwardWeight, ins.BackwardPass))
        peak = max(peak, held)
    return peak


# -- failure normalization ---------------------------------------------------------------------------------------


def test_cost_is_the_work_the_bubbles_cannot_hold() -> None:
    assert cost(0, dp=4, pp=8, mb=16) == 0
    assert cost(1, dp=4, pp=8, mb=4) == 0  # 12 slots of rerouted work fit in 3 x 7 x 3 bubble slots
    assert cost(1, dp=4, pp=8, mb=32) == 32 * 3 - 3 * 7 * 3
    assert cost(4, dp=4, pp=8, mb=1) == math.inf  # no survivor left in the stage


def brute_force(dp: int, pp: int, mb: int, actual: tuple[int, ...]) -> tuple[float, int]:
    best = (math.inf, 0)
    for spread in itertools.product(range(dp), repeat=pp):
        if sum(spread) == sum(actual):
            overhead = sum(cost(x, dp, pp, mb) for x in spread)
            moves = sum(max(0, a - x) for a, x in zip(actual, spread))
            best = min(best, (overhead, moves))
    return best


@pytest.mark.parametrize(("dp", "pp", "mb"), [(2, 2, 1), (2, 3, 4), (3, 2, 2), (3, 3, 1), (3, 3, 6), (4, 2, 3)])
def test_normalization_matches_brute_force(dp: int, pp: int, mb: int) -> None:
    for actual in itertools.product(range(dp + 1), repeat=pp):
        if sum(actual) > pp * (dp - 1):
            continue
        result = normalize_failures(dp, pp, mb, actual)
        assert (result.overhead, result.moves) == brute_force(dp, pp, mb, actual), actual
        assert sum(result.per_stage) == sum(actual) and max(result.per_stage) < dp
        assert result.overhead == sum(cost(x, dp, pp, mb) for x in result.per_stage)


def test_normalization_spreads_concentrated_failures_and_keeps_spread_ones() -> None:
    # Two failures in stage 0 of a 4 x 3 grid overflow the last peer's bubbles; one per stage costs far less.
    result = normalize_failures(dp=3, pp=4, mb=8, actual=[2, 0, 0, 0])
    assert max(result.per_stage) == 1 and result.moves == 1
    assert result.overhead < cost(2, 3, 4, 8)
    assert normalize_failures(dp=3, pp=4, mb=8, actual=[1, 0, 1, 0]).per_stage == (1, 0, 1, 0)


def test_normalization_refuses_more_failures_than_the_stages_can_absorb() -> None:
    with pytest.raises(NormalizationError, match="at most 4 failures can be absorbed"):
        normalize_failures(dp=3, pp=2, mb=4, actual=[2, 3])


def test_rebalance_moves_a_survivor_and_copies_its_new_layers() -> None:
    healthy = grid(stages=4, replicas=3, per_pipeline=8)  # pipelines 0-3, 4-7, 8-11
    failed = (0, 4)  # stage 0 of pipelines 0 and 1: worker 8 would carry all of stage 0
    target = normalize_failures(3, 4, 8, [2, 0, 0, 0]).per_stage
    moved, transfers = rebalance(healthy, failed, target)
    stage_of = {st.worker: s for _, s, st in moved.stages()}
    assert sorted(sum(stage_of[w] == s for w in failed) for s in range(4)) == [0, 0, 1, 1]
    mover = transfers[0].destination
    assert stage_of[mover] == 0 and {t.layer for t in transfers} == {0, 1}
    assert {t.source for t in transfers} == {8}  # the one stage-0 worker that survived
    result = plan_recycle(healthy, failed, UNIT, normalize=True, method="heuristic")
    check_programs(result.plan, result.programs)
    assert result.transfers == transfers
    assert result.makespan < plan_recycle(healthy, failed, UNIT, method="heuristic").makespan


def test_rebalance_cannot_restore_a_stage_without_survivors() -> None:
    with pytest.raises(NormalizationError, match="every worker of stage 0"):
        plan_recycle(grid(2, 2, 2), (0, 2), UNIT, normalize=True)


# -- rerouting ---------------------------------------------------------------------------------------------------


def test_rerouted_plan_names_peers_in_the_failed_pipeline() -> None:
    healthy = grid(stages=2, replicas=3, per_pipeline=4)  # pipelines (0, 1), (2, 3), (4, 5)
    result = plan_recycle(healthy, [1], UNIT, method="heuristic")
    assert 1 not in result.plan.workers and 1 not in result.programs
    served = {p.stages[1].worker: p.microbatches for p in result.plan.pipelines if p.stages[0].worker == 0}
    # Pipeline 0's four micro-batches at stage 1 are split evenly between the two peers.
    assert sorted(served) == [3, 5] and sorted(map(len, served.values())) == [2, 2]
    assert sorted(mb for mbs in served.values() for mb in mbs) == list(healthy.pipelines[0].microbatches)
    # A peer appears in its own pipeline and in the rerouted one, holding the same layers in both.
    stages_of_3 = {(st.start, st.stop) for _, _, st in result.plan.stages() if st.worker == 3}
    assert len([p for p in result.plan.pipelines if 3 in p.workers]) == 2 and len(stages_of_3) == 1


def test_a_stage_without_survivors_is_a_clear_error() -> None:
    with pytest.raises(ReCycleError, match=r"every worker of stage 1 \(layers 2..3\) failed"):
        plan_recycle(grid(2, 2, 2), (1, 3), UNIT)


def test_unknown_failed_worker_is_an_error() -> None:
    with pytest.raises(ReCycleError, match=r"failed workers \[9\] are not in the plan"):
        plan_recycle(grid(2, 2, 2), (9,), UNIT)


# -- schedules and programs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("stages", "replicas"), list(itertools.product([2, 3, 4], [2, 3])))
def test_heuristic_programs_are_correct_for_every_failure_set(stages: int, replicas: int) -> None:
    healthy = grid(stages, replicas, per_pipeline=3)
    for failed in failure_sets(healthy, 2):
        result = plan_recycle(healthy, failed, UNIT, method="heuristic")
        check_programs(result.plan, result.programs)
        assert set(result.programs) == set(healthy.workers) - set(failed)
        # The abstract machine reproduces the list scheduler's own timing exactly.
        problem = Problem.build(healthy, failed, UNIT)
        assert result.makespan == pytest.approx(heuristic.makespan(problem, heuristic.list_schedule(problem)))


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_memory_limit_bounds_held_activations(limit: int) -> None:
    healthy = grid(stages=3, replicas=2, per_pipeline=2)  # worker 4 serves 4 micro-batches
    peaks = {}
    for method in ("heuristic", "milp"):
        result = plan_recycle(healthy, [1], UNIT, memory_limit=limit, method=method, time_limit_s=10)
        check_programs(result.plan, result.programs)
        assert result.method == method  # the list schedule misses the bound here, so the MILP does run
        peaks[method] = max(map(peak_activations, result.programs.values()))
    assert peaks["milp"] <= limit
    assert peaks["heuristic"] == limit  # forwards go first whenever memory allows, so the limit binds


@pytest.mark.parametrize(
    ("stages", "replicas", "costs", "failed"),
    [(2, 2, SKEWED, ()), (2, 2, SKEWED, (0, 3)), (2, 3, UNIT, (1, 2)), (3, 2, SKEWED, (1,)), (3, 2, UNIT, (1, 3)),
     (3, 3, UNIT, (1,)), (3, 3, UNIT, (0, 4)), (3, 3, UNIT, (1, 3)), (4, 2, SKEWED, (2, 5)), (4, 3, UNIT, (1, 6))],
)
def test_milp_programs_are_correct_and_no_slower_than_the_heuristic(
    stages: int, replicas: int, costs: StageCosts, failed: tuple[int, ...]
) -> None:
    # Instances where the list schedule missed the first, weaker lower bound; the MILP runs where it still misses
    # the bound, and proves optimality.
    healthy = grid(stages, replicas, per_pipeline=2)
    fast = plan_recycle(healthy, failed, costs, method="heuristic")
    exact = plan_recycle(healthy, failed, costs, method="milp", time_limit_s=10)
    check_programs(exact.plan, exact.programs)
    assert exact.optimal and exact.method == ("heuristic" if fast.optimal else "milp")
    assert exact.makespan <= fast.makespan + 1e-9
    assert fast.lower_bound <= exact.makespan + 1e-6


def test_heuristic_meeting_the_lower_bound_skips_the_milp() -> None:
    result = plan_recycle(grid(stages=2, replicas=2, per_pipeline=2), (1,), UNIT, method="milp")
    assert result.method == "heuristic" and result.optimal
    assert result.makespan == pytest.approx(result.lower_bound)


def test_milp_beats_the_heuristic_where_greedy_goes_wrong() -> None:
    # Worked out once: the list scheduler needs 13.2, the optimum is 11.2 (PP 2 x DP 3, pipeline 0 loses stage 0 and
    # pipeline 1 stage 1; only the rerouted micro-batches' backward is decoupled).
    healthy = grid(stages=2, replicas=3, per_pipeline=2)
    assert plan_recycle(healthy, (0, 3), UNIT, method="heuristic").makespan == pytest.approx(13.2)
    optimum = plan_recycle(healthy, (0, 3), UNIT, method="milp", time_limit_s=10)
    assert optimum.optimal and optimum.makespan == pytest.approx(11.2)


def test_decoupled_backward_fills_bubbles() -> None:
    result = plan_recycle(grid(stages=2, replicas=2, per_pipeline=2), (1,), UNIT, method="milp", time_limit_s=10)
    # Some weight gradient is deferred past other work: the input gradient left first, the weight waited.
    deferred = [
        (w, instr.microbatch)
        for w, program in result.programs.items()
        for k, instr in enumerate(program)
        if isinstance(instr, ins.BackwardWeight) and not isinstance(program[k - 1], ins.SendGrad)
    ]
    assert deferred


def test_auto_uses_the_heuristic_when_the_milp_is_too_big() -> None:
    healthy = grid(stages=2, replicas=3, per_pipeline=2)
    big = plan_recycle(healthy, (0, 3), UNIT, max_binaries=10)
    assert big.method == "heuristic" and not big.optimal
    small = plan_recycle(healthy, (0, 3), UNIT, max_binaries=big.binaries, time_limit_s=10)
    assert small.method == "milp" and small.makespan < big.makespan


def test_the_binaries_are_counted_as_the_milp_lists_them() -> None:
    """The planner counts the MILP's ordering binaries without listing them (on a large grid listing takes longer
    than planning): the count is the list's length, with and without failures."""
    for stages, replicas, per_pipeline in ((2, 2, 2), (3, 2, 4), (4, 3, 5)):
        healthy = grid(stages, replicas, per_pipeline)
        for failed in failure_sets(healthy, 2):
            problem = Problem.build(healthy, failed, UNIT)
            assert problem.unordered_pairs() == len(milp.ordering_pairs(problem)) > 0


def test_per_stage_costs() -> None:
    slow_last = [UNIT, StageCosts(forward=2.0, backward_input=2.0, backward_weight=2.0, p2p=0.1)]
    healthy = grid(stages=2, replicas=2, per_pipeline=2)
    even = plan_recycle(healthy, (), UNIT, method="heuristic")
    uneven = plan_recycle(healthy, (), slow_last, method="heuristic")
    assert uneven.makespan > even.makespan
    with pytest.raises(ReCycleError, match="costs are given for 3 stages"):
        plan_recycle(healthy, (), [UNIT] * 3)


def test_jackson_preemptive_schedule() -> None:
    # Two jobs at 0 (durations 2 and 1, tails 0 and 5), one at 1 (duration 2, tail 3): run the long tails first.
    assert jackson_preemptive([(0, 2, 0), (0, 1, 5), (1, 2, 3)]) == pytest.approx(6)
    assert jackson_preemptive([(3, 1, 0)]) == pytest.approx(4)


@pytest.mark.parametrize(
    ("stages", "replicas", "per_pipeline", "failed", "memory"),
    [(2, 2, 3, (1,), 100), (3, 2, 2, (1,), None), (2, 3, 2, (0, 5), None), (3, 2, 2, (0, 1), None)],
)
def test_symmetry_breaking_and_bounds_lose_no_schedule(
    monkeypatch: pytest.MonkeyPatch, stages: int, replicas: int, per_pipeline: int, failed: tuple[int, ...],
    memory: int | None,
) -> None:  # fmt: skip
    healthy = grid(stages, replicas, per_pipeline)
    broken = plan_recycle(healthy, failed, SKEWED, method="milp", time_limit_s=20, memory_limit=memory)
    # The same instances with interchangeable micro-batches left free: the optimum must not be any better.
    monkeypatch.setattr(Problem, "symmetry_predecessors", lambda self, op: [])
    monkeypatch.setattr(Problem, "symmetric", lambda self, order: {w: list(ops) for w, ops in order.items()})
    free = plan_recycle(healthy, failed, SKEWED, method="milp", time_limit_s=20, memory_limit=memory)
    # (Left free, HiGHS may not prove optimality in the time it has: then no schedule it found may beat the bound.)
    assert broken.optimal
    assert broken.makespan <= free.makespan * (1 + 1e-6) and broken.lower_bound <= free.makespan * (1 + 1e-6)
    if free.optimal:
        assert broken.makespan == pytest.approx(free.makespan, rel=1e-6)
