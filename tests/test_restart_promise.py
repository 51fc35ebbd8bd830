"""``Roles.restarts`` is a promise: with a protection that keeps state, a policy that declares it recovers from any
failure that leaves a live node. Held for every policy found that declares it, on the simulator (the same policy code
the processes run), at the edge: three of four nodes die at once, leaving one worker for a layout of three stages."""

from __future__ import annotations

import pytest

from ftlab.experiments.job import compose_config
from ftlab.experiments.simulate import simulate_job
from ftlab.policies import catalog
from tests.support import explicit, node

STEPS = 8


@pytest.mark.parametrize("policy", catalog.policies_with(lambda roles: roles.recovers and roles.restarts))
def test_a_policy_that_restarts_recovers_on_the_last_live_node(job_overrides: list[str], policy: str) -> None:
    stages = max(3, catalog.roles()[policy].state_copies)
    result = simulate_job(compose_config([
        *job_overrides, "mode=simulate", f"policy={policy}", "cluster=local-4", f"train.stages={stages}",
        f"train.steps={STEPS}", "protection=storage", "protection.every=2",
        *explicit(node(0, 3, "backward"), node(1, 3, "backward"), node(2, 3, "backward")),
    ]))  # fmt: skip
    assert sorted({r.step for r in result.steps}) == list(range(STEPS))
    assert result.plans[-1].workers == (3,), [p.workers for p in result.plans]
