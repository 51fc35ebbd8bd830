"""Saves to storage that fail: what one checkpoint takes, and how many failed saves in a row a protection lets pass.

A save that storage refuses (a full disk, an I/O error, a folder that became read-only) is abandoned whole and costs
no committed step, so training goes on: the disk may be freed meanwhile, and the previous checkpoint still protects
the job. Every failed save widens the gap a failure would cost, though, so after ``max_failed_saves`` in a row the
protection stops the job, saying how much room the next checkpoint needs and where to resume from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ftlab.runtime.core.costs import LayerProfile, layer_bytes
from ftlab.runtime.core.model_spec import LayerSpec

MIB = 2**20


def checkpoint_bytes(specs: Sequence[LayerSpec], seq_len: int) -> int:
    """One checkpoint of the whole model (every layer's weights and AdamW moments, once), from the layer specs
    alone: no profile is measured for it. The files add a few kilobytes of framing per layer."""
    return int(sum(LayerProfile(0.0, 0.0, 0.0, **layer_bytes(spec, 1, seq_len)).checkpoint_bytes for spec in specs))


@dataclass
class FailedSaves:
    """The failed saves in a row of one protection (``protection.max_failed_saves``)."""

    limit: int
    one_bytes: int
    """What the next checkpoint needs (``checkpoint_bytes``)."""
    kept: int
    """Checkpoints the protection keeps on storage beside the one being written (``protection.keep``)."""
    steps: list[int] = field(default_factory=list)

    def failed(self, step: int, reason: str, protection: str, directory: str, resume_from: str | None) -> str | None:
        """Count the failed save of ``step``; the message that stops the job once ``limit`` failed in a row."""
        self.steps.append(step)
        if len(self.steps) < self.limit:
            return None
        resume = (f"resume with train.resume_from={resume_from}" if resume_from is not None
                  else "start the job again (no checkpoint of it was written)")  # fmt: skip
        return (
            f"protection={protection}: {len(self.steps)} checkpoints in a row could not be written (steps "
            f"{', '.join(map(str, self.steps))}; the last: {reason}). The next one needs "
            f"{self.one_bytes / MIB:.1f} MiB in {directory}, {(self.kept + 1) * self.one_bytes / MIB:.1f} MiB with "
            f"the {self.kept} kept beside it (protection.keep): free that much there or give train.checkpoint_dir on "
            f"a larger disk, and {resume}"
        )

    def succeeded(self) -> None:
        self.steps.clear()
