"""Periodic checkpoints to storage, in the way of Varuna and TorchElastic.

Every ``every`` committed steps each layer is written once (by its first holder) under the run's checkpoint
directory, and the checkpoint counts only once its manifest is written (``runtime.state.checkpoint``), so a kill in the
middle leaves the previous one. The protection remembers which checkpoints completed; the newest is what a restart
restores from. A job resumed with ``train.resume_from`` starts with that checkpoint as its newest.
"""

from __future__ import annotations

from ftlab.runtime.core.contract import (
    Action, Change, ConfigError, Job, MemoryRecord, Protection, SaveCheckpoint, Source, StorageSource,
)  # fmt: skip
from ftlab.runtime.core.plan import Plan


class StorageProtection(Protection):
    def __init__(self, settings: object) -> None:
        super().__init__(settings)
        self.directory = ""
        """Set by ``check``: the run's checkpoint directory."""
        self.newest: Source | None = None

    def check(self, job: Job) -> None:
        if self.settings.every < 1:
            raise ConfigError(f"protection.every={self.settings.every}: checkpoint every 1 or more committed steps")
        if self.settings.keep < 1:
            raise ConfigError(f"protection.keep={self.settings.keep}: keep at least the newest checkpoint")
        self.directory = job.train.checkpoint_dir
        self.newest = job.start

    def after_commit(self, step: int, plan: Plan) -> list[Action]:
        if step % self.settings.every:
            return []
        return [SaveCheckpoint(self.directory, self.settings.keep)]

    def saved(self, action: Action, step: int, records: tuple[MemoryRecord, ...] = ()) -> None:
        assert isinstance(action, SaveCheckpoint)
        self.newest = StorageSource(step, str(action.directory) + f"/step-{step:06d}")

    def restore_source(self, change: Change | None = None) -> Source | None:
        return self.newest
