"""The model as data: its config, and per layer its size, its arithmetic and the activations it keeps.

Planners, preflight checks and the simulator reason about a model through ``layer_specs`` alone, which is plain
arithmetic on the config: no torch, no module is built, so a config is checked in milliseconds at any size. Workers
build the real layers (``runtime.training.model``); ``tests/test_model.py`` holds the formulas here to the parameters the
real layers have and to the activations autograd really keeps.

A model is an ordered list of layers: an embedding, ``num_blocks`` transformer blocks, and a head that computes the
loss. The head's vocabulary projection is untied from the embedding (see ``runtime.training.model_families.Head``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

FAMILY_NAMES = ("gpt2", "llama", "bert")
FP32 = 4
MODEL_CONF_DIR = Path(__file__).parents[2] / "conf" / "model"


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

    def check(self) -> None:
        """Raise ValueError, naming the setting to change, unless the shape is one a model of the family can have."""
        if self.family not in FAMILY_NAMES:
            raise ValueError(f"model.family={self.family!r}: use one of {', '.join(FAMILY_NAMES)}")
        for name in ("num_blocks", "hidden", "heads", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)}: sizes must be at least 1")
        if self.hidden % self.heads:
            divisors = [h for h in range(1, self.hidden + 1) if self.hidden % h == 0 and abs(h - self.heads) <= 8]
            raise ValueError(
                f"model.hidden={self.hidden} does not split into model.heads={self.heads} attention heads: choose "
                f"hidden as a multiple of heads (e.g. hidden={self.heads * math.ceil(self.hidden / self.heads)}) "
                f"or heads dividing hidden (e.g. {', '.join(map(str, divisors[-3:]))})"
            )
        if self.ffn_hidden is not None and self.ffn_hidden < 1:
            raise ValueError(f"model.ffn_hidden={self.ffn_hidden}: use a positive width, or null for the default")
        if self.kv_heads is not None:
            if self.family != "llama":
                raise ValueError(f"model.kv_heads is for family llama (grouped-query attention); remove it for {self.family}")
            if self.kv_heads < 1 or self.heads % self.kv_heads:
                raise ValueError(f"model.kv_heads={self.kv_heads} must divide model.heads={self.heads}")


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


def ffn_hidden(cfg: ModelConfig) -> int:
    """The MLP width: the configured one, else 4*hidden (GPT-2, BERT) or Llama's 8/3*hidden rounded up to 256."""
    if cfg.ffn_hidden is not None:
        return cfg.ffn_hidden
    if cfg.family == "llama":
        return 256 * math.ceil(8 * cfg.hidden / 3 / 256)
    return 4 * cfg.hidden


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.kv_heads if cfg.kv_heads is not None else cfg.heads


@dataclass(frozen=True)
class _Shape:
    """One layer kind's parameters: all of them, and those a token is multiplied with (tables are looked up)."""

    params: int
    matmul: int
    saved: int
    """fp32 elements per token kept for backward."""


# Activations kept for backward, in elements per token. These assume fused attention (flash or memory-efficient
# sdpa, which keeps q, k, v, the output and a log-sum-exp per head rather than the [t, t] probabilities) and fused
# element-wise activations, as on a GPU; per-token scalars of the norms are left out.


def _gpt2(cfg: ModelConfig, kind: str) -> _Shape:
    h, f, v, t = cfg.hidden, ffn_hidden(cfg), cfg.vocab_size, cfg.seq_len
    if kind == "embedding":  # token and position tables
        return _Shape(v * h + t * h, 0, 0)
    if kind == "head":  # LayerNorm, untied projection without bias; LayerNorm in, lm_head in, log-softmax
        return _Shape(2 * h + h * v, h * v, 2 * h + v)
    matmul = h * 3 * h + h * h + 2 * h * f  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    biases_and_norms = 3 * h + h + f + h + 4 * h
    # ln_1 in, c_attn in, q k v, attention out (= c_proj in) + lse, ln_2 in, c_fc in, gelu in, c_proj in
    saved = h + h + 3 * h + h + cfg.heads + h + h + f + f
    return _Shape(matmul + biases_and_norms, matmul, saved)


def _llama(cfg: ModelConfig, kind: str) -> _Shape:
    h, f, v = cfg.hidden, ffn_hidden(cfg), cfg.vocab_size
    kv = kv_heads(cfg) * (h // cfg.heads)
    if kind == "embedding":
        return _Shape(v * h, 0, 0)
    if kind == "head":  # RMSNorm, projection; RMSNorm in, normalised, out (= lm_head in), log-softmax
        return _Shape(h + h * v, h * v, 3 * h + v)
    matmul = 2 * h * h + 2 * h * kv + 3 * h * f  # q, o, k, v, gate, up, down; no biases
    # LlamaRMSNorm is unfused: it keeps its input, the normalised input and its output (3h), before attention and
    # before the MLP; q (rotated), k, v; attention out (= o_proj in) + lse; gate, up, silu out, down in.
    saved = 3 * h + h + 2 * kv + h + cfg.heads + 3 * h + 4 * f
    return _Shape(matmul + 2 * h, matmul, saved)


def _bert(cfg: ModelConfig, kind: str) -> _Shape:
    h, f, v, t = cfg.hidden, ffn_hidden(cfg), cfg.vocab_size, cfg.seq_len
    if kind == "embedding":  # token and position tables, LayerNorm; the LayerNorm's input is kept
        return _Shape(v * h + t * h + 2 * h, 0, h)
    if kind == "head":  # prediction transform (dense, GELU, LayerNorm), projection with bias
        # dense in, gelu in, LayerNorm in, lm_head in, log-softmax
        return _Shape(h * h + h + 2 * h + h * v + v, h * h + h * v, 4 * h + v)
    matmul = 4 * h * h + 2 * h * f  # q, k, v, attention output, intermediate, output
    biases_and_norms = 4 * h + 2 * h + f + h + 2 * h
    # qkv in, q k v, attention out (= dense in) + lse, LayerNorm in, intermediate in, gelu in, output in, LayerNorm in
    saved = h + 3 * h + h + cfg.heads + h + h + f + f + h
    return _Shape(matmul + biases_and_norms, matmul, saved)


_FAMILY_SHAPES = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """Sizes and costs of every layer, from the config alone."""
    cfg.check()
    shape = _FAMILY_SHAPES[cfg.family]
    # QK^T and AV over the full [t, t] square, forward: 2 * 2 * seq_len * hidden per token.
    attention_flops = 4 * cfg.seq_len * cfg.hidden
    specs = []
    for index in range(num_layers(cfg)):
        kind = layer_kind(cfg, index)
        s = shape(cfg, kind)
        specs.append(
            LayerSpec(
                index=index,
                kind=kind,
                params=s.params,
                fwd_flops_per_token=float(2 * s.matmul + (attention_flops if kind == "block" else 0)),
                output_bytes_per_token=0 if kind == "head" else FP32 * cfg.hidden,
                saved_bytes_per_token=FP32 * s.saved,
            )
        )
    return specs


def available_models() -> list[str]:
    return sorted(path.stem for path in MODEL_CONF_DIR.glob("*.yaml"))


def load_model_config(name: str) -> ModelConfig:
    """The ModelConfig of conf/model/<name>.yaml, checked against the schema."""
    from omegaconf import OmegaConf

    path = MODEL_CONF_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown model {name!r}; available models: {', '.join(available_models())}")
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
    cfg = OmegaConf.to_object(merged)
    cfg.check()
    return cfg
