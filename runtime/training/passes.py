"""One micro-batch's forward and backward on one stage: the full backward, or its two decoupled halves.

Decoupled backward (ReCycle's design 2, Zero Bubble) splits a stage's backward into the input gradient, which the
previous stage waits for, and the weight gradients, which nobody waits for and can fill a bubble later. Autograd
runs only the products that the requested gradients need, which gives both halves without changing the model:

- the forward notes the output of every module that owns parameters (a linear map, a norm, an embedding);
- ``backward_input`` asks autograd for the gradients of the stage input and of those outputs: they all lie on the
  input-gradient path, so the walk computes each operation's input gradient and skips every weight-gradient
  product (an ``addmm``'s second operand, a norm's scale), and the graph is kept;
- ``backward_weight`` runs, for each noted output, the backward from its gradient to its own module's parameters
  only: one short walk inside the module that computes just the weight-gradient products (for a linear map,
  ``x^T dy`` and the bias sum), and frees that part of the graph.

The halves therefore cost about one full backward between them, as the cost model assumes (``runtime.core.costs``:
``bwd_input_s + bwd_weight_s`` is one backward); every weight gradient comes from the same output gradient by the
same product as in the full backward, so a decoupled schedule trains like a fused one (``tests/test_passes.py``
holds them equal for every model family). It relies on each parameter being used only inside the forward of the
module that owns it (no weights tied across modules), which every layer of ``runtime.training.model_families`` satisfies.
The price is memory: a micro-batch keeps its noted outputs' gradients from ``backward_input`` to
``backward_weight``, which is why schedules decouple only where a bubble is worth it.

With activation checkpointing (``train.activation_checkpointing``) the stage's forward runs under
``torch.utils.checkpoint`` (non-reentrant): only its input is kept, and the backward recomputes the forward first.
Recomputation replays the same operations on the same inputs (and the same random state), so losses and gradients
are those without it; the noted outputs stay in the graph, so a decoupled backward works alike.

Mixed precision (``runtime.training.mixed``): every layer's output but the head's leaves in the compute precision
(``dtype``), and on the last stage the backward starts from ``loss_seed`` (fp16's loss scale) instead of 1, so the
gradients are scaled by it while the reported loss is not.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ftlab.runtime.training.mixed import layer_outputs_cast
from ftlab.runtime.training.model import StageModule


@dataclass
class MicroBatch:
    """What a stage keeps of one micro-batch from its forward to its weight gradients."""

    input: torch.Tensor
    """Token ids on the first stage; elsewhere the received activation, which requires its gradient."""
    result: torch.Tensor
    """What the forward produced: the activation to send, or the loss scaled to its share of the global batch."""
    noted: list[tuple[torch.Tensor, list[nn.Parameter]]] = field(default_factory=list)
    """The output of each call of a module that owns parameters, with those parameters."""
    grad: torch.Tensor | None = None
    """The gradient of ``result`` from the next stage (None on the last stage, whose result is the loss)."""
    noted_grads: list[torch.Tensor | None] | None = None
    """The gradient of each noted output, once ``backward_input`` ran."""


class StagePasses:
    def __init__(
        self, stage: StageModule, loss_scale: float, checkpointing: bool = False, dtype: torch.dtype = torch.float32
    ) -> None:
        self.stage = stage
        self.loss_scale = loss_scale
        self.checkpointing = checkpointing
        self.dtype = dtype
        self.loss_seed = 1.0
        """The gradient the last stage's backward starts from: fp16's loss scale of the step, else 1."""
        body = range(stage.start, stage.stop - 1 if stage.is_last else stage.stop)
        self._body = [stage.layer(index) for index in body]
        """The layers whose output crosses a layer boundary (every one but the head, which returns the loss)."""
        self._owners = {
            module: own for module in stage.modules() if (own := list(module.parameters(recurse=False)))
        }

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None) -> MicroBatch:
        noted: list[tuple[torch.Tensor, list[nn.Parameter]]] = []

        def note(module: nn.Module, _args: object, output: object) -> None:
            noted.extend((t, self._owners[module]) for t in _tensors(output) if t.requires_grad)

        # Hooks for this call only: an executor lives one generation, the layers longer.
        handles = [module.register_forward_hook(note) for module in self._owners]
        try:
            if self.checkpointing:
                out = checkpoint(self._run, x, labels, use_reentrant=False)
            else:
                out = self._run(x, labels)
        finally:
            for handle in handles:
                handle.remove()
        result = out * self.loss_scale if self.stage.is_last else out
        return MicroBatch(x, result, noted)

    def _run(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The stage's forward, its layer outputs cast (again when a checkpointed forward is recomputed)."""
        with layer_outputs_cast(self._body, self.dtype):
            return self.stage(x, labels)

    def backward(self, mb: MicroBatch) -> torch.Tensor | None:
        """Input and weight gradients in one walk; returns the input gradient (None on the first stage)."""
        mb.noted.clear()
        torch.autograd.backward(mb.result, grad_tensors=self._output_grad(mb))
        return mb.input.grad if mb.input.requires_grad else None

    def backward_input(self, mb: MicroBatch) -> torch.Tensor | None:
        """The input gradient now; the noted outputs' gradients are kept for ``backward_weight``."""
        wants_input = mb.input.requires_grad
        wrt = ([mb.input] if wants_input else []) + [t for t, _ in mb.noted]
        grads = list(
            torch.autograd.grad(mb.result, wrt, grad_outputs=self._output_grad(mb), retain_graph=True, allow_unused=True)
        )
        input_grad = grads.pop(0) if wants_input else None
        mb.noted_grads = grads
        return input_grad

    def _output_grad(self, mb: MicroBatch) -> torch.Tensor | None:
        """The received gradient, or on the last stage the loss seed (None: autograd's implicit 1)."""
        if mb.grad is not None or self.loss_seed == 1.0:
            return mb.grad
        return torch.full_like(mb.result, self.loss_seed)

    def backward_weight(self, mb: MicroBatch) -> None:
        """Every module's weight gradients from its output's gradient; frees the micro-batch's graph."""
        if mb.noted_grads is None:
            raise RuntimeError("BackwardWeight needs the BackwardInput of the same micro-batch first")
        for (output, params), grad in reversed(list(zip(mb.noted, mb.noted_grads))):
            if grad is not None:
                torch.autograd.backward(output, grad_tensors=grad, inputs=params)
        mb.noted.clear()
        mb.noted_grads = None


def _tensors(output: object) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
