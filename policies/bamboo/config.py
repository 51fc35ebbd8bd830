"""The settings of ``policy=bamboo``: none beyond the name (where state is saved for a full restart is the
protection's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BambooConfig:
    _target_: str = "ftlab.policies.bamboo.policy.Bamboo"
    name: str = "bamboo"


SCHEMAS = {"policy": BambooConfig}
