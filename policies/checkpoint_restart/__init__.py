"""Checkpoint-restart: the baseline every in-place policy is compared against."""

from policies.checkpoint_restart.policy import CheckpointRestart

__all__ = ["CheckpointRestart"]
