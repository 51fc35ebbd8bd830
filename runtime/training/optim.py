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
