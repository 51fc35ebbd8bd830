"""REFT: in-memory checkpoints protected by redundancy across data-parallel peers.

``protection`` is ``protection=reft`` (snapshots in the nodes' host memory, ARC / AEC / AOR, a flush to storage);
``reliability`` holds the paper's reliability model (Section 5): how long snapshots kept in host memory stay
recoverable, with and without REFT's protection, and the longest safe interval between checkpoints to storage;
``interval`` picks the snapshot interval from the snapshot's cost and the failure rate (``interval: auto``).

The names below load on first use: the policy catalog imports this package for its config alone, and
``reliability`` brings SciPy, which a refused or unrelated job must not wait for.
"""

from typing import Any

__all__ = ["checkpoint_survival", "longest_interval", "reft_survival", "weibull_survival"]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - whichever name was asked for
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ftlab.policies.reft import reliability

    return getattr(reliability, name)
