"""Saved state: storage checkpoints, REFT's in-memory snapshots and the file-backed shared memory they live in."""
