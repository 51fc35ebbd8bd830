"""A stated calibration (``sim.calibrate_samples_per_s``): the ``cluster.device_efficiency`` at which a simulated
job's fault-free plan reaches a throughput the user states (a paper's fault-free figure), so that the one fitted
number is the devices' efficiency and everything the job does under failures is predicted at it.

The fault-free plan is the one the job's policy makes at step 0 with every worker (``job.first_decision``), timed by
the job's machine as the simulator times each of its steps (``Machine.step_s``); its throughput is the global batch
over that. Compute times divide by the efficiency and nothing else depends on it, so the throughput grows with it,
and the efficiency is found by a bracketed search in (0, 1]: secant steps on 1 / throughput against 1 / efficiency
(affine while the plan stays the same: compute plus what does not compute), bisection where a step would leave the
bracket. A policy's plan may change with the efficiency (Oobleck's planner picks the fastest templates), so the
throughput may jump past the target; the search then settles on the lowest efficiency that reaches it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from ftlab.experiments.config import JobConfig
from ftlab.experiments.job import everyone, first_decision, job_factory, resume_point
from ftlab.runtime.core.contract import ConfigError
from ftlab.runtime.core.devices import DEVICES

log = logging.getLogger(__name__)

TOLERANCE = 1e-4
"""Relative distance from the target throughput at which the search stops."""
MAX_TRIES = 60
"""Plans timed at most: bisection alone narrows (0, 1] to 1e-18 in as many."""


def calibrated_efficiency(cfg: JobConfig) -> float:
    """The ``cluster.device_efficiency`` at which ``cfg``'s fault-free plan reaches ``sim.calibrate_samples_per_s``;
    the search starts from the configured efficiency (which it returns at once where that reaches the target)."""
    target = cfg.sim.calibrate_samples_per_s
    assert target is not None
    if cfg.cluster.device not in DEVICES:
        raise ConfigError(f"sim.calibrate_samples_per_s calibrates a GPU type's efficiency, and cluster.device="
                          f"{cfg.cluster.device} is measured, not derived from a peak: use a GPU type "
                          f"({', '.join(DEVICES)}), or drop the calibration")  # fmt: skip
    if not 0 < target < float("inf"):
        raise ConfigError(f"sim.calibrate_samples_per_s={target}: give the fault-free samples per second, > 0")
    efficiency, reached = search(lambda e: fault_free_rate(cfg, e), target, cfg.cluster.device_efficiency)
    if reached < target * (1 - TOLERANCE):
        raise ConfigError(
            f"sim.calibrate_samples_per_s={target:g}: the job's fault-free plan reaches {reached:.4g} samples/s even "
            f"at cluster.device_efficiency=1 (the devices' full peak in train.precision={cfg.train.precision}): state "
            f"a throughput it can reach, or change what bounds it (the precision, the cluster's links, the batch)"
        )
    log.info("calibrated cluster.device_efficiency=%.4f: %.4g samples/s fault-free, target %.4g",
             efficiency, reached, target)  # fmt: skip
    return efficiency


def fault_free_rate(cfg: JobConfig, efficiency: float) -> float:
    """Samples per second of the plan ``cfg``'s policy makes at step 0 with every worker, at ``efficiency``."""
    at = replace(cfg, cluster=replace(cfg.cluster, device_efficiency=efficiency))
    make_job = job_factory(at, resume_point(at))
    _, _, decision = first_decision(at, make_job)
    step_s = make_job(everyone(at)).machine().step_s(decision.plan, decision.programs)
    return at.train.global_batch / step_s


def search(rate: Callable[[float], float], target: float, start: float) -> tuple[float, float]:
    """An efficiency in (0, 1] where ``rate`` (non-decreasing) is within ``TOLERANCE`` of ``target`` (the lowest that
    reaches it where ``rate`` jumps past it), and its rate; where even ``rate(1)`` falls short, 1 and that."""
    low, high = 0.0, 1.0  # rate(low) < target <= rate(high), once rate(1) is known to reach it
    tried = [(start, rate(start))]
    if tried[0][1] < target:
        low = start
        tried.append((1.0, rate(1.0)))
        if tried[-1][1] < target * (1 - TOLERANCE):
            return tried[-1]
    else:
        high = start
    for _ in range(MAX_TRIES):
        efficiency, reached = tried[-1]
        if abs(reached / target - 1) <= TOLERANCE:
            return tried[-1]
        if reached < target:
            low = max(low, efficiency)
        else:
            high = min(high, efficiency)
        guess = _secant(tried, target)
        efficiency = guess if guess is not None and low < guess < high else (low + high) / 2
        if efficiency in (low, high):  # the bracket is down to a float's width: the rate jumps past the target here
            break
        tried.append((efficiency, rate(efficiency)))
    return min(((e, r) for e, r in tried if r >= target), key=lambda tried_one: tried_one[0])


def _secant(tried: list[tuple[float, float]], target: float) -> float | None:
    """Where 1 / rate reaches 1 / ``target`` on the line through the last two tries in (1 / efficiency,
    1 / rate); from a single try, in proportion (as if nothing but compute took time)."""
    efficiency, reached = tried[-1]
    if len(tried) == 1:
        return efficiency * target / reached
    (e0, r0) = tried[-2]
    if r0 == reached:
        return None
    x = 1 / efficiency + (1 / target - 1 / reached) * (1 / e0 - 1 / efficiency) / (1 / r0 - 1 / reached)
    return 1 / x if x > 0 else None
