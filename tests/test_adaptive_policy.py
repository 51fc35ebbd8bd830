"""``policy=adaptive``'s decisions, without processes: which recovery it picks, that it picks it the same way every
time, and that the candidates plan from the plan actually running.

Jobs are composed through Hydra like real ones and costed on the analytic profile of an A100 with the measured
machinery constants (``conf/sim``), so every decision is a pure function of its inputs and takes milliseconds. The
runtime side (the same decisions carried out by real workers, against the fault-free trajectory) is
``tests/test_adaptive_recovery.py``.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from ftlab.experiments.config import JobConfig
from ftlab.experiments.job import compose_config, first_decision, job_factory
from ftlab.runtime.control.backend import Membership
from ftlab.runtime.core.contract import Change, ConfigError, Decision, Job, Keep, Stop
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.core.program_check import check_programs
from tests.support import BURSTY_FAULT_AT_STEP_2, ON_A100_40GB, REVIEW_MACHINERY, a100_profile, analytic_profiles


class Cluster:
    """A composed adaptive job and who is alive; each change answers from the plan it is given."""

    def __init__(self, *overrides: str) -> None:
        dict_cfg = compose_config(["experiment=plain", "policy=adaptive", "cluster=local-8", "train.stages=2",
                                   *ON_A100_40GB, "model=gpt2-small", "train.steps=1000", *overrides])  # fmt: skip
        self.cfg: JobConfig = OmegaConf.to_object(dict_cfg)
        self.make_job = job_factory(self.cfg, None)
        wpn = self.cfg.cluster.workers_per_node
        self.slots = {n: tuple(range(n * wpn, (n + 1) * wpn)) for n in range(self.cfg.cluster.nodes)}
        self.dead: set[int] = set()
        self.policy, self.protection, self.first = first_decision(self.cfg, self.make_job)
        self.generation = 0

    def job(self) -> Job:
        workers = {n: tuple(w for w in ws if w not in self.dead) for n, ws in self.slots.items()}
        return self.make_job(Membership({n: ws for n, ws in workers.items() if ws}, dict(self.slots)))

    def change(self, plan: Plan, step: int = 4, **kwargs: object) -> Decision | Keep | Stop:
        self.generation += 1
        holdings = {w: tuple(range(a, b)) for w, (a, b) in plan.layer_ranges().items() if w not in self.dead}
        change = Change(plan, step, self.generation, holdings=holdings, **kwargs)  # type: ignore[arg-type]
        return self.policy.on_change(change, self.job(), self.protection)

    def kill_workers(self, plan: Plan, *workers: int, step: int = 4) -> Decision | Keep | Stop:
        self.dead |= set(workers)
        return self.change(plan, step, failed_workers=workers)

    def review(self, plan: Plan, step: int) -> Decision | Keep:
        """The coordinator's review of ``plan`` after ``step`` committed steps (a switch uses up a generation)."""
        holdings = {w: tuple(range(a, b)) for w, (a, b) in plan.layer_ranges().items()}
        outcome = self.policy.review(Change(plan, step, self.generation + 1, holdings=holdings), self.job(),
                                     self.protection)  # fmt: skip
        if isinstance(outcome, Decision):
            self.generation += 1
        return outcome

    def kill_nodes(self, plan: Plan, *nodes: int) -> Decision | Keep | Stop:
        for node in nodes:
            self.dead |= set(self.slots.pop(node))
        return self.change(plan, failed_nodes=nodes)


def chosen(outcome: object) -> str:
    assert isinstance(outcome, Decision), outcome
    check_programs(outcome.plan, outcome.programs)
    assert outcome.predicted_pause_s is not None and outcome.predicted_iter_s is not None
    assert outcome.details["chosen"] in outcome.details["candidates"]
    return str(outcome.details["chosen"])


AMPLE = ("cluster.device_memory_gb=40",)
"""Devices large enough that the 4 x 2 grid is the fastest first plan: every stage has three peers to reroute to."""


def test_the_first_plan_is_the_fastest_candidates_and_every_candidate_is_costed() -> None:
    cluster = Cluster(*AMPLE)
    first = cluster.first
    assert first.predicted_iter_s is not None and first.details["chosen"] == "reroute"
    assert [p.workers for p in first.plan.pipelines] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert set(first.details["candidates"]) == {"reroute", "reconfigure"}
    assert "restart" in first.details["excluded"]  # protection=none keeps no state to restart from


def test_a_single_worker_with_ample_peers_is_rerouted() -> None:
    cluster = Cluster(*AMPLE)
    outcome = cluster.kill_workers(cluster.first.plan, 1)
    assert chosen(outcome) == "reroute"
    assert isinstance(outcome, Decision) and not outcome.restart and not outcome.transfers
    predictions = outcome.details["candidates"]
    assert predictions["reroute"]["cost_s"] < predictions["reconfigure"]["cost_s"]
    assert outcome.predicted_iter_s == pytest.approx(predictions["reroute"]["iter_s"], abs=1e-6)


def test_a_failure_that_would_overload_the_only_peer_reconfigures() -> None:
    # 2 GB devices: Oobleck's two 4-stage pipelines are the fastest first plan, so each stage has one peer, which
    # would run both pipelines' micro-batches; copying the lost stage's layers costs less over the steps ahead.
    cluster = Cluster()
    assert cluster.first.details["chosen"] == "reconfigure" and len(cluster.first.plan.pipelines) == 2
    outcome = cluster.kill_workers(cluster.first.plan, 1)
    assert chosen(outcome) == "reconfigure"
    assert isinstance(outcome, Decision) and outcome.transfers and not outcome.restart
    predictions = outcome.details["candidates"]
    assert predictions["reroute"]["iter_s"] > predictions["reconfigure"]["iter_s"]


def test_few_steps_until_the_next_change_favour_the_recovery_without_a_pause() -> None:
    cluster = Cluster("policy.mtbf_steps=1")  # a join (or the next failure) is expected in a step
    outcome = cluster.kill_workers(cluster.first.plan, 1)
    assert chosen(outcome) == "reroute"
    assert outcome.details["candidates"]["reroute"]["horizon_steps"] == 1  # type: ignore[union-attr]


def test_a_rate_in_seconds_weighs_every_candidate_over_the_same_steps() -> None:
    # A failure every 20 s, about 400 steps of the first plan: over them Oobleck's plan (a fifth faster an iteration
    # than overloading the only peer) repays its extra pause many times. Counted at each candidate's own iteration
    # time, the steps made every cost pause + 20 s, and the shorter pause, rerouting's, won.
    cluster = Cluster("faults=exponential", "faults.mtbf_steps=null", "faults.mtbf_s=20", "faults.seed=0")
    outcome = cluster.kill_workers(cluster.first.plan, 1)
    assert chosen(outcome) == "reconfigure"
    predictions = outcome.details["candidates"]
    (horizon,) = {p["horizon_steps"] for p in predictions.values()}  # type: ignore[union-attr]
    assert horizon == pytest.approx(20 / cluster.first.predicted_iter_s, rel=1e-3)
    assert predictions["reroute"]["pause_s"] < predictions["reconfigure"]["pause_s"]


def test_a_stage_without_any_replica_left_restarts_from_saved_state() -> None:
    cluster = Cluster(*AMPLE, "protection=storage")
    outcome = cluster.kill_workers(cluster.first.plan, 1, 3, 5, 7)
    chosen(outcome)
    assert isinstance(outcome, Decision) and outcome.restart
    predictions = outcome.details["candidates"]
    assert {p["outcome"] for p in predictions.values()} == {"restart"}  # rerouting and copying are impossible
    assert outcome.predicted_pause_s is not None and outcome.predicted_pause_s > cluster.cfg.sim.process_start_s


def test_the_same_failure_on_the_same_profile_is_decided_the_same_way() -> None:
    answers = []
    for _ in range(2):
        cluster = Cluster()
        outcome = cluster.kill_workers(cluster.first.plan, 1)
        assert isinstance(outcome, Decision)
        answers.append((outcome.plan, outcome.transfers, outcome.details["candidates"], outcome.predicted_pause_s))
    assert answers[0] == answers[1]


def test_candidates_plan_from_the_plan_adaptive_ran_not_their_own() -> None:
    cluster = Cluster(*AMPLE)
    rerouted = cluster.kill_workers(cluster.first.plan, 1)
    assert chosen(rerouted) == "reroute"
    # Oobleck's own pipelines of generation 1 were never run: it plans from the rerouted plan's holdings.
    outcome = cluster.kill_workers(rerouted.plan, 3)
    assert isinstance(outcome, Decision)
    holdings = {w: tuple(range(a, b)) for w, (a, b) in rerouted.plan.layer_ranges().items() if w not in {1, 3}}
    change = Change(rerouted.plan, 4, 99, failed_workers=(3,), holdings=holdings)
    reconfigure = cluster.policy.candidates["reconfigure"].on_change(  # type: ignore[attr-defined]
        change, cluster.job(), cluster.protection
    )
    assert isinstance(reconfigure, Decision) and "another policy's" in reconfigure.reason
    held = {w: range(a, b) for w, (a, b) in rerouted.plan.layer_ranges().items()}
    assert all(t.layer in held[t.source] for t in reconfigure.transfers), "copies come from actual holders"


def test_reroute_refuses_a_running_plan_that_is_not_a_grid_and_adaptive_decides_without_it() -> None:
    cluster = Cluster()
    heterogeneous = cluster.kill_workers(cluster.first.plan, 1)
    assert chosen(heterogeneous) == "reconfigure"
    assert isinstance(heterogeneous, Decision)
    assert len({tuple((s.start, s.stop) for s in p.stages) for p in heterogeneous.plan.pipelines}) > 1
    outcome = cluster.kill_workers(heterogeneous.plan, 6)
    assert chosen(outcome) == "reconfigure"
    assert isinstance(outcome, Decision) and "reroute" in outcome.details["refused"]


def test_a_join_is_decided_again() -> None:
    cluster = Cluster(*AMPLE, "policy.mtbf_steps=1000")  # long enough to repay taking the role back
    rerouted = cluster.kill_nodes(cluster.first.plan, 1)
    assert isinstance(rerouted, Decision)
    cluster.slots[1] = (1,)
    cluster.dead.discard(1)
    outcome = cluster.change(rerouted.plan, joined_nodes=(1,))
    assert chosen(outcome) == "reroute"  # the failed role taken back: the fault-free grid again
    assert isinstance(outcome, Decision) and "keep" in outcome.details["candidates"]
    assert [p.workers for p in outcome.plan.pipelines] == [(0, 1), (2, 3), (4, 5), (6, 7)]


TINY_ON_THIS_HOST = ("model=gpt2-tiny", "cluster=local-6", "cluster.device=cpu", "cluster.device_memory_gb=0.04",
                     "train.steps=8", "policy.review_every=2", *REVIEW_MACHINERY)  # fmt: skip
"""The job of ``tests/test_adaptive_recovery.py``'s review, on six nodes sharing this host's cores (with the
analytic profile): losing worker 1 (stage 1 of the first of three pipelines) slows the rerouted grid to 0.300 s an
iteration, and Oobleck's re-instantiation of the five whole nodes runs 0.263 s after a pause 0.031 s longer than
rerouting's: reconfiguring pays once the next change is more than about a step away (two, with the review's
margin). Not every worker would do: the peers of worker 2 or 4 (stage 0) absorb its micro-batches in 0.27 s an
iteration, and with the review's margin the reroute stays for all four steps the job has left."""
FAILED = 1
BURSTY = BURSTY_FAULT_AT_STEP_2
"""``BURSTY_FAULT_AT_STEP_2``'s one bursty failure: worker ``FAILED`` at the start of step 2."""


def test_a_review_keeps_the_plan_when_switching_does_not_pay() -> None:
    # Exponential gaps (a schedule without a rate: policy.mtbf_steps): the next change is always half a step away,
    # so the reroute chosen at the failure stays cheaper than a reconfiguration at every review.
    with analytic_profiles():
        cluster = Cluster(*TINY_ON_THIS_HOST, "policy.mtbf_steps=0.5")
        rerouted = cluster.kill_workers(cluster.first.plan, FAILED, step=2)
        assert chosen(rerouted) == "reroute" and isinstance(rerouted, Decision)
        for step in (4, 6):
            review = cluster.review(rerouted.plan, step)
            assert isinstance(review, Keep), review
            costs = review.details["candidates"]
            assert costs["keep"]["horizon_steps"] == costs["reconfigure"]["horizon_steps"] == 0.5
            assert costs["keep"]["cost_s"] < costs["reconfigure"]["cost_s"]


def test_a_review_reconfigures_once_quiet_steps_make_the_next_bursty_failure_distant() -> None:
    answers = []
    for _ in range(2):
        with analytic_profiles():
            cluster = Cluster(*TINY_ON_THIS_HOST, *BURSTY)
            rerouted = cluster.kill_workers(cluster.first.plan, FAILED, step=2)
            assert chosen(rerouted) == "reroute" and isinstance(rerouted, Decision)
            # Right after the failure the next is expected within a step: keep (the candidates' answers, costed
            # once for this plan, are asked again from step 4 when the review switches).
            early = cluster.review(rerouted.plan, 2)
            assert isinstance(early, Keep) and early.details["candidates"]["keep"]["horizon_steps"] < 1
            review = cluster.review(rerouted.plan, 4)
        assert chosen(review) == "reconfigure" and isinstance(review, Decision)
        assert review.plan.step == 4 and not review.restart and review.transfers
        costs = review.details["candidates"]
        assert costs["keep"]["horizon_steps"] == costs["reconfigure"]["horizon_steps"] == 4  # the job's steps left
        assert costs["keep"]["cost_s"] > 1.05 * costs["reconfigure"]["cost_s"]
        assert review.predicted_pause_s == pytest.approx(costs["reconfigure"]["pause_s"], abs=1e-6)
        answers.append((review.plan, review.transfers, costs))
        with analytic_profiles():
            kept = cluster.review(review.plan, 6)
        assert isinstance(kept, Keep) and "reroute" in kept.details["refused"], "no grid to reroute on"
    assert answers[0] == answers[1], "a review is deterministic"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("policy.candidates=[migrate]",), "unknown"),
        (("policy.mtbf_steps=0",), "mtbf_steps"),
        (("policy.review_every=-1",), "policy.review_every=-1"),
        (("policy.candidates=[restart]",), "restarts from saved state"),
        (("train.zero=1", "protection=storage"), "train.zero=1"),
    ],
)
def test_bad_settings_are_refused_before_any_worker_starts(overrides: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Cluster(*overrides)


def test_its_predictions_are_what_the_simulator_charges(
    job_overrides: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The simulator carries out the same decisions on the same cost model and constants, so it is the one place
    # where a prediction must come out exact: reroute, a reconfiguration with layer copies, a restart from storage.
    from ftlab.experiments import job as job_module
    from ftlab.experiments.simulate import simulate
    from ftlab.runtime.control import events as ev

    monkeypatch.setattr(job_module, "job_profile", a100_profile)
    kills = "[{kind: process, node: 1, worker: 0, at_step: 2}, {kind: node, node: 3, at_step: 4}, " \
            "{kind: node, node: 5, at_step: 6}, {kind: node, node: 4, at_step: 8}]"  # fmt: skip
    # A failure expected every step: the pauses decide, and the first failure is rerouted by a margin (3%) that
    # re-measured host constants do not undo; over the job's 8 steps left the two came within 0.1% of each other.
    overrides = [*job_overrides, "mode=simulate", "experiment=plain", "policy=adaptive", "cluster=local-6",
                 "cluster.device_memory_gb=0.04", "train.stages=2", "train.steps=10", "protection=storage",
                 "protection.every=2", "policy.mtbf_steps=1", "faults=explicit", f"faults.events={kills}"]  # fmt: skip
    result = simulate(OmegaConf.to_object(compose_config(overrides))).result
    decided = [e for e in result.events if isinstance(e, ev.Decided)]
    recovered = [e for e in result.events if isinstance(e, ev.Recovered)]
    assert len(decided) == len(recovered) == 4
    assert [e.outcome for e in decided] == ["replan", "reconfigure", "replan", "restart"]
    for decision, measured in zip(decided, recovered):
        assert decision.predicted_pause_s is not None and decision.predicted_iter_s is not None
        iters = [s.iter_s for s in result.steps if s.generation == decision.generation]
        assert decision.predicted_iter_s == pytest.approx(iters[-1], rel=1e-6)
        assert decision.predicted_pause_s + decision.predicted_iter_s == pytest.approx(measured.recover_s, rel=0.02)


def test_its_iterations_carry_the_snapshot_copies_the_simulator_charges(
    job_overrides: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under REFT, a snapshot after every step, whose copies take cores from the next iteration on this host: the
    # predicted iteration of the plan chosen is the one the simulator runs, copies and their launch included.
    from ftlab.experiments import job as job_module
    from ftlab.experiments.simulate import simulate
    from ftlab.runtime.control import events as ev

    monkeypatch.setattr(job_module, "job_profile", a100_profile)
    overrides = [*job_overrides, "mode=simulate", "experiment=plain", "policy=adaptive", "cluster=local-6",
                 "cluster.device_memory_gb=0.04", "train.stages=2", "train.steps=10", "sim.host_cores=1",
                 "faults=explicit", "faults.events=[{kind: process, node: 1, worker: 0, at_step: 3}]"]  # fmt: skip
    reft = [*overrides, "protection=reft", "protection.interval=1"]
    result = simulate(OmegaConf.to_object(compose_config(reft))).result
    (decided,) = [e for e in result.events if isinstance(e, ev.Decided)]
    iters = [s for s in result.steps if s.generation == decided.generation]
    assert iters[-1].snapshot_s is not None  # the last step overlapped the snapshot of the one before
    assert decided.predicted_iter_s == pytest.approx(iters[-1].iter_s, rel=1e-6)
    plain = simulate(OmegaConf.to_object(compose_config([*overrides, "protection=storage"]))).result
    (without,) = [e for e in plain.events if isinstance(e, ev.Decided)]
    assert decided.predicted_iter_s > without.predicted_iter_s  # the copies cost this host's cores


def test_the_simulator_reviews_as_the_runtime_does_and_charges_what_the_review_predicts(
    job_overrides: list[str],
) -> None:
    # The same coordinator asks the same review on simulated time: the switch at step 4, no step lost, and the
    # simulator charges exactly the predicted pause and iteration time (same cost model, same constants).
    from ftlab.experiments.simulate import simulate
    from ftlab.runtime.control import events as ev

    overrides = [*job_overrides, "mode=simulate", "experiment=plain", "policy=adaptive", "train.stages=2",
                 *TINY_ON_THIS_HOST, *BURSTY]  # fmt: skip
    with analytic_profiles():
        result = simulate(OmegaConf.to_object(compose_config(overrides))).result
    (decided,) = [e for e in result.events if isinstance(e, ev.Decided)]
    assert decided.details["chosen"] == "reroute" and decided.committed_step == 2
    reviews = [e for e in result.events if isinstance(e, ev.Reviewed)]
    assert [(e.step, e.outcome) for e in reviews] == [(2, "keep"), (4, "reconfigure"), (6, "keep")]
    switch = reviews[1]  # the first plan's review at step 2 keeps it: Oobleck's pipelines would be slower
    assert switch.details["chosen"] == "reconfigure" and switch.transfers > 0
    assert [s.step for s in result.steps] == list(range(8)), "no committed step lost"
    committed = {s.step: s for s in result.steps}
    assert committed[4].generation == switch.generation
    assert switch.predicted_iter_s == pytest.approx(committed[4].iter_s, rel=1e-6)
    (configured,) = [e for e in result.events if isinstance(e, ev.PlanConfigured) and e.generation == switch.generation]
    assert configured.at - switch.at == pytest.approx(switch.predicted_pause_s, rel=1e-6)
