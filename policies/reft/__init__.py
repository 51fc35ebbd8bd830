"""REFT: in-memory checkpoints protected by redundancy across data-parallel peers.

``protection`` is ``protection=reft`` (snapshots in the nodes' host memory, ARC / AEC / AOR, a flush to storage);
``reliability`` holds the paper's reliability model (Section 5): how long snapshots kept in host memory stay
recoverable, with and without REFT's protection, and the longest safe interval between checkpoints to storage;
``interval`` picks the snapshot interval from the snapshot's cost and the failure rate (``interval: auto``).
"""

from ftlab.policies.reft.reliability import (
    checkpoint_survival,
    longest_interval,
    reft_survival,
    weibull_survival,
)

__all__ = ["checkpoint_survival", "longest_interval", "reft_survival", "weibull_survival"]
