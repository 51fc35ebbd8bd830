"""The settings of ``policy=oobleck``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OobleckConfig:
    _target_: str = "ftlab.policies.oobleck.policy.Oobleck"
    name: str = "oobleck"
    fault_threshold: int = 1
    """f: the number of simultaneous node failures to survive in place (f + 1 pipelines at least)."""


SCHEMAS = {"policy": OobleckConfig}
