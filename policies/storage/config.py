"""The settings of ``protection=storage``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StorageConfig:
    _target_: str = "ftlab.policies.storage.protection.StorageProtection"
    name: str = "storage"
    every: int | None = 5
    """Committed steps between checkpoints; null to checkpoint by the clock (``every_s``). One of the two is set."""
    every_s: float | None = None
    """Seconds of training between checkpoints, on the machine's clock (``protection.StorageProtection``), so an
    interval means the same at any iteration speed; set ``every`` to null with it."""
    keep: int = 2
    """Committed checkpoints kept on storage (older ones are deleted)."""
    max_failed_saves: int = 3
    """Checkpoints in a row that storage may refuse (full, failing, read-only) before the job stops; each one is
    abandoned and training goes on (``runtime.core.failed_saves``)."""
    allow_low_space: bool = False
    """Start even if the checkpoint folder has room for fewer than keep + 1 checkpoints (warned, not refused)."""


SCHEMAS = {"protection": StorageConfig}
