"""REFT's reliability model against the paper's example and against a Monte Carlo of the same assumptions."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest

from ftlab.policies.reft.reliability import checkpoint_survival, longest_interval, reft_survival, weibull_survival

# The paper's example: 3,072 devices, 6 DP paths (groups of 6), rates per day, Weibull shape 1.3, threshold 0.9.
EXAMPLE = dict(nodes=3072, hardware_rate=1e-4, shape=1.3)
REFT = partial(reft_survival, group_size=6, **EXAMPLE)
CHECKPOINT = partial(checkpoint_survival, software_rate=1e-5, **EXAMPLE)


def test_survival_starts_at_one_and_decreases() -> None:
    for survival in (REFT, CHECKPOINT):
        values = [survival(t) for t in (0.0, 0.5, 5.0, 50.0)]
        assert values[0] == 1.0
        assert all(a > b for a, b in zip(values, values[1:]))


def test_reft_matches_eq5_written_out() -> None:
    t, n, k = 7.0, 6, 3072
    ps, pre = math.exp(-1e-4 * t**1.3), math.exp(-2e-6 * t**1.3)
    eq5 = (ps**n + n * (1 - ps) * ps ** (n - 1)) ** (k / n) * pre**k
    assert REFT(t, snapshot_rate=2e-6) == pytest.approx(eq5, rel=1e-12)


def test_paper_example_from_the_formulas() -> None:
    """What Eq. 5 (snapshot program never failing) and Eq. 6 give; the paper reports 16.22 and 0.5 days."""
    with_reft = longest_interval(REFT, 0.9)
    without = longest_interval(CHECKPOINT, 0.9)
    assert with_reft == pytest.approx(16.178, abs=1e-3)
    assert without == pytest.approx(0.408, abs=1e-3)
    # The formulas' roots sit 0.26% and 18% below the paper's figures ...
    assert with_reft / 16.22 == pytest.approx(0.9974, abs=1e-4)
    assert without / 0.5 == pytest.approx(0.816, abs=1e-3)


def test_paper_figures_are_the_first_samples_below_threshold_on_a_tenth_of_a_day_grid() -> None:
    """... and both paper figures are what a curve sampled every ~0.1 day shows first below 0.9."""
    grid = np.linspace(0, 100, 1000)
    first_below = [next(t for t in grid if survival(t) < 0.9) for survival in (REFT, CHECKPOINT)]
    assert round(first_below[0], 2) == 16.22
    assert round(first_below[1], 1) == 0.5


def test_software_rate_charged_to_the_snapshot_program_cannot_reproduce_the_paper() -> None:
    """Reading Eq. 5's Pre as surviving the 1e-5 software failures gives 2.56 days, far from 16.22."""
    assert longest_interval(partial(REFT, snapshot_rate=1e-5), 0.9) == pytest.approx(2.564, abs=1e-3)


def test_per_hour_rates_cannot_reproduce_the_paper() -> None:
    hours = longest_interval(lambda days: REFT(days * 24), 0.9)
    assert hours == pytest.approx(0.674, abs=1e-3)


def test_more_protection_lasts_longer() -> None:
    one, two = (longest_interval(partial(REFT, tolerated=k), 0.9) for k in (1, 2))
    assert longest_interval(CHECKPOINT, 0.9) < one < two


def test_eq5_agrees_with_a_monte_carlo_of_independent_weibull_nodes() -> None:
    rng = np.random.default_rng(0)
    t, trials, groups = 16.178, 4000, 512
    # Weibull lifetimes with survival exp(-rate * t**c): scale = rate ** (-1 / c).
    lifetimes = rng.weibull(1.3, size=(trials, groups, 6)) * 1e-4 ** (-1 / 1.3)
    survived = ((lifetimes < t).sum(axis=2) <= 1).all(axis=1).mean()
    expected = REFT(t)
    assert expected == pytest.approx(0.9, abs=1e-6)
    assert abs(survived - expected) < 4 * math.sqrt(expected * (1 - expected) / trials)


def test_threshold_must_be_a_probability() -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        longest_interval(REFT, 1.0)


def test_weibull_shape_one_is_exponential() -> None:
    assert weibull_survival(3.0, 0.2, 1.0) == pytest.approx(math.exp(-0.6))
