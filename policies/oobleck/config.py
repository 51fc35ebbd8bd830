"""The settings of ``policy=oobleck``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OobleckConfig:
    _target_: str = "ftlab.policies.oobleck.policy.Oobleck"
    name: str = "oobleck"
    fault_threshold: int = 1
    """f: the number of simultaneous node failures to survive in place (f + 1 pipelines at least)."""
    min_nodes: int = 1
    """The fewest nodes of a pipeline template: n0 is the larger of this and the fewest a pipeline fits in (Section
    4.1.1). A study that runs every system at a stated pipeline depth (ReCycle's (PP, DP)) sets it to that depth."""


SCHEMAS = {"policy": OobleckConfig}
