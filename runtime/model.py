"""The model as an ordered list of layers: embedding, transformer blocks, head.

A pipeline stage holds a contiguous range of layers. Policies and the simulator reason about layers through
`layer_specs` (sizes and costs from formulas and meta tensors, nothing allocated); workers build the real layers
with `build_layer`, whose weights depend on (config, seed, layer index) alone, so every pipeline layout starts from
the same model and trains identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn

from runtime.model_families import FAMILIES

MODEL_CONF_DIR = Path(__file__).parents[1] / "conf" / "model"
INIT_STD = 0.02  # GPT-2's initialisation, used for every family
FP32 = 4


@dataclass
class ModelConfig:
    """Schema of the Hydra config group ``model``."""

    name: str = "gpt2-tiny"
    family: str = "gpt2"  # "gpt2" | "llama" | "bert"
    num_blocks: int = 6
    hidden: int = 128
    heads: int = 4
    vocab_size: int = 8192
    seq_len: int = 64  # also the number of learned positions (gpt2, bert) and Llama's max positions
    ffn_hidden: int | None = None  # None: 4*hidden (gpt2, bert), 8/3*hidden rounded up to 256 (llama)
    kv_heads: int | None = None  # llama grouped-query attention; None: as many as heads

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r} is not one of {sorted(FAMILIES)}")
        if min(self.num_blocks, self.hidden, self.heads, self.vocab_size, self.seq_len) < 1:
            raise ValueError(f"model {self.name}: sizes must be positive")
        if self.hidden % self.heads:
            raise ValueError(f"model {self.name}: hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.kv_heads is not None and (self.family != "llama" or self.heads % self.kv_heads):
            raise ValueError(f"model {self.name}: kv_heads needs family llama and must divide heads {self.heads}")


@dataclass(frozen=True)
class LayerSpec:
    index: int
    kind: str  # "embedding" | "block" | "head"
    params: int
    fwd_flops_per_token: float  # matmuls + attention scores at cfg.seq_len
    output_bytes_per_token: int  # what a pipeline send of this layer's output carries; 0 for the head
    saved_bytes_per_token: int  # fp32 activations kept for backward (estimate, fused attention)


def num_layers(cfg: ModelConfig) -> int:
    return cfg.num_blocks + 2


def layer_kind(cfg: ModelConfig, index: int) -> str:
    if not 0 <= index < num_layers(cfg):
        raise IndexError(f"layer {index} out of range: model {cfg.name} has {num_layers(cfg)} layers")
    if index == 0:
        return "embedding"
    return "head" if index == num_layers(cfg) - 1 else "block"


def _construct(cfg: ModelConfig, index: int) -> nn.Module:
    """The layer's module with `torch.nn` default initialisation, on the current default device."""
    family = FAMILIES[cfg.family]
    hf = family.hf_config(cfg)
    kind = layer_kind(cfg, index)
    if kind == "embedding":
        return family.embedding(cfg, hf)
    if kind == "head":
        return family.head(cfg, hf)
    return family.block(hf, index - 1)


def _matmul_params(module: nn.Module) -> int:
    """Elements of the matrices a token is multiplied with (embedding tables are looked up, not multiplied)."""
    tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in module.parameters() if p.ndim >= 2 and id(p) not in tables)


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """Sizes and costs of every layer; modules are built on the meta device, so nothing is allocated."""
    family = FAMILIES[cfg.family]
    last = num_layers(cfg) - 1
    with torch.device("meta"):
        # All blocks are alike: construct one of each kind.
        modules = {kind: _construct(cfg, index) for kind, index in (("embedding", 0), ("block", 1), ("head", last))}
    # QK^T and AV over the full [t, t] square, forward: 2 * 2 * seq_len * hidden per token.
    attention_flops = 4 * cfg.seq_len * cfg.hidden
    saved = {
        "embedding": cfg.hidden if cfg.family == "bert" else 0,  # BERT's embedding LayerNorm input
        "block": family.block_saved(cfg),
        "head": family.head_saved(cfg),
    }
    specs = []
    for index in range(num_layers(cfg)):
        kind = layer_kind(cfg, index)
        module = modules[kind]
        specs.append(
            LayerSpec(
                index=index,
                kind=kind,
                params=sum(p.numel() for p in module.parameters()),
                fwd_flops_per_token=float(2 * _matmul_params(module) + (attention_flops if kind == "block" else 0)),
                output_bytes_per_token=0 if kind == "head" else FP32 * cfg.hidden,
                saved_bytes_per_token=FP32 * saved[kind],
            )
        )
    return specs


def _layer_generator(seed: int, index: int) -> torch.Generator:
    # SeedSequence mixes (seed, index) into independent streams; neighbouring seeds do not give related weights.
    state = np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def _initialise(cfg: ModelConfig, module: nn.Module, generator: torch.Generator) -> None:
    """GPT-2's initialisation: N(0, 0.02) matrices and tables, residual output projections scaled down by
    sqrt(2 * num_blocks), zero biases, unit norm weights (the only one-dimensional weights)."""
    residual = FAMILIES[cfg.family].residual_projections
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
    """Layer `index` with weights that depend on (cfg, seed, index) only.

    Weights are drawn on the CPU from a generator of their own, then moved, so they are the same on every device
    and whatever else the process has built or drawn before.
    """
    # Default initialisation would draw from the global generator: keep the caller's random stream untouched.
    with torch.random.fork_rng(devices=[]):
        module = _construct(cfg, index)
    _initialise(cfg, module, _layer_generator(seed, index))
    return module.to(device=device, dtype=torch.float32)


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


def training_memory_bytes(
    specs: list[LayerSpec], start: int, stop: int, micro_batch: int, seq_len: int, in_flight: int
) -> int:
    """Memory a stage of layers [start, stop) needs to train: fp32 weights, gradients and AdamW's two moments
    (16 bytes per parameter) plus the saved activations of `in_flight` micro-batches (1F1B: up to the number of
    stages after this one, plus one)."""
    chosen = specs[start:stop]
    params = sum(s.params for s in chosen)
    saved_per_token = sum(s.saved_bytes_per_token for s in chosen)
    return 4 * FP32 * params + in_flight * micro_batch * seq_len * saved_per_token


def available_models() -> list[str]:
    return sorted(path.stem for path in MODEL_CONF_DIR.glob("*.yaml"))


def load_model_config(name: str) -> ModelConfig:
    """The ModelConfig of conf/model/<name>.yaml, checked against the schema."""
    path = MODEL_CONF_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown model {name!r}; available models: {', '.join(available_models())}")
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)
