"""What a policy that restarts from saved state does when warned of a preemption: checkpoint now."""

from __future__ import annotations

from ftlab.runtime.core.contract import Heed, Job, PreemptionWarning, Protection, SaveCheckpoint, StorageSource


def checkpoint_now(warning: PreemptionWarning, job: Job, protection: Protection) -> Heed:
    """A storage checkpoint of the warned step, in the run's checkpoint directory and kept as the protection keeps
    its own: if it completes before the kill, the restart that follows loses no committed step; if the kill comes
    first, the save fails with the node and the protection's newest state is used (Varuna's fate in Oobleck 7.4)."""
    newest = protection.restore_source()
    if isinstance(newest, StorageSource) and newest.step == warning.step:
        return Heed(f"{warning.describe()}: step {warning.step} is checkpointed already")
    keep = max(protection.storage_footprint()[0], 1)
    return Heed(f"{warning.describe()}: checkpoint step {warning.step} before the kill",
                (SaveCheckpoint(job.train.checkpoint_dir, keep),))  # fmt: skip
