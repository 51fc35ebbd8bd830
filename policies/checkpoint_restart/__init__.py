"""Checkpoint-restart: the baseline every in-place policy is compared against."""
