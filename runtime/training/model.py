"""The model's real layers, as workers build and run them: embedding, transformer blocks, head.

A pipeline stage holds a contiguous range of layers. Policies and the simulator reason about layers through
``runtime.core.model_spec`` (sizes and costs from the config alone); workers build the real layers with `build_layer`,
whose weights depend on (config, seed, layer index) alone, so every pipeline layout starts from the same model and
trains identically. An HF model with ``model.weights`` starts from the checkpoint's tensors instead
(``runtime.training.hf_weights``), which depend on the layer index alone.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from transformers.initialization import no_init_weights

from ftlab.runtime.core.model_spec import ModelConfig, layer_kind, num_layers
from ftlab.runtime.training.hf_weights import load_layer
from ftlab.runtime.training.model_families import FAMILIES, hf_config

INIT_STD = 0.02  # GPT-2's initialisation, used for every family


def _construct(cfg: ModelConfig, index: int) -> nn.Module:
    """The layer's module on the current default device, its parameters allocated but not initialised: every one is
    drawn by `_initialise` or read from a checkpoint next, so `torch.nn`'s default initialisation would be wasted
    (about half of a block's build time). Buffers (rotary frequencies, masks) are computed as usual."""
    hf = hf_config(cfg)
    family = FAMILIES[hf.model_type]
    kind = layer_kind(cfg, index)
    # transformers' own switch for building a model whose weights come next; it patches `torch.nn.init` for the
    # process while it is on, which is safe here because workers build layers on their main thread only.
    with no_init_weights():
        if kind == "embedding":
            return family.embedding(hf)
        if kind == "head":
            return family.head(hf)
        return family.block(hf, index - 1)


def _layer_generator(seed: int, index: int) -> torch.Generator:
    # SeedSequence mixes (seed, index) into independent streams; neighbouring seeds do not give related weights.
    state = np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def _initialise(cfg: ModelConfig, module: nn.Module, generator: torch.Generator) -> None:
    """GPT-2's initialisation: N(0, 0.02) matrices and tables, residual output projections scaled down by
    sqrt(2 * num_blocks), zero biases, unit norm weights (the only one-dimensional weights)."""
    residual = FAMILIES[hf_config(cfg).model_type].residual_projections
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.ndim >= 2:
                std = INIT_STD
                if any(name.endswith(f"{projection}.weight") for projection in residual):
                    std /= math.sqrt(2 * cfg.num_blocks)
                nn.init.normal_(param, 0.0, std, generator=generator)
            elif name.endswith("weight"):
                nn.init.ones_(param)
            else:
                nn.init.zeros_(param)


def build_layer(cfg: ModelConfig, index: int, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """Layer `index` with weights that depend on (cfg, seed, index) only: read from ``cfg.weights`` if it names
    a checkpoint, else drawn from the seed.

    Weights are drawn on the CPU from a generator of their own, then moved, so they are the same on every device
    and whatever else the process has built or drawn before.
    """
    # A constructor that draws (dropout state, a family's own init) would use the global generator: keep the caller's
    # random stream untouched.
    with torch.random.fork_rng(devices=[]):
        module = _construct(cfg, index)
    if cfg.weights:
        load_layer(cfg, index, module)
    else:
        _initialise(cfg, module, _layer_generator(seed, index))
    return module.to(device=device, dtype=torch.float32)


_NUMELS: dict[tuple[str, int], tuple[int, ...]] = {}


def layer_numels(cfg: ModelConfig, index: int) -> tuple[int, ...]:
    """The element count of each parameter of layer ``index``, in module order, without building its weights."""
    key = (repr(cfg), index)
    if key not in _NUMELS:
        with torch.device("meta"):
            _NUMELS[key] = tuple(p.numel() for p in _construct(cfg, index).parameters())
    return _NUMELS[key]


class StageModule(nn.Module):
    """A contiguous range of layers [start, stop): the part of the model one pipeline stage runs."""

    def __init__(self, cfg: ModelConfig, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        indices = sorted(layers)
        if not indices or indices != list(range(indices[0], indices[-1] + 1)):
            raise ValueError(f"a stage needs a non-empty contiguous range of layers, got {indices}")
        if indices[0] < 0 or indices[-1] >= num_layers(cfg):
            raise ValueError(f"layers {indices} out of range: model {cfg.name} has {num_layers(cfg)} layers")
        self.start, self.stop = indices[0], indices[-1] + 1
        self.is_last = self.stop == num_layers(cfg)
        self.layers = nn.ModuleDict({str(i): layers[i] for i in indices})

    def layer(self, index: int) -> nn.Module:
        return self.layers[str(index)]

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [b, t] (first stage) or hidden states [b, t, hidden] in; hidden states out, or the mean
        cross-entropy over the batch's tokens from the last stage."""
        body = range(self.start, self.stop - 1 if self.is_last else self.stop)
        for index in body:
            x = self.layer(index)(x)
        if not self.is_last:
            return x
        if labels is None:
            raise ValueError("the last stage computes the loss: pass labels")
        return self.layer(self.stop - 1)(x, labels)
