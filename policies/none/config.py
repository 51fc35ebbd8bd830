"""The settings of ``policy=none`` and ``protection=none``: none beyond the name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NoRecoveryConfig:
    _target_: str = "ftlab.policies.none.policy.NoRecovery"
    name: str = "none"


@dataclass
class NoProtectionConfig:
    _target_: str = "ftlab.policies.none.policy.NoProtection"
    name: str = "none"


SCHEMAS = {"policy": NoRecoveryConfig, "protection": NoProtectionConfig}
