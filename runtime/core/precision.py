"""Mixed precision and the update's numerics, as settings: what ``train.precision``, ``train.grad_clip`` and fp16's
loss-scale keys may be, and what they change in the bytes a job moves. No torch: preflight and the cost model read it.

The design (the worker's side is ``runtime.training.mixed``, the coordinator's ``runtime.control.update``):

- **Master weights stay fp32.** bf16 and fp16 compute under ``torch.autocast``; a layer's parameters, its gradients
  and AdamW's moments stay fp32, so what a layer owns -- what transfers, storage checkpoints and REFT snapshots carry
  -- is the same in every precision. Autocast casts each weight to the compute precision once per iteration (its
  cast cache lives for the iteration), which is the only half-precision copy of the weights a stage holds.
- **Activations travel in the compute precision.** Every layer's output (the head's loss aside) is cast to the
  compute precision, wherever the stage boundaries lie, so a pipeline of any depth computes what one process
  computes and a stage boundary moves half the bytes of fp32. Their gradients arrive in the same precision.
- **Gradients are reduced in fp32**: autocast's backward gives a fp32 parameter its gradient in fp32, and the replicas
  sum those, as in fp32 training.
- **Global clipping and fp16's overflow check need the whole model.** Each worker reports the squared L2 norm of
  its reduced gradient per layer (under ZeRO-1 per chunk of its group) in its Ready; the coordinator adds them in
  layer order and answers in the Commit the factor every worker multiplies its gradients by before stepping (the
  clip coefficient, over fp16's loss scale) or that the step is skipped.
"""

from __future__ import annotations

from typing import Protocol

from ftlab.runtime.core.devices import DeviceSpec

PRECISIONS: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
"""Bytes of one element in each compute precision: of an activation, an activation gradient, a weight copy. tf32
keeps fp32 tensors (only a GPU's matmuls round their inputs), so it is fp32 for every byte and needs no autocast."""
FP32_BYTES = 4
MAX_SCALE_POWER = 64
"""2**64 is far past any gradient fp16 could hold; a larger initial_scale_power is a typo."""


class TrainNumerics(Protocol):
    """The ``train.*`` settings this module reads (``runtime.core.config.TrainConfig``)."""

    precision: str
    grad_clip: float
    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    min_loss_scale: float
    max_skipped_steps: int


def activation_scale(precision: str) -> float:
    """Bytes of an activation in ``precision`` over its bytes in fp32 (the model specs count fp32)."""
    return PRECISIONS[precision] / FP32_BYTES


def autocasts(precision: str) -> bool:
    """Whether ``precision`` computes under autocast, in half-precision tensors (fp32 and tf32 keep fp32 tensors)."""
    return PRECISIONS[precision] < FP32_BYTES


def needs_norms(t: TrainNumerics) -> bool:
    """Whether workers report their gradients' norms: clipping needs the global norm, fp16 checks it for overflow."""
    return t.grad_clip > 0 or t.precision == "fp16"


def numerics_problems(t: TrainNumerics, device: DeviceSpec | None = None) -> list[str]:
    """Each setting no job can run with (on ``device``, a GPU type's spec where the job plans for one), as
    ``train.name=value: what to do``. The CPU runs every precision (autocast has bf16 and fp16 kernels; tf32 computes
    as fp32 there)."""
    if t.precision not in PRECISIONS:
        return [f"train.precision={t.precision!r}: use one of {', '.join(PRECISIONS)}"]
    bad = []
    if device is not None and not device.computes(t.precision):
        computed = [p for p in PRECISIONS if device.computes(p)]
        bad.append(f"train.precision={t.precision}: a {device.name} does not compute {t.precision}; use "
                   f"train.precision={' or '.join(computed)}")  # fmt: skip
    if not t.grad_clip >= 0 or t.grad_clip == float("inf"):
        bad.append(f"train.grad_clip={t.grad_clip}: give the max global gradient norm (> 0), or 0 for no clipping")
    if t.precision != "fp16":
        return bad
    if not t.loss_scale >= 0 or t.loss_scale == float("inf"):
        bad.append(f"train.loss_scale={t.loss_scale}: use 0 (dynamic loss scaling) or a static scale > 0")
    if not 0 <= t.initial_scale_power <= MAX_SCALE_POWER:
        bad.append(f"train.initial_scale_power={t.initial_scale_power}: use 0 to {MAX_SCALE_POWER} (DeepSpeed's "
                   f"default is 16)")  # fmt: skip
    if t.loss_scale_window < 1:
        bad.append(f"train.loss_scale_window={t.loss_scale_window}: give the steps without overflow before the scale "
                   f"grows, at least 1")  # fmt: skip
    if t.hysteresis < 1:
        bad.append(f"train.hysteresis={t.hysteresis}: give the overflows tolerated before the scale halves, at least 1")
    if not 0 < t.min_loss_scale <= 2.0**t.initial_scale_power:
        bad.append(f"train.min_loss_scale={t.min_loss_scale}: use a scale > 0 and at most the first scale "
                   f"2**train.initial_scale_power")  # fmt: skip
    if t.max_skipped_steps < 1:
        bad.append(f"train.max_skipped_steps={t.max_skipped_steps}: give the consecutive overflow-skipped steps "
                   f"after which the job stops, at least 1")  # fmt: skip
    return bad
