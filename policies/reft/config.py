"""The settings of ``protection=reft``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass
class ReftConfig:
    _target_: str = "ftlab.policies.reft.protection.ReftProtection"
    name: str = "reft"
    mode: str = "arc"
    """arc (each member also keeps a peer's shard) | aec (XOR parity) | arc+aec (both) | aor (with train.zero=1: the
    peer's optimizer chunk recomputed from its gradient chunk)."""
    interval: Union[int, str] = 1  # noqa: UP007 - OmegaConf reads typing.Union, not int | str
    """Committed steps between snapshots, or auto: Young's optimum for the snapshot's cost on the critical path and
    the fault schedule's failure rate (``policies.reft.interval``; the choice is recorded with the run)."""
    flush_every: int = 10
    """Committed steps between flushes to storage, the fallback when a failure is beyond what memory protects."""
    keep: int = 2
    """Flushes kept on storage."""
    max_failed_saves: int = 3
    """Flushes in a row that storage may refuse before the job stops (each is abandoned; training goes on)."""
    allow_low_space: bool = False
    """Start even if the checkpoint folder has room for fewer than keep + 1 flushes (warned, not refused)."""
    host_memory_gb: float = 4.0
    """Host memory of one node for snapshots: a layout whose records (two slots each) need more is refused."""
    threshold: float = 0.9
    """Survival probability the reliability model (Eq. 5) reports the flush period against, with interval=auto."""


SCHEMAS = {"protection": ReftConfig}
