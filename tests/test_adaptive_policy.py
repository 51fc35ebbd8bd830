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
from ftlab.runtime.backend import Membership
from ftlab.runtime.contract import Change, ConfigError, Decision, Job, Keep, MemorySource, Stop
from ftlab.runtime.plan import Plan
from ftlab.runtime.program_check import check_programs


class Cluster:
    """A composed adaptive job and who is alive; each change answers from the plan it is given."""

    def __init__(self, *overrides: str) -> None:
        dict_cfg = compose_config(["experiment=plain", "policy=adaptive", "cluster=local-8", "train.stages=2",
                                   "cluster.device=A100-40GB", "model=gpt2-small", "train.steps=1000", *overrides])  # fmt: skip
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

    def kill_workers(self, plan: Plan, *workers: int) -> Decision | Keep | Stop:
        self.dead |= set(workers)
        return self.change(plan, failed_workers=workers)

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


def test_the_first_plan_is_the_fastest_candidates_and_every_candidate_is_costed() -> None:
    cluster = Cluster()
    first = cluster.first
    assert first.predicted_iter_s is not None
    assert set(first.details["candidates"]) == {"reroute", "reconfigure"}
    assert "restart" in first.details["excluded"]  # protection=none keeps no state to restart from


def test_a_single_worker_with_ample_peers_is_rerouted() -> None:
    cluster = Cluster()
    outcome = cluster.kill_workers(cluster.first.plan, 1)
    assert chosen(outcome) == "reroute"
    assert isinstance(outcome, Decision) and not outcome.restart and not outcome.transfers
    predictions = outcome.details["candidates"]
    assert predictions["reroute"]["cost_s"] <= predictions["reconfigure"]["cost_s"]


def test_the_same_failure_on_the_same_profile_is_decided_the_same_way() -> None:
    answers = []
    for _ in range(2):
        cluster = Cluster()
        outcome = cluster.kill_workers(cluster.first.plan, 1)
        assert isinstance(outcome, Decision)
        answers.append((outcome.plan, outcome.details["candidates"], outcome.predicted_pause_s))
    assert answers[0] == answers[1]
