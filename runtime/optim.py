"""Per-layer AdamW and a stateless learning-rate schedule.

Each layer owns its optimizer, so a layer moves between workers with exactly its own state. The schedule is a pure
function of the step, so it "travels" with nothing to copy. AdamW is element-wise, so per-layer optimizers give
exactly the update of one optimizer over the whole model. There is no global gradient-norm clipping: it would need a
reduction over every layer of the model on every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    weight_decay: float
    beta1: float
    beta2: float


def lr_at(step: int, s: OptimSettings) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``total_steps``."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    span = max(1, s.total_steps - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / span)
    return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))


def layer_optimizer(layer: torch.nn.Module, s: OptimSettings) -> torch.optim.AdamW:
    # The fused kernel is the fastest on CPU and GPU alike. Every layout groups parameters by layer in the same way,
    # so every layout takes exactly the same optimizer steps.
    return torch.optim.AdamW(
        layer.parameters(), lr=s.lr, betas=(s.beta1, s.beta2), weight_decay=s.weight_decay, fused=True
    )


def step_all(optimizers: dict[int, torch.optim.Optimizer], step: int, s: OptimSettings) -> None:
    lr = lr_at(step, s)
    for opt in optimizers.values():
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=False)
