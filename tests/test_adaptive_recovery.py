"""``policy=adaptive`` on real processes: it reroutes, reconfigures or restarts as its predictions say, and every
choice keeps the job on the fault-free trajectory (per-step losses rel 1e-5, final parameters atol 2e-5).

Plans and predictions come from the analytic cost model (an A100's) and the measured constants of ``conf/sim``, so
the choices are the same on every run; each device is granted 40 MB, so pipelines have two stages, as
``train.stages=2`` asks, for every candidate (the scenarios name workers by stage). The choices, with gpt2-tiny:

- six nodes: worker 1 (stage 1) crashes, and its two data-parallel peers absorb its micro-batches for less than the
  layer copies of a reconfiguration cost: reroute. Then node 3 (stage 1 again) is lost and the last peer of stage 1
  would do three pipelines' work: reconfigure, from the rerouted plan (Oobleck re-instantiates the four whole
  nodes as two pipelines, copying the layers from the survivors);
- six nodes, failures in bursts (Weibull gaps of shape 0.3 and mean 0.46 steps): worker 1 (stage 1) crashes at
  step 2 and another failure is expected within a step, too soon to repay a reconfiguration: reroute. Two quiet
  steps later the next failure is expected 4.7 steps on (capped by the 4 left), and the review at step 4 leaves the
  rerouted grid (0.300 s an iteration) for Oobleck's five-node pipelines (0.263 s, after a 0.044 s pause to copy
  layers) without any further fault (``tests/test_adaptive_policy.py``'s ``TINY_ON_THIS_HOST``);
- four nodes with REFT's snapshots: worker 1 crashes (reroute: a restart would pause for process starts), then worker
  3, the last replica of stage 1, crashes too: no peer and no replica is left, so every candidate restarts, from the
  in-memory snapshot in the nodes' memory, which outlives the processes. (Had node 3 been lost instead, the snapshot
  would have gone with it: after the reroute worker 3 was stage 1's only holder, so its shards had no copy.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftlab.experiments.job import JobResult
from ftlab.runtime.control import events as ev
from tests.oracle import assert_on_fault_free_trajectory
from tests.support import REROUTE_MACHINERY, REVIEW_MACHINERY, analytic_profiles, explicit, node, process, run_apart
from tests.test_adaptive_policy import BURSTY, FAILED

STEPS = 8


def adaptive(cluster: str, protection: str = "storage") -> list[str]:
    saves = ["protection=storage", f"protection.every={STEPS}"] if protection == "storage" else [
        "protection=reft", f"protection.flush_every={STEPS}"]  # fmt: skip
    return ["experiment=plain", "policy=adaptive", f"cluster={cluster}", "train.stages=2", f"train.steps={STEPS}",
            "cluster.device_memory_gb=0.04", *saves]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def deterministic_plans() -> Iterator[None]:
    with analytic_profiles():
        yield


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> JobResult:
    return run_apart(tmp_path_factory, token_cache, *adaptive("local-4"))


def choices(result: JobResult) -> list[tuple[str, str]]:
    """(candidate, outcome) of every decision after a change, each with its predictions published."""
    decided = [e for e in result.events if isinstance(e, ev.Decided)]
    assert all(e.predicted_pause_s is not None and e.predicted_iter_s is not None for e in decided)
    assert all(len(e.details["candidates"]) >= 2 for e in decided), "every candidate's prediction is published"
    return [(e.details["chosen"], e.outcome) for e in decided]


def test_reroute_then_reconfigure_when_a_second_failure_overloads_the_stage(
    run, fault_free: JobResult  # noqa: ANN001
) -> None:
    result = run(*adaptive("local-6"), *explicit(process(1, 2, "backward"), node(3, 5, "forward")), *REROUTE_MACHINERY)
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    assert choices(result) == [("reroute", "replan"), ("reconfigure", "reconfigure")]
    assert [r.step for r in result.steps] == list(range(STEPS)), "no committed step lost"
    survivors = {w: pids for w, pids in result.worker_pids.items() if w not in (1, 3)}
    assert all(len(pids) == 1 for pids in survivors.values()), "no surviving process restarted"
    assert result.faults[1].transfer_bytes > 0


def test_a_reroute_gives_way_to_a_reconfiguration_at_a_review_without_a_further_fault(
    run, fault_free: JobResult  # noqa: ANN001
) -> None:
    result = run(*adaptive("local-6"), "policy.review_every=2", *BURSTY, *REVIEW_MACHINERY)
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    (fault,) = [e for e in result.events if isinstance(e, ev.FaultInjected)]
    assert fault.workers == (FAILED,) and fault.fault["at_step"] == 2
    assert choices(result) == [("reroute", "replan")]
    switches = [e for e in result.events if isinstance(e, ev.Reviewed) and e.outcome != "keep"]
    assert [(e.step, e.details["chosen"], e.outcome) for e in switches] == [(4, "reconfigure", "reconfigure")]
    assert switches[0].predicted_pause_s is not None and switches[0].predicted_iter_s is not None
    (copied,) = [e for e in result.events if isinstance(e, ev.LayersCopied)]
    assert copied.generation == switches[0].generation and copied.nbytes > 0
    assert [r.step for r in result.steps] == list(range(STEPS)), "no committed step lost"
    survivors = [pids for w, pids in result.worker_pids.items() if w != FAILED]
    assert all(len(pids) == 1 for pids in survivors), "no surviving process restarted"


def test_a_lost_stage_restarts_from_the_in_memory_snapshot(run, fault_free: JobResult) -> None:  # noqa: ANN001
    result = run(*adaptive("local-4", "reft"), *explicit(process(1, 2, "backward"), process(3, 5, "forward")))
    assert_on_fault_free_trajectory(result, fault_free, STEPS)
    (reroute, restart) = choices(result)
    assert reroute == ("reroute", "replan") and restart[1] == "restart"
    (restored,) = [e for e in result.events if isinstance(e, ev.StateRestored)]
    assert restored.source == "memory"
