"""Decoupled backward (BackwardInput, then BackwardWeight) computes what the full backward computes.

For every model family, each stage shape a pipeline has (first, middle, last, the whole model) runs two micro-batches
through its forward; one copy of the stage takes full backward passes, another the decoupled halves with the
weight halves deferred and swapped in order, as a ReCycle schedule may. Input gradients and accumulated weight
gradients must agree to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from ftlab.runtime.training.model import StageModule, build_layer
from ftlab.runtime.core.model_spec import ModelConfig, num_layers
from ftlab.runtime.training.passes import StagePasses

FAMILIES = ["gpt2", "llama", "bert"]


def config(family: str) -> ModelConfig:
    return ModelConfig(name=f"{family}-test", family=family, num_blocks=3, hidden=32, heads=4, vocab_size=50,
                       seq_len=12, kv_heads=2 if family == "llama" else None)  # fmt: skip


CFG = config("gpt2")
LAYERS = num_layers(CFG)  # embedding, 3 blocks, head


def stage(start: int, stop: int, cfg: ModelConfig = CFG, checkpointing: bool = False) -> StagePasses:
    module = StageModule(cfg, {i: build_layer(cfg, i, seed=7) for i in range(start, stop)})
    return StagePasses(module, 0.25, checkpointing)


def inputs(start: int, mb: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(mb)
    if start == 0:
        return torch.randint(CFG.vocab_size, (2, CFG.seq_len), generator=generator)
    return torch.randn(2, CFG.seq_len, CFG.hidden, generator=generator).requires_grad_()


def run(passes: StagePasses, decoupled: bool) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
    start, stop = passes.stage.start, passes.stage.stop
    labels = [torch.randint(CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(9 + m))
              for m in range(2)]  # fmt: skip
    micro = [passes.forward(inputs(start, m), labels[m] if stop == LAYERS else None) for m in range(2)]
    for m, mb in enumerate(micro):
        if stop < LAYERS:
            mb.grad = torch.randn(mb.result.shape, generator=torch.Generator().manual_seed(20 + m))
    if decoupled:
        input_grads = [passes.backward_input(mb) for mb in micro]
        for mb in reversed(micro):
            passes.backward_weight(mb)
    else:
        input_grads = [passes.backward(mb) for mb in micro]
    return input_grads, {name: p.grad for name, p in passes.stage.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("start", "stop"), [(0, 2), (1, 4), (2, LAYERS), (0, LAYERS), (1, 2)])
def test_decoupled_backward_equals_the_full_backward(family: str, start: int, stop: int) -> None:
    cfg = config(family)
    full_inputs, full = run(stage(start, stop, cfg), decoupled=False)
    split_inputs, split = run(stage(start, stop, cfg), decoupled=True)
    for a, b in zip(full_inputs, split_inputs):
        if start == 0:
            assert a is None and b is None, "token ids have no gradient"
        else:
            torch.testing.assert_close(b, a, rtol=0, atol=1e-7)
    assert full.keys() == split.keys()
    for name, grad in full.items():
        assert grad is not None
        torch.testing.assert_close(split[name], grad, rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("decoupled", [False, True])
def test_activation_checkpointing_recomputes_the_same_gradients(family: str, decoupled: bool) -> None:
    cfg = config(family)
    plain_inputs, plain = run(stage(1, 4, cfg), decoupled=False)
    kept_inputs, kept = run(stage(1, 4, cfg, checkpointing=True), decoupled=decoupled)
    for a, b in zip(plain_inputs, kept_inputs):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-7)
    for name, grad in plain.items():
        torch.testing.assert_close(kept[name], grad, rtol=0, atol=1e-7, msg=name)


def test_backward_weight_needs_backward_input_first() -> None:
    passes = stage(1, 3)
    mb = passes.forward(inputs(1, 0), None)
    mb.grad = torch.ones_like(mb.result)
    with pytest.raises(RuntimeError, match="needs the BackwardInput"):
        passes.backward_weight(mb)
