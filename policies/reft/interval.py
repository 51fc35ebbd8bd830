"""``protection.interval: auto``: how many committed steps between snapshots, from the snapshot's cost and the
fault schedule's failure rate.

The paper snapshots every iteration because HAS makes a snapshot nearly free; the interval is worth more than one
only when a snapshot costs time on the critical path. So ``auto`` takes Young's first-order optimum between the
cost of a snapshot and the work a failure throws away: tau = sqrt(2 C / lambda) seconds, where

- C is the snapshot's expected time on the critical path: the copy of a worker's records (bytes over the measured
  copy-and-checksum rate) less the iteration it overlaps, plus the time to start it;
- lambda is the cluster's failure rate from the fault schedule (``faults.schedules.failure_rate``; a rate in steps
  is turned into one in seconds at the predicted iteration time);
- the iteration time comes from the cost model (``runtime.core.costs``, the 1F1B programs of the first plan simulated).

The reliability model (Eq. 5, ``reliability.reft_survival``) then says how likely the in-memory snapshots stay
recoverable between two flushes to storage (one lost node per sharding group survived); that probability is
recorded with the choice, so a user sees whether ``flush_every`` is long enough for the failure rate. The per-node
rate is taken as the cluster's over its nodes, with the schedule's Weibull shape: an approximation, since a
generated schedule draws the gaps of the whole cluster, not of each node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ftlab.policies.reft.reliability import reft_survival
from ftlab.runtime.core.contract import FailureRate

SNAPSHOT_BYTES_PER_S = 4e9
"""Copying a record into pre-touched /dev/shm and checksumming it (XXH3), one thread: about 2.5 times a memcpy of the
same bytes (``experiments.bench_snapshots``, part 0), so about 8 GB/s where memcpy runs at 20; half that on a loaded
host."""
LAUNCH_S = 1e-3
"""Starting the copy thread and describing the state to it."""


@dataclass(frozen=True)
class IntervalChoice:
    steps: int
    reason: str


def choose_interval(
    *, iteration_s: float, snapshot_bytes: int, failure_rate: FailureRate | None, nodes: int,
    group_size: int, flush_every: int, threshold: float,
) -> IntervalChoice:  # fmt: skip
    """The snapshot interval in steps, and why. ``snapshot_bytes``: the largest share one worker writes."""
    copy_s = snapshot_bytes / SNAPSHOT_BYTES_PER_S
    cost_s = max(0.0, copy_s - iteration_s) + LAUNCH_S
    if failure_rate is None:
        return IntervalChoice(1, f"the fault schedule gives no failure rate: a snapshot every step (it costs about "
                                 f"{cost_s * 1e3:.1f} ms of an iteration of {iteration_s * 1e3:.0f} ms)")  # fmt: skip
    failures_per_s = failure_rate.per_s(iteration_s)
    tau = math.sqrt(2 * cost_s / failures_per_s)
    steps = max(1, round(tau / iteration_s))
    flush_s = flush_every * steps * iteration_s
    survival = reft_survival(flush_s, nodes=nodes, group_size=max(group_size, 2),
                             hardware_rate=failures_per_s / nodes, shape=failure_rate.shape)  # fmt: skip
    verdict = "above" if survival >= threshold else "BELOW"
    return IntervalChoice(
        steps,
        f"Young's optimum sqrt(2 C / lambda) = {tau:.2f} s for a snapshot costing C = {cost_s * 1e3:.1f} ms on the "
        f"critical path (copy {copy_s * 1e3:.1f} ms against an iteration of {iteration_s * 1e3:.0f} ms) and "
        f"{failures_per_s * 3600:.3g} failures per hour: every {steps} steps. Memory snapshots stay recoverable "
        f"between flushes ({flush_s:.0f} s) with probability {survival:.4f} (Eq. 5), {verdict} the threshold "
        f"{threshold}",
    )
