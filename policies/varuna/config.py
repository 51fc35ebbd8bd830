"""The settings of ``policy=varuna``: none beyond the name (where state is saved is the protection's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class VarunaConfig:
    _target_: str = "ftlab.policies.varuna.policy.Varuna"
    name: str = "varuna"


SCHEMAS = {"policy": VarunaConfig}
