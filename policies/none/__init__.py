"""``policy=none`` and ``protection=none``: train on a PP x DP grid, keep no saved state, stop at the first failure."""
