"""How many steps ``policy=adaptive`` expects until the next membership change, and why that changes while nothing
happens.

The fault schedules draw the cluster's failures as a renewal process: independent gaps, exponential or Weibull
(``faults.schedules``; ``FailureRate`` carries the mean and the Weibull shape k). Seen ``t`` after the last failure,
the expected wait for the next one is the gap's mean residual life

    m(t) = E[T - t | T > t] = integral from t to infinity of S(u) du / S(t),   S(u) = exp(-(u / scale) ** k)
         = scale / k * Gamma(1 / k) * Q(1 / k, x) * exp(x),                  x = (t / scale) ** k

with Q the regularised upper incomplete gamma function. For k = 1 (exponential, and the fallback
``policy.mtbf_steps`` of a schedule that gives no rate) m(t) is the mean whatever t: failures have no memory, so
what was cheapest at the failure stays cheapest. For k < 1 (bursts: the fault schedules' and spot traces' shape)
m(t) grows with t: the longer the cluster has run since its last failure, the longer it is expected to run until the
next, which is what makes a review (``Adaptive.review``) leave a plan chosen for a short horizon (a reroute) for one
that pays its pause back over a long one (a reconfiguration). For k > 1 (wear-out) m(t) shrinks.

Our choices: joins are not modelled (no schedule says when a node will join), so the next change is the next
failure; a rate in seconds is turned into steps at the iteration time the caller gives (``policy.adaptive``: one
for every candidate of a decision), and so are the seconds since the last failure (``steps x iteration time``: the
measured seconds would make the choice depend on the machine's load, and it must be the same on every run).
"""

from __future__ import annotations

import math

from scipy.special import gamma, gammaincc

from ftlab.runtime.core.contract import FailureRate

_ASYMPTOTIC_X = 100.0
"""Beyond this x, Q(a, x) * exp(x) underflows times overflows in floats: its asymptotic series is used instead."""


def mean_residual(mean: float, shape: float, elapsed: float) -> float:
    """The expected time until the next failure, ``elapsed`` after the last one, for Weibull(``shape``) gaps of mean
    ``mean`` (any unit, the same for both)."""
    if shape == 1.0 or elapsed <= 0.0:
        return mean
    scale = mean / math.gamma(1.0 + 1.0 / shape)
    a, x = 1.0 / shape, (elapsed / scale) ** shape
    if x < _ASYMPTOTIC_X:
        return scale / shape * float(gamma(a)) * float(gammaincc(a, x)) * math.exp(x)
    # Gamma(a, x) ~ x^(a-1) e^-x (1 + (a-1)/x + (a-1)(a-2)/x^2)
    return scale / shape * x ** (a - 1.0) * (1.0 + (a - 1.0) / x + (a - 1.0) * (a - 2.0) / x**2)


def steps_until_change(
    rate: FailureRate | None, fallback_steps: float, since_failure: int, iteration_s: float
) -> float:
    """Committed steps expected until the next failure, ``since_failure`` steps after the last one (or the job's
    start), at ``iteration_s`` per step; ``fallback_steps`` (exponential) where the schedule gives no rate."""
    if rate is None:
        return fallback_steps
    if rate.mean_steps is not None:
        return mean_residual(rate.mean_steps, rate.shape, float(since_failure))
    assert rate.mean_s is not None  # FailureRate holds one of the two
    return mean_residual(rate.mean_s, rate.shape, since_failure * iteration_s) / iteration_s
