"""The settings of ``policy=checkpoint_restart``: none beyond the name (where state is saved is the protection's)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointRestartConfig:
    _target_: str = "ftlab.policies.checkpoint_restart.policy.CheckpointRestart"
    name: str = "checkpoint_restart"


SCHEMAS = {"policy": CheckpointRestartConfig}
