"""``policy=recycle``'s decisions, without processes: what it answers to failures, a lost stage and joins.

Jobs are composed through Hydra like real ones and plan from the analytic cost model of an A100, so every decision
is deterministic and takes milliseconds. The runtime side (the same decisions carried out by real workers, against
the fault-free trajectory) is ``tests/test_recycle_recovery.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from omegaconf import OmegaConf

from ftlab.experiments.config import JobConfig, build
from ftlab.experiments.job import compose_config, first_decision, job_factory
from ftlab.policies.recycle.planner import plan_recycle
from ftlab.policies.recycle.problem import StageCosts
from ftlab.runtime.core import instructions as ins
from ftlab.runtime.control.backend import Membership
from ftlab.runtime.core.contract import Change, ConfigError, Decision, Job, Keep, Policy, Protection, Stop
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.core.program_check import check_programs, simulate
from ftlab.runtime.core.scheduler import one_f_one_b


class Cluster:
    """A composed job, its policy and protection, and who is alive."""

    def __init__(self, *overrides: str) -> None:
        dict_cfg = compose_config(["experiment=plain", "policy=recycle", "cluster=local-8", "train.stages=2",
                                   "cluster.device=A100-40GB", *overrides])  # fmt: skip
        self.cfg: JobConfig = OmegaConf.to_object(dict_cfg)
        self.make_job = job_factory(self.cfg, None)
        wpn = self.cfg.cluster.workers_per_node
        self.slots = {n: tuple(range(n * wpn, (n + 1) * wpn)) for n in range(self.cfg.cluster.nodes)}
        self.dead: set[int] = set()
        self.policy: Policy
        self.protection: Protection
        self.policy, self.protection, self.first = first_decision(self.cfg, lambda m: self.make_job(m))
        self.generation = 0

    def job(self) -> Job:
        workers = {n: tuple(w for w in ws if w not in self.dead) for n, ws in self.slots.items()}
        return self.make_job(Membership({n: ws for n, ws in workers.items() if ws}, dict(self.slots)))

    def change(self, plan: Plan, **kwargs: object) -> Decision | Keep | Stop:
        self.generation += 1
        holdings = {w: tuple(range(a, b)) for w, (a, b) in plan.layer_ranges().items() if w not in self.dead}
        change = Change(plan, 4, self.generation, holdings=holdings, **kwargs)  # type: ignore[arg-type]
        return self.policy.on_change(change, self.job(), self.protection)

    def kill_node(self, plan: Plan, node: int) -> Decision | Keep | Stop:
        self.dead |= set(self.slots.pop(node))
        return self.change(plan, failed_nodes=(node,))

    def kill_worker(self, plan: Plan, worker: int) -> Decision | Keep | Stop:
        self.dead.add(worker)
        return self.change(plan, failed_workers=(worker,))

    def join(self, plan: Plan, node: int) -> Decision | Keep | Stop:
        wpn = self.cfg.cluster.workers_per_node
        self.slots[node] = tuple(range(node * wpn, (node + 1) * wpn))
        self.dead -= set(self.slots[node])
        return self.change(plan, joined_nodes=(node,))


def rerouted(outcome: object) -> Decision:
    assert isinstance(outcome, Decision), outcome
    check_programs(outcome.plan, outcome.programs)
    assert outcome.plan.generation > 0 and outcome.plan.step == 4
    return outcome


def decoupled(programs: Mapping[int, ins.Program]) -> int:
    return sum(isinstance(i, ins.BackwardWeight) for p in programs.values() for i in p)


def test_the_first_plan_is_the_grid_with_1f1b_programs() -> None:
    cluster = Cluster()
    plan = cluster.first.plan
    assert [p.workers for p in plan.pipelines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert cluster.first.programs == one_f_one_b(plan)
    assert cluster.first.details["predicted_iter_s"] > 0


def test_the_first_plan_takes_the_planners_schedule_where_it_beats_1f1b() -> None:
    """GPT-3 3.35B's 34 layers split unevenly over four stages (nine blocks on stage 1, eight or seven and the
    embedding or the head on the others), and the list scheduler fits them better than 1F1B: the fault-free plan is
    scheduled as its reroutes will be, with every backward still one pass."""
    cluster = Cluster("model=gpt3-3.35b", "cluster.device=A100-80GB", "cluster.device_memory_gb=80", "train.stages=4",
                      "train.global_batch=128", "train.micro_batch=2", "train.precision=bf16",
                      "train.activation_checkpointing=false")
    first, job = cluster.first, cluster.job()
    assert first.details["method"] == "heuristic"
    assert first.programs != one_f_one_b(first.plan)
    assert decoupled(first.programs) == 0
    check_programs(first.plan, first.programs)
    deepspeed_s = simulate(one_f_one_b(first.plan), job.costs.durations(first.plan), first.plan)
    assert first.details["predicted_iter_s"] < deepspeed_s


def test_the_fault_free_grid_is_planned_one_pipeline_per_length() -> None:
    """Without a reroute the pipelines share nothing before the gradient reduction, so the planner schedules one
    pipeline of each length and the others run its programs renamed: they check on the whole grid and are predicted
    as fast as the planner's schedule of the whole grid."""
    cluster = Cluster("model=gpt3-3.35b", "cluster.device=A100-80GB", "cluster.device_memory_gb=80", "train.stages=4",
                      "train.micro_batch=2", "train.precision=bf16", "train.activation_checkpointing=false",
                      "cluster.nodes=12", "train.global_batch=124")  # fmt: skip
    first, job = cluster.first, cluster.job()
    assert sorted(len(p.microbatches) for p in first.plan.pipelines) == [20, 21, 21]
    assert first.details["method"] == "heuristic"
    check_programs(first.plan, first.programs)
    whole = plan_recycle(first.plan, (), StageCosts.of_grid(job.costs, first.plan), memory_limit=8)
    whole_s = simulate(whole.programs, job.costs.durations(first.plan), first.plan)
    assert first.details["predicted_iter_s"] == pytest.approx(whole_s, rel=1e-9)


@pytest.mark.parametrize("memory_gb", [30, 34, 40])
def test_the_micro_batches_a_stage_may_hold_leave_room_for_autocasts_weight_copy(memory_gb: int) -> None:
    """With no policy.memory_limit, a stage may hold as many micro-batches in flight as fit beside everything it holds
    with none (its state and, in bf16, autocast's copy of its weights): the most that fit, never one more."""
    cluster = Cluster("model=gpt3-3.35b", f"cluster.device_memory_gb={memory_gb}", "train.stages=4",
                      "train.global_batch=128", "train.micro_batch=2", "train.precision=bf16",
                      "train.activation_checkpointing=false")  # fmt: skip
    plan, job = cluster.first.plan, cluster.job()
    limit = cluster.policy._memory_limit(plan, job)  # type: ignore[attr-defined]
    stages = [(s.start, s.stop) for s in plan.pipelines[0].stages]
    assert 1 < limit < 2 * len(stages)  # bound by memory, not by the cap
    assert all(job.costs.stage_memory(a, b, limit) <= job.device_memory_bytes for a, b in stages)
    assert any(job.costs.stage_memory(a, b, limit + 1) > job.device_memory_bytes for a, b in stages)


def test_only_the_peers_that_absorb_rerouted_work_decouple_their_backward() -> None:
    """As the paper: decoupling where a reroute needs it, every other worker's backward one pass as in 1F1B, so the
    rerouted plan is no faster than the fault-free grid."""
    cluster = Cluster()
    decision = rerouted(cluster.kill_node(cluster.first.plan, 1))
    decoupling = {w for w, program in decision.programs.items() if decoupled({w: program})}
    assert decoupling and decoupling <= set(decision.details["rerouted"])
    assert decision.details["predicted_iter_s"] >= decision.details["fault_free_iter_s"]


def test_one_failure_reroutes_to_peers_without_restart_or_copy() -> None:
    cluster = Cluster()
    decision = rerouted(cluster.kill_node(cluster.first.plan, 1))
    assert decision.kind == "replan" and not decision.transfers and not decision.restart
    plan = decision.plan
    assert 1 not in plan.workers and set(plan.workers) == {0, 2, 3, 4, 5, 6, 7}
    # Worker 0 keeps its micro-batches; at stage 1 they go to the peers 3, 5 and 7.
    assert {p.stages[1].worker for p in plan.pipelines if p.stages[0].worker == 0} <= {3, 5, 7}
    assert decision.details["failed"] == [1] and sum(decision.details["rerouted"].values()) == 2
    # Two micro-batches per pipeline: the peers absorb the extra work in their bubbles.
    assert decision.details["predicted_iter_s"] >= decision.details["fault_free_iter_s"]
    assert "rerouted to peers" in decision.reason and "node 1 failed" in decision.reason
    # The runs of tests/test_recycle_recovery.py execute these programs: their decoupled backward is under the oracle.
    assert decoupled(decision.programs) == decision.details["decoupled"] > 0


def test_the_schedule_of_a_failure_pattern_is_cached() -> None:
    cluster = Cluster()
    first = rerouted(cluster.kill_node(cluster.first.plan, 1))
    # The same pattern again (as after a failure that interrupted the reconfiguration): no planning.
    cluster.generation += 1
    again = rerouted(cluster.change(cluster.first.plan, failed_nodes=(1,)))
    assert not first.details["cached"] and again.details["cached"]
    assert again.programs == first.programs and again.plan.generation == first.plan.generation + 2


def test_failures_accumulate_across_stages() -> None:
    cluster = Cluster()
    one = rerouted(cluster.kill_worker(cluster.first.plan, 1))
    two = rerouted(cluster.kill_node(one.plan, 2))
    assert two.details["failed"] == [1, 2] and not two.transfers
    assert not ({1, 2} & set(two.plan.workers))


def test_a_node_of_two_workers_loses_a_whole_pipeline() -> None:
    cluster = Cluster("cluster=local-4x2")
    decision = rerouted(cluster.kill_node(cluster.first.plan, 1))  # workers 2 and 3: pipeline 1
    assert decision.details["failed"] == [2, 3] and not decision.transfers and decoupled(decision.programs) > 0


def test_crowded_failures_are_normalized_by_moving_a_survivor() -> None:
    # Stage 1 of a 2 x 4 grid with 8 micro-batches per pipeline loses three workers of four; spread over both
    # stages the rerouted work costs less (Algorithm 1), so a stage-0 survivor moves to stage 1.
    def kill_stage_1(cluster: Cluster) -> list[Decision]:
        plan, decisions = cluster.first.plan, []
        for node in (1, 3, 5):
            decisions.append(rerouted(cluster.kill_node(plan, node)))
            plan = decisions[-1].plan
        return decisions

    normalized = kill_stage_1(Cluster("train.global_batch=64"))
    transfers = [t for d in normalized for t in d.transfers]
    assert transfers and {t.layer for t in transfers} == {4, 5, 6, 7}, "the mover receives stage 1's layers"
    (mover,) = {t.destination for t in transfers}
    assert normalized[-1].plan.layer_ranges()[mover] == (4, 8)
    assert all(t.source in (5, 7) for t in transfers), "copied from stage-1 survivors"
    plain = kill_stage_1(Cluster("train.global_batch=64", "policy.normalize=false"))
    assert not any(d.transfers for d in plain)
    assert normalized[-1].details["makespan"] < plain[-1].details["makespan"]


def test_a_lost_stage_stops_without_saved_state() -> None:
    cluster = Cluster("cluster=local-4")
    one = rerouted(cluster.kill_node(cluster.first.plan, 1))
    stop = cluster.kill_node(one.plan, 3)
    assert isinstance(stop, Stop)
    assert "every worker of stage 1 (layers 4..7) failed" in stop.reason and "protection=storage" in stop.reason


def test_a_lost_stage_restarts_from_the_protection() -> None:
    cluster = Cluster("cluster=local-4", "protection=storage")
    one = rerouted(cluster.kill_node(cluster.first.plan, 1))
    restart = cluster.kill_node(one.plan, 3)
    assert isinstance(restart, Decision) and restart.restart and restart.restore is None  # nothing saved yet
    assert [p.workers for p in restart.plan.pipelines] == [(0, 2)]
    assert "restart 2 workers from scratch" in restart.reason and "stage 1" in restart.reason


def test_a_join_takes_back_a_failed_role_and_returns_to_the_fault_free_schedule() -> None:
    cluster = Cluster()
    failed = rerouted(cluster.kill_node(cluster.first.plan, 1))
    joined = rerouted(cluster.join(failed.plan, 8))
    assert [p.workers for p in joined.plan.pipelines] == [(0, 8), (2, 3), (4, 5), (6, 7)]
    assert joined.programs == one_f_one_b(joined.plan)
    assert {t.destination for t in joined.transfers} == {8}
    assert sorted(t.layer for t in joined.transfers) == [4, 5, 6, 7]
    assert {t.source for t in joined.transfers} <= {3, 5, 7}
    assert isinstance(cluster.join(joined.plan, 9), Keep), "no failed role left to take"


def test_a_node_back_under_its_old_id_takes_its_own_role_back() -> None:
    cluster = Cluster()
    failed = rerouted(cluster.kill_node(cluster.first.plan, 1))
    back = rerouted(cluster.join(failed.plan, 1))
    assert [p.workers for p in back.plan.pipelines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert {t.destination for t in back.transfers} == {1} and len(back.transfers) == 4


def test_a_join_with_failures_left_still_reroutes_around_them() -> None:
    cluster = Cluster()
    one = rerouted(cluster.kill_node(cluster.first.plan, 1))
    two = rerouted(cluster.kill_node(one.plan, 2))
    back = rerouted(cluster.join(two.plan, 8))
    assert 8 in back.plan.workers and back.details["failed"] == [2]
    assert back.plan.layer_ranges()[8] == (0, 4) or back.plan.layer_ranges()[8] == (4, 8)


def test_staggered_optimizer_programs_step_early() -> None:
    cluster = Cluster("policy.staggered_optimizer=true")
    assert all(p[-1] == ins.OptimizerStep(early=True) for p in cluster.first.programs.values())
    decision = rerouted(cluster.kill_node(cluster.first.plan, 1))
    assert all(p[-1] == ins.OptimizerStep(early=True) for p in decision.programs.values())


def test_the_milp_solver_plans_too() -> None:
    cluster = Cluster("cluster=local-4", "policy.solver=milp", "policy.milp_time_limit_s=5")
    decision = rerouted(cluster.kill_node(cluster.first.plan, 1))
    assert decision.details["method"] in ("milp", "heuristic")  # the list schedule may already be optimal
    assert decision.details["makespan"] >= decision.details["lower_bound"] - 1e-12


@pytest.mark.parametrize(("override", "message"), [("policy.solver=cplex", "policy.solver='cplex'"),
                                                    ("policy.milp_time_limit_s=0", "positive time limit")])
def test_bad_settings_are_refused_before_any_worker(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Cluster(override)


def test_the_settings_are_a_policy_of_their_own() -> None:
    cfg: JobConfig = OmegaConf.to_object(compose_config(["experiment=plain", "policy=recycle"]))
    policy = build(cfg.policy)
    assert policy.name == "recycle" and cfg.policy.solver == "list" and not cfg.policy.staggered_optimizer
