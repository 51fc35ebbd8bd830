"""The coordinator's part of each update: the global gradient norm, the clip coefficient and fp16's loss scale.

Workers report, in their Ready, the squared L2 norm of their reduced gradients per piece of the model: a layer
(``(layer, 0)``), or under ZeRO-1 a chunk of a group of layers (``(first layer of the group, chunk)``); replicas of a
piece report the same value and one is taken. ``UpdateRule.decide`` adds the pieces with ``math.fsum`` (exactly
rounded, so neither the order nor the grouping of the pieces changes the total) and answers the ``Update`` the
Commit carries: the factor every worker multiplies its gradients by before its optimizer step, or that the step is
skipped. Because it travels in the Commit, a kill at any phase of an iteration leaves nothing decided: an aborted
iteration is redone from the committed state with the committed scale.

Clipping is ``torch.nn.utils.clip_grad_norm_``'s over the whole model: ``coef = grad_clip / (norm + 1e-6)``, applied
when below 1. With fp16 the gradients are scaled by the loss scale S; the norm is the scaled one over S, and the
factor is ``min(1, coef) / S``: unscaling and clipping in one multiplication (DeepSpeed does them one after the other;
S is a power of two, so the unscaling alone is exact either way).

fp16's dynamic loss scaling is DeepSpeed's ``DynamicLossScaler`` (without ``consecutive_hysteresis``, as DeepSpeed's
engine builds it): an overflow (a norm that is not finite) skips the step and, once ``hysteresis`` overflows are
used up, halves the scale (never below ``min_loss_scale``); ``loss_scale_window`` steps without an overflow double
it and restore the hysteresis. A static scale (``train.loss_scale > 0``) never changes, but an overflow still skips
the step (DeepSpeed's static scaler would apply it). Choices:

- A skipped step commits with no update on any worker: the step counter, the data and the learning-rate schedule
  move on (the schedule is a function of the step; DeepSpeed holds its scheduler back on a skipped step, so the
  schedules differ by the skipped steps), and AdamW's own step count does not.
- ``train.max_skipped_steps`` consecutive skips, or an overflow at ``min_loss_scale`` (where DeepSpeed raises),
  stop the job with the reason; so does a norm that is not finite in fp32 or bf16, which no scale can help.
- The scaler's state is committed state: ``UpdateRule`` keeps it per committed step, a decision that resumes from an
  earlier step (a restore from storage or REFT) rewinds it (``rewind``), and storage checkpoints record it in their
  manifest (``manifest``) for ``train.resume_from``. Its count of every skipped step is committed state too, so a
  step redone after a rewind is not counted twice.

What each committed update was (``StepNumerics``: the global norm, the loss scale, the skipped steps so far) is what
``committed`` answers, for the coordinator to report with the step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from ftlab.runtime.core.precision import TrainNumerics, needs_norms

EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s guard against a zero norm."""
MANIFEST_KEY = "loss_scaler"

Piece = tuple[int, int]
"""(layer, 0) for a whole layer; (first layer of a ZeRO-1 group, chunk index) for a chunk."""


@dataclass(frozen=True)
class Update:
    """What the Commit tells every worker to do with its reduced gradients."""

    factor: float = 1.0
    """Multiply the gradients by this before the optimizer step (1: leave them as they are)."""
    skip: bool = False
    """No optimizer step anywhere: the step commits with no update (an fp16 overflow)."""


@dataclass(frozen=True)
class ScalerState:
    """DeepSpeed's DynamicLossScaler's fields, the consecutive skips and all of them."""

    scale: float = 1.0
    hysteresis: int = 1
    iteration: int = 0
    last_overflow: int = -1
    skipped: int = 0
    skipped_total: int = 0
    """Every step skipped since training began (a checkpoint's count goes on in the job that resumes it)."""


@dataclass(frozen=True)
class StepNumerics:
    """A committed update as the run records it (a step whose workers reported their gradients' norms)."""

    grad_norm: float | None
    """The global gradient norm, unscaled, before clipping; None for a skipped step (it was not finite)."""
    loss_scale: float | None
    """fp16: the loss scale the step ran with."""
    skipped_steps: int | None
    """fp16: steps skipped since training began, this one included."""


class UpdateStopped(RuntimeError):
    """The updates cannot go on (too many overflows, a gradient that is not finite): the message says why and what
    to change."""


class UpdateRule:
    def __init__(self, t: TrainNumerics, start_step: int, start: ScalerState | None = None) -> None:
        self.t = t
        self.norms = needs_norms(t)
        """Whether workers report their norms at all."""
        first = ScalerState()
        if t.precision == "fp16":
            first = ScalerState(scale=t.loss_scale or 2.0**t.initial_scale_power, hysteresis=t.hysteresis)
        self._states = {start_step: start or first}
        """The scaler's state before each step, from the first one this job runs to the next one."""
        self._next: tuple[int, ScalerState, float | None] | None = None
        """The step decided last, the scaler's state after it and its unscaled norm (None: no norms reported)."""

    def loss_scale(self, step: int) -> float:
        return self._states[step].scale

    def decide(self, step: int, grad_sq: Mapping[Piece, float] | None) -> Update:
        """The update of ``step`` from the workers' squared norms (None: nobody computes, as in the simulator)."""
        state = self._states[step]
        if not self.norms or grad_sq is None:
            self._next = step, state, None
            return Update()
        scaled = math.sqrt(math.fsum(grad_sq[piece] for piece in sorted(grad_sq)))
        if self.t.precision != "fp16":
            if not math.isfinite(scaled):
                raise UpdateStopped(f"the gradient's norm is {scaled} at step {step}: the model diverged; lower "
                                    f"train.lr or set train.grad_clip")  # fmt: skip
            self._next = step, state, scaled
            return Update(factor=self._clip(scaled))
        if not math.isfinite(scaled):
            after = self._overflow(step, state)
            self._next = step, after, scaled
            return Update(skip=True)
        self._next = step, self._no_overflow(state), scaled / state.scale
        return Update(factor=self._clip(scaled / state.scale) / state.scale)

    def committed(self, step: int) -> StepNumerics | None:
        """``step`` committed with the update ``decide`` answered last: what that update was, when the workers
        reported their norms (None otherwise: nothing was measured)."""
        assert self._next is not None and self._next[0] == step, f"step {step} committed with no update decided"
        _, after, norm = self._next
        self._states[step + 1] = after
        self._next = None
        if self._states[step + 1].skipped >= self.t.max_skipped_steps:
            raise UpdateStopped(
                f"{self.t.max_skipped_steps} consecutive steps up to step {step} were skipped because fp16 gradients "
                f"overflowed (train.max_skipped_steps): use train.precision=bf16, a lower "
                f"{'train.loss_scale' if self.t.loss_scale > 0 else 'train.initial_scale_power'} or train.lr, or "
                f"check the model and data for values fp16 cannot hold"
            )
        if norm is None:
            return None
        fp16 = self.t.precision == "fp16"
        return StepNumerics(
            grad_norm=norm if math.isfinite(norm) else None,
            loss_scale=self._states[step].scale if fp16 else None,
            skipped_steps=after.skipped_total if fp16 else None,
        )

    def rewind(self, step: int) -> None:
        """Training resumes from committed ``step``: the scaler is as it was then."""
        self._next = None
        if step not in self._states:
            raise RuntimeError(f"no loss-scaler state of step {step}: it was never committed in this job")

    def manifest(self, step: int) -> dict[str, Any]:
        """What a storage checkpoint of ``step`` records of the scaler (fp16 only)."""
        return {MANIFEST_KEY: asdict(self._states[step])} if self.t.precision == "fp16" else {}

    # -- helpers -----------------------------------------------------------------------------------------------------
    def _clip(self, norm: float) -> float:
        if self.t.grad_clip <= 0:
            return 1.0
        coef = self.t.grad_clip / (norm + EPS)
        return coef if coef < 1.0 else 1.0

    def _overflow(self, step: int, s: ScalerState) -> ScalerState:
        after = replace(s, iteration=s.iteration + 1, last_overflow=s.iteration, skipped=s.skipped + 1,
                        skipped_total=s.skipped_total + 1)  # fmt: skip
        if self.t.loss_scale > 0:
            return after
        if s.hysteresis > 1:
            return replace(after, hysteresis=s.hysteresis - 1)
        if s.scale <= self.t.min_loss_scale:
            raise UpdateStopped(
                f"fp16 gradients overflowed at step {step} with the loss scale at its minimum "
                f"(train.min_loss_scale={self.t.min_loss_scale}): use train.precision=bf16, a lower "
                f"train.min_loss_scale or train.lr, or check the model and data for values fp16 cannot hold"
            )
        return replace(after, scale=max(s.scale / 2, self.t.min_loss_scale))

    def _no_overflow(self, s: ScalerState) -> ScalerState:
        after = replace(s, iteration=s.iteration + 1, skipped=0)
        stable = s.iteration - s.last_overflow - 1
        if self.t.loss_scale == 0 and stable > 0 and stable % self.t.loss_scale_window == 0:
            return replace(after, scale=s.scale * 2, hysteresis=self.t.hysteresis)
        return after


def scaler_from_manifest(manifest: Mapping[str, Any]) -> ScalerState | None:
    """The scaler state a storage checkpoint recorded, if any."""
    recorded = manifest.get(MANIFEST_KEY)
    return ScalerState(**recorded) if recorded is not None else None
