"""Per-layer Adam or AdamW and a stateless learning-rate schedule.

Each layer owns its optimizer, so a layer moves between workers with exactly its own state. The schedule is a pure
function of the step, so it "travels" with nothing to copy. Adam(W) is element-wise, so per-layer optimizers give
exactly the update of one optimizer over the whole model. There is no global gradient-norm clipping: it would need a
reduction over every layer of the model on every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ftlab.runtime.core.config import TrainConfig


@dataclass(frozen=True)
class OptimSettings:
    """The ``train.*`` settings of the optimizer and the schedule (``runtime.core.config.TrainConfig``)."""

    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    optimizer: str = "adamw"
    eps: float = 1e-8
    schedule: str = "cosine"
    warmup_type: str = "log"
    warmup_min_lr: float = 0.0
    warmup_min_ratio: float = 0.0
    cos_min_ratio: float = 1e-4
    decay_steps: int | None = None
    """None: total_steps."""

    @classmethod
    def of(cls, t: TrainConfig) -> OptimSettings:
        return cls(
            t.lr, t.min_lr, t.warmup_steps, t.steps, t.weight_decay, t.beta1, t.beta2, t.optimizer, t.eps,
            t.lr_schedule, t.warmup_type, t.warmup_min_lr, t.warmup_min_ratio, t.cos_min_ratio, t.decay_steps,
        )  # fmt: skip


def lr_at(step: int, s: OptimSettings) -> float:
    """The learning rate of optimizer step ``step`` (0 is the first).

    ``cosine``: linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``total_steps``. DeepSpeed's schedules:
    what its scheduler holds when step ``step`` is taken. DeepSpeed builds the scheduler before the first step (its
    constructor writes the rate of iteration -1 into the optimizer) and steps it after every optimizer step, so step
    ``step`` runs at the scheduler's iteration ``step - 1``; the formulas are ``deepspeed.runtime.lr_schedules``'s,
    term for term, so the rates are equal to the last bit (``tests/test_deepspeed_config.py``).
    """
    if s.schedule == "cosine":
        if step < s.warmup_steps:
            return s.lr * (step + 1) / s.warmup_steps
        span = max(1, s.total_steps - s.warmup_steps)
        progress = min(1.0, (step - s.warmup_steps) / span)
        return s.min_lr + 0.5 * (s.lr - s.min_lr) * (1 + math.cos(math.pi * progress))
    iteration = step - 1
    warmup = max(2, s.warmup_steps)  # as DeepSpeed: a log warm-up over fewer than 2 steps would divide by log(1)
    total = s.total_steps if s.decay_steps is None else s.decay_steps
    if s.schedule == "WarmupCosineLR":
        if iteration < 0:
            return 0.0
        if iteration < warmup:
            gamma = _warmup_gamma(iteration, warmup, s.warmup_type)
            return s.lr * (s.warmup_min_ratio + gamma * (1.0 - s.warmup_min_ratio))
        progress = min(1.0, (iteration - warmup + 1) / max(1, total - warmup))
        return s.lr * max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * ((1 + math.cos(math.pi * progress)) / 2))
    if iteration < 0:
        return s.warmup_min_lr
    if iteration < warmup:
        gamma = _warmup_gamma(iteration, warmup, s.warmup_type)
    elif s.schedule == "WarmupDecayLR":
        gamma = max(0.0, float(total - iteration) / float(max(1.0, total - warmup)))
    else:  # WarmupLR
        gamma = 1.0
    return s.warmup_min_lr + ((s.lr - s.warmup_min_lr) * gamma)


def _warmup_gamma(iteration: int, warmup: int, kind: str) -> float:
    """How far DeepSpeed's warm-up has come at ``iteration``: 0 at the start, towards 1 at ``warmup``."""
    if kind == "log":
        return 1.0 / math.log(warmup) * math.log(iteration + 1)
    return iteration / warmup


def layer_optimizer(layer: torch.nn.Module, s: OptimSettings) -> torch.optim.Optimizer:
    # The fused kernel is the fastest on CPU and GPU alike. Every layout groups parameters by layer in the same way,
    # so every layout takes exactly the same optimizer steps. Adam adds weight_decay * weight to the gradient (L2),
    # AdamW shrinks the weight apart from it (decoupled): DeepSpeed offers both, under adam_w_mode.
    kind = torch.optim.AdamW if s.optimizer == "adamw" else torch.optim.Adam
    return kind(
        layer.parameters(), lr=s.lr, betas=(s.beta1, s.beta2), eps=s.eps, weight_decay=s.weight_decay, fused=True
    )


class StepUndo:
    """What undoes an optimizer step taken before its iteration committed (the staggered optimizer).

    AdamW changes the weights and both moments in place, and no arithmetic gives the old values back bit for bit, so
    the state from before the step is copied aside: into buffers allocated once and reused while the layers stay the
    same (a copy into memory already touched runs several times faster than into fresh pages). A layer whose
    optimizer had no state yet (its first step) gets none back, exactly as before.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._fresh: list[tuple[torch.optim.Optimizer, torch.Tensor]] = []
        self.armed = False

    def save(self, optimizers: dict[int, torch.optim.Optimizer]) -> None:
        live: list[torch.Tensor] = []
        self._fresh = []
        for opt in optimizers.values():
            for group in opt.param_groups:
                for p in group["params"]:
                    state = opt.state.get(p)
                    if not state:
                        self._fresh.append((opt, p))
                    live.append(p.data)
                    live.extend(v for v in (state or {}).values() if isinstance(v, torch.Tensor))
        if [b.shape for b in self._buffers] != [t.shape for t in live]:
            self._buffers = [torch.empty_like(t) for t in live]
        for buffer, tensor in zip(self._buffers, live):
            buffer.copy_(tensor)
        self._saved = list(zip(live, self._buffers))
        self.armed = True

    def restore(self) -> None:
        """Put back the state of the last ``save``."""
        assert self.armed, "nothing to undo"
        with torch.no_grad():
            for tensor, buffer in self._saved:
                tensor.copy_(buffer)
        for opt, p in self._fresh:
            opt.state.pop(p, None)
        self.discard()

    def discard(self) -> None:
        """The step committed: keep it."""
        self.armed = False
        self._saved, self._fresh = [], []


def step_all(optimizers: dict[int, torch.optim.Optimizer], step: int, s: OptimSettings) -> None:
    lr = lr_at(step, s)
    for opt in optimizers.values():
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=False)
