"""A restore source the protection offers but the nodes cannot load (``Coordinator._loadable``): the policy answers
again, and training goes on from where that answer starts. On the simulator (the coordinator and policies the
processes run): ReCycle with REFT's ARC snapshots; node 1 dies in step 3 and its micro-batches are rerouted to node 3,
whose preemption, warned at step 1, lands just after. Stage 1 has no worker left; ReCycle restarts from the newest
snapshot in memory, which the nodes cannot rebuild (stage 1's records went with nodes 1 and 3), so it answers again:
from scratch, at step 0. Before the fix training went on at the refused snapshot's step, with fresh state."""

from __future__ import annotations

from ftlab.experiments.job import compose_config
from ftlab.experiments.simulate import simulate_job
from ftlab.runtime.control import events as ev
from tests.support import explicit, node

STEPS = 8


def test_after_a_refused_restore_training_resumes_where_the_new_answer_starts(job_overrides: list[str]) -> None:
    result = simulate_job(compose_config([
        *job_overrides, "mode=simulate", "policy=recycle", "cluster.nodes=5", "train.stages=2", f"train.steps={STEPS}",
        "train.micro_batch=1", "protection=reft", "protection.mode=arc", "protection.interval=1",
        "protection.flush_every=4", *explicit("{kind: node, node: 3, at_step: 1, warning_s: 0.3}", node(1, 3, "forward")),
    ]))  # fmt: skip
    kinds = [type(e) for e in result.events]
    assert ev.RestoreRefused in kinds, "the scenario no longer reaches a refused restore: retune the warning"
    answer = next(e for e in result.events[kinds.index(ev.RestoreRefused):] if isinstance(e, ev.Decided))
    assert answer.outcome == "restart" and answer.resume_step == 0, answer.reason
    steps = [r.step for r in result.steps]
    assert steps == [0, 1, 2, *range(STEPS)], steps
