"""The worker's side of mixed precision and of the update the coordinator decides (``runtime.core.precision`` has
the design, ``runtime.control.update`` the coordinator's side).

- ``autocast``: one autocast region around a whole iteration (forward and backward passes), so that each fp32
  weight is cast to the compute precision once per iteration (autocast's cast cache lives as long as the region)
  rather than once per micro-batch. tf32 has no autocast: on CUDA the region lets matmuls and convolutions use TF32
  tensor cores; on a CPU it computes as fp32.
- ``layer_outputs_cast``: every layer's output but the head's loss leaves in the compute precision, wherever the
  stage boundaries lie, so every layout computes the same numbers and a boundary carries half-precision bytes.
- ``grad_sq``: the squared L2 norm of each piece of the model this worker holds, in float64 from the fp32
  gradients (a square of a float32 is exact in float64), reported in the Ready.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ftlab.runtime.core.precision import autocasts

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
}  # fmt: skip


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    if precision == "tf32" and device.type == "cuda":
        return _tf32()
    if not autocasts(precision):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


@contextlib.contextmanager
def _tf32() -> Iterator[None]:
    """TF32 matmuls and convolutions while inside; PyTorch's settings as they were after."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@contextlib.contextmanager
def layer_outputs_cast(layers: Iterable[nn.Module], dtype: torch.dtype) -> Iterator[None]:
    """While inside, each of ``layers`` returns its output in ``dtype`` (fp32: nothing changes)."""
    if dtype == torch.float32:
        yield
        return

    def cast(_module: nn.Module, _args: object, output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype)

    handles = [layer.register_forward_hook(cast) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def square_sum(tensors: Iterable[torch.Tensor]) -> float:
    """The sum of the squares of every element, in float64."""
    return float(sum(torch.sum(t.detach().double().square()) for t in tensors))


def grad_sq(layers: dict[int, nn.Module], chunks: dict[int, tuple[int, torch.Tensor]]) -> dict[tuple[int, int], float]:
    """Each piece's squared gradient norm: ``(layer, 0)`` for every layer in ``layers``, ``(first layer, chunk)``
    for every ZeRO-1 group in ``chunks`` (first layer of the group -> this member's chunk index and gradient)."""
    pieces = {(index, 0): square_sum(p.grad for p in layer.parameters()) for index, layer in layers.items()}
    pieces.update({(first, chunk): square_sum([grad]) for first, (chunk, grad) in chunks.items()})
    return pieces


def scale_gradients(optimizers: dict[int, torch.optim.Optimizer], factor: float) -> None:
    """Multiply every gradient the optimizers step by ``factor`` (the Commit's update; 1 leaves them untouched)."""
    if factor == 1.0:
        return
    with torch.no_grad():
        for opt in optimizers.values():
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(factor)
