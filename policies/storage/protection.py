"""Periodic checkpoints to storage, in the way of Varuna and TorchElastic.

Every ``every`` committed steps, or every ``every_s`` seconds of training, each layer is written once (by its first
holder) under the run's checkpoint directory, and the checkpoint counts only once its manifest is written (``runtime.state.checkpoint``), so a kill in the
middle leaves the previous one. The protection remembers which checkpoints completed; the newest is what a restart
restores from. A job resumed with ``train.resume_from`` starts with that checkpoint as its newest.

An interval in seconds runs on the machine's clock, not the wall's: every committed step advances it by the time the
job's machine predicts for a step of the plan it ran on (``Machine.step_s``), which is the time the simulator charges
for it. So a study whose iterations are five times faster checkpoints after five times as many steps, the same
interval on real processes and in the simulator, and a run's checkpoints do not depend on how loaded the host was.
A protection sees no clock of its backend (``tests/test_contract.py``): the machine is what both backends share.
Recovery pauses do not advance it: they add no training to protect.

A checkpoint that storage refuses is abandoned and training goes on; ``max_failed_saves`` in a row stop the job
(``runtime.core.failed_saves``).
"""

from __future__ import annotations

from ftlab.runtime.core.contract import (
    Action, Change, ConfigError, Job, MemoryRecord, Protection, SaveCheckpoint, Source, StorageSource,
)  # fmt: skip
from ftlab.runtime.core.failed_saves import FailedSaves, checkpoint_bytes
from ftlab.runtime.core.machine import Machine
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.core.scheduler import one_f_one_b


class StorageProtection(Protection):
    def __init__(self, settings: object) -> None:
        super().__init__(settings)
        self.directory = ""
        """Set by ``check``: the run's checkpoint directory."""
        self.newest: Source | None = None
        self._machine: Machine | None = None
        self._clock_s = 0.0
        """Seconds of training since the job started, on the machine's clock (``every_s``)."""
        self._step_s: tuple[int, float] | None = None
        """(generation, predicted step time) of the newest plan seen."""
        self.failures = FailedSaves(settings.max_failed_saves, 0, settings.keep)  # type: ignore[attr-defined]

    def check(self, job: Job) -> None:
        every, every_s = self.settings.every, self.settings.every_s
        if every is not None and every_s is not None:
            raise ConfigError(
                f"protection.every={every} and protection.every_s={every_s}: a checkpoint interval is in steps or in "
                f"seconds; add protection.every=null to checkpoint every {every_s} s, or leave out protection.every_s"
            )
        if every is None and every_s is None:
            raise ConfigError("protection.every and protection.every_s are both null: give the committed steps "
                              "(protection.every=5) or the seconds of training (protection.every_s=60) between checkpoints")  # fmt: skip
        if every is not None and every < 1:
            raise ConfigError(f"protection.every={every}: checkpoint every 1 or more committed steps")
        if every_s is not None and not every_s > 0:
            raise ConfigError(f"protection.every_s={every_s}: checkpoint every so many seconds of training, more than 0")
        if every_s is not None:
            self._machine = job.machine()
        if self.settings.keep < 1:
            raise ConfigError(f"protection.keep={self.settings.keep}: keep at least the newest checkpoint")
        if self.settings.max_failed_saves < 1:
            raise ConfigError(f"protection.max_failed_saves={self.settings.max_failed_saves}: let at least 1 "
                              f"checkpoint that storage refuses pass before the job stops")  # fmt: skip
        self.failures.one_bytes = checkpoint_bytes(job.specs, job.model.seq_len)
        self.directory = job.train.checkpoint_dir
        self.newest = job.start

    def after_commit(self, step: int, plan: Plan) -> list[Action]:
        if self.settings.every is not None:
            due = step % self.settings.every == 0
        else:
            interval = self.settings.every_s
            before = self._clock_s
            self._clock_s += self._predicted_step_s(plan)
            due = self._clock_s // interval > before // interval  # the clock crossed a multiple of the interval
        return [SaveCheckpoint(self.directory, self.settings.keep)] if due else []

    def _predicted_step_s(self, plan: Plan) -> float:
        """The machine's time for a step of ``plan``, asked once per plan. A plan whose workers serve several
        pipelines (ReCycle's reroutes) runs programs of its policy's own, which a protection does not see: it is
        charged the time of the plan before it."""
        if self._step_s is None or self._step_s[0] != plan.generation:
            assert self._machine is not None
            plain = len(plan.workers) == sum(len(p.stages) for p in plan.pipelines)
            if plain or self._step_s is None:
                self._step_s = (plan.generation, self._machine.step_s(plan, one_f_one_b(plan)))
        return self._step_s[1]

    def saved(self, action: Action, step: int, records: tuple[MemoryRecord, ...] = ()) -> None:
        assert isinstance(action, SaveCheckpoint)
        self.newest = StorageSource(step, str(action.directory) + f"/step-{step:06d}")
        self.failures.succeeded()

    def unsaved(self, action: Action, step: int, reason: str) -> str | None:
        newest = self.newest_on_storage()
        return self.failures.failed(step, reason, self.name, self.directory, newest.directory if newest else None)

    def newest_on_storage(self) -> StorageSource | None:
        return self.newest if isinstance(self.newest, StorageSource) else None

    def storage_footprint(self) -> tuple[int, bool]:
        return self.settings.keep, self.settings.allow_low_space

    def restore_source(self, change: Change | None = None) -> Source | None:
        return self.newest
