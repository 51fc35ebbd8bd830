"""The equivalence oracle that every recovery test holds a run to: a recovered run equals the fault-free run.

Losses at every step (as finally committed: a step re-run after a rollback counts once, the last time) to 1e-5
relative, and the final parameters to 2e-5 absolute: the differences of float32 sums in another order.
"""

from __future__ import annotations

import pytest
import torch

from ftlab.experiments.job import JobResult
from ftlab.runtime.state import checkpoint
from ftlab.runtime.training.layer_state import decode

LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5


def committed_losses(result: JobResult, steps: int) -> list[float]:
    """The loss of each step as finally committed; every step of the job must have been committed."""
    by_step = {r.step: r.loss for r in result.steps}
    assert sorted(by_step) == list(range(steps))
    return [by_step[s] for s in range(steps)]


def final_state(result: JobResult, steps: int) -> dict[int, dict]:
    """Each layer's parameters in the job's final checkpoint (of step ``steps``)."""
    found = checkpoint.latest(result.checkpoint_dir)
    assert found is not None and found[0] == steps, f"no checkpoint of step {steps} in {result.checkpoint_dir}"
    return {int(p.stem.split("-")[1]): decode(p.read_bytes())["module"] for p in found[1].glob("layer-*.pt")}


def assert_on_fault_free_trajectory(result: JobResult, fault_free: JobResult, steps: int) -> None:
    assert committed_losses(result, steps) == pytest.approx(committed_losses(fault_free, steps), rel=LOSS_RTOL)
    reference, state = final_state(fault_free, steps), final_state(result, steps)
    assert sorted(state) == sorted(reference)
    for layer, params in reference.items():
        for name, value in params.items():
            torch.testing.assert_close(state[layer][name], value, rtol=0, atol=PARAM_ATOL, msg=f"layer {layer} {name}")
