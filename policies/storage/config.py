"""The settings of ``protection=storage``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StorageConfig:
    _target_: str = "ftlab.policies.storage.protection.StorageProtection"
    name: str = "storage"
    every: int = 5
    """Committed steps between checkpoints."""
    keep: int = 2
    """Committed checkpoints kept on storage (older ones are deleted)."""


SCHEMAS = {"protection": StorageConfig}
