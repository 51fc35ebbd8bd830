"""How long in-memory checkpoints stay safe: REFT's reliability model (paper Section 5, Eq. 5 and 6).

Nodes fail independently with Weibull times to failure: a node survives to time t with probability
``exp(-rate * t**shape)``. Nodes form sharding groups (SGs) of ``group_size`` nodes, one per data-parallel path,
that protect each other's snapshot shards (redundant copies or XOR parity), so a group loses nothing while at most
``tolerated`` of its nodes fail (one for a single layer of protection).

- With REFT (Eq. 5): ``P = (Ps^n + n (1 - Ps) Ps^(n-1))^(k/n) * Pre^k``, Ps a node's hardware survival, Pre its
  snapshot-management program's survival, k nodes, n per group. A training-process crash (software failure) loses
  nothing: snapshots live in host memory, outside the training process.
- Without REFT (Eq. 6): ``P = Ps^k * Ptr^k``: every node must survive hardware and software failures.

The longest checkpoint interval is the time at which survival falls to a threshold (root finding).

Reproducing the paper's example (3,072 devices taken as k = 3,072 nodes, 6 DP paths so n = 6 and 512 groups,
hardware rate 1e-4, software rate 1e-5, c = 1.3, threshold 0.9; the paper says about 16.22 days with REFT and
about 0.5 days without):

- The rates are per day (t in days): read per hour, the same formulas give 0.67 and 0.017 days.
- Eq. 6 gives 0.408 days, not 0.5.
- Eq. 5 gives 16.18 days when Pre = 1, that is when the snapshot program never fails (the paper's "assuming all
  submodules function correctly"); charging Pre with the software rate 1e-5 instead gives 2.56 days. So the
  paper's software rate enters Eq. 6 only, and ``snapshot_rate`` defaults to 0.
- The remaining gaps (16.18 against 16.22, 0.408 against 0.5) are what reading a sampled curve gives: on a grid of
  about 0.1 day, e.g. ``numpy.linspace(0, 100, 1000)``, the first sample below 0.9 is 16.216 and 0.5005 days. The
  paper does not say how it read the figure, so this is the likely cause, not a certain one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from scipy.optimize import brentq


def weibull_survival(t: float, rate: float, shape: float) -> float:
    """Probability that one node has not failed by time ``t`` (``rate`` per unit of ``t**shape``)."""
    return math.exp(-rate * t**shape)


def reft_survival(
    t: float,
    *,
    nodes: int,
    group_size: int,
    hardware_rate: float,
    shape: float,
    snapshot_rate: float = 0.0,
    tolerated: int = 1,
) -> float:
    """Eq. 5: probability that every group still holds a complete snapshot at time ``t``.

    ``tolerated`` failures per group are survivable (1 in the paper; more with collaborative protection, where the
    group term becomes the binomial probability of at most that many failures).
    """
    ps = weibull_survival(t, hardware_rate, shape)
    group = sum(math.comb(group_size, i) * (1 - ps) ** i * ps ** (group_size - i) for i in range(tolerated + 1))
    return group ** (nodes / group_size) * weibull_survival(t, snapshot_rate, shape) ** nodes


def checkpoint_survival(t: float, *, nodes: int, hardware_rate: float, software_rate: float, shape: float) -> float:
    """Eq. 6: probability that no node has had a hardware or software failure by time ``t``."""
    return (weibull_survival(t, hardware_rate, shape) * weibull_survival(t, software_rate, shape)) ** nodes


def longest_interval(survival: Callable[[float], float], threshold: float) -> float:
    """The time at which a decreasing ``survival`` (1 at t = 0) falls to ``threshold``."""
    if not 0 < threshold < 1:
        raise ValueError(f"survival threshold {threshold} must lie strictly between 0 and 1")
    upper = 1.0
    while survival(upper) > threshold:
        upper *= 2
        if upper > 1e12:
            raise ValueError(f"survival stays above {threshold} for 1e12 time units: are the failure rates zero?")
    return brentq(lambda t: survival(t) - threshold, 0.0, upper, xtol=1e-12, rtol=1e-12)
