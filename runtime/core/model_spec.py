"""The model as data: its config, and per layer its size, its arithmetic and the activations it keeps.

Planners, preflight checks and the simulator reason about a model through ``layer_specs`` alone, which is plain
arithmetic on the config: no torch, no module is built, so a config is checked in milliseconds at any size. Workers
build the real layers (``runtime.training.model``); ``tests/test_model.py`` holds the formulas here to the parameters the
real layers have and to the activations autograd really keeps.

A model is an ordered list of layers: an embedding, ``num_blocks`` transformer blocks, and a head that computes the
loss. The head's vocabulary projection is untied from the embedding (see ``runtime.training.model_families.Head``).

Every model reduces to ``Dims``: the sizes its layers are made of and one of three layer structures (GPT-2's, Llama's,
BERT's). The built-in families take them from their settings; ``family=hf`` (``model=hf``) from a Hugging Face
``config.json`` (``runtime.core.hf_checkpoint``), whose sizes also fill in the settings, so everything that reads
``model.hidden`` or ``model.num_blocks`` reads the checkpoint's.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftlab.runtime.core import hf_checkpoint as hf

FAMILY_NAMES = ("gpt2", "llama", "bert", "hf")
FP32 = 4
MODEL_CONF_DIR = Path(__file__).parents[2] / "conf" / "model"
ATTENTIONS = ("fused", "eager", "eager_dropout")
"""The values of ``model.attention`` (``ModelConfig.attention``)."""
TEMPLATES = ("hf",)
"""conf/model files that are not a model until given settings of their own (model=hf needs model.config)."""


@dataclass
class ModelConfig:
    """Schema of the Hydra config group ``model``."""

    name: str = "gpt2-tiny"
    family: str = "gpt2"  # "gpt2" | "llama" | "bert" | "hf" (shape and architecture from model.config)
    num_blocks: int = 6
    hidden: int = 128
    heads: int = 4
    vocab_size: int = 8192
    seq_len: int = 64  # also the number of learned positions (gpt2, bert) and Llama's max positions
    ffn_hidden: int | None = None  # None: 4*hidden (gpt2, bert), 8/3*hidden rounded up to 256 (llama)
    kv_heads: int | None = None  # llama grouped-query attention; None: as many as heads
    config: str | None = None  # family hf: a Hugging Face config.json, or the directory that holds it
    weights: str | None = None  # family hf: a directory of safetensors to start from; None: initialised from the seed
    attention: str = "fused"
    """How a block computes attention, which sets what it keeps for the backward (``_attention_saved``). fused:
    torch's sdpa (flash or memory-efficient kernels on a GPU, the flash kernel on a CPU), what workers run unless told
    otherwise. eager: the softmax probabilities multiplied out, a [seq, seq] matrix per head, as transformers' eager
    attention; workers run it too. eager_dropout: eager with attention dropout, as Megatron-LM and DeepSpeed trained
    GPT-3 before fused attention kernels: it keeps the dropout's mask and the dropped probabilities too. Analytic
    profiles (a GPU type) only: workers train without dropout, so that every layout computes the same gradient."""

    def __post_init__(self) -> None:
        """An HF model's shape settings left at the schema's defaults take the checkpoint's sizes; a setting given
        otherwise is left for ``check`` to refuse. An unreadable config is ``check``'s to report too: composing a
        job must not fail before its run can record why."""
        if self.family != "hf" or not self.config:
            return
        self.config = os.path.abspath(self.config)
        self.weights = os.path.abspath(self.weights) if self.weights else None
        try:
            shape = _hf_settings(self.config)
        except hf.CheckpointError:
            return
        defaults = ModelConfig.__dataclass_fields__
        for key, value in shape.items():
            if getattr(self, key) == defaults[key].default:
                setattr(self, key, value)
        if self.name == "hf":
            self.name = f"hf-{Path(hf.config_path(self.config)).parent.name}"

    def check(self) -> None:
        """Raise ValueError, naming the setting to change, unless the shape is one a model of the family can have."""
        if self.family not in FAMILY_NAMES:
            raise ValueError(f"model.family={self.family!r}: use one of {', '.join(FAMILY_NAMES)}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"model.attention={self.attention!r}: use one of {', '.join(ATTENTIONS)}")
        if self.family == "hf":
            self._check_hf()
        elif self.config is not None or self.weights is not None:
            raise ValueError(f"model.config and model.weights are for model=hf; remove them for {self.name}")
        for name in ("num_blocks", "hidden", "heads", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)}: sizes must be at least 1")
        if self.family == "hf":
            return
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

    def _check_hf(self) -> None:
        """The checkpoint is readable and of a supported architecture, the settings agree with it, the sequence
        fits its positions and its attention window, and the weights (if any) hold every layer's tensors in the
        shapes the config makes them."""
        if not self.config:
            raise ValueError("model=hf needs model.config=<a Hugging Face model directory or its config.json>")
        shape = _hf_settings(self.config)
        for key, value in shape.items():
            if getattr(self, key) != value:
                raise ValueError(
                    f"model.{key}={getattr(self, key)} but model.config={self.config} makes it {value}: remove "
                    f"model.{key} (model=hf takes its shape from config.json)"
                )
        parsed = hf.read_config(self.config)
        d = dims(self)
        if d.positions and self.seq_len > d.positions:
            raise ValueError(f"model.seq_len={self.seq_len} is longer than the {d.positions} learned positions of "
                             f"model.config={self.config}: use model.seq_len<={d.positions}")  # fmt: skip
        window = hf.sliding_window(parsed)
        if window is not None and self.seq_len > window:
            raise ValueError(
                f"model.seq_len={self.seq_len} is longer than the sliding_window={window} of model.config="
                f"{self.config}: ftlab's blocks attend to every earlier token, so use model.seq_len<={window}"
            )
        if self.weights:
            for index in range(num_layers(self)):
                kind = layer_kind(self, index)
                hf.check_layer_weights(self.config, self.weights, index, kind, index - 1, parameter_shapes(d, kind))


@dataclass(frozen=True)
class Dims:
    """The sizes a model's layers are made of."""

    structure: str  # "gpt2" | "llama" | "bert": which parameters a layer has, which activations it keeps
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    positions: int  # rows of the learned position table; 0: none (rotary)
    biases: hf.Biases = (False, False, False)  # the "llama" structure's q/k/v, attention output, MLP biases


def _hf_dims(config: str) -> Dims:
    try:
        return _read_hf_dims(config)
    except KeyError as missing:
        raise hf.CheckpointError(f"model.config={config}: config.json lacks {missing}, which sizes the model: "
                                 f"give the config save_pretrained wrote") from None  # fmt: skip


def _read_hf_dims(config: str) -> Dims:
    c, arch = hf.read_config(config), hf.architecture(config)
    if arch.structure == "gpt2":
        h = c["n_embd"]
        return Dims("gpt2", h, c["n_head"], c["n_head"], h // c["n_head"], c.get("n_inner") or 4 * h,
                    c["vocab_size"], c["n_positions"])  # fmt: skip
    h, heads = c["hidden_size"], c["num_attention_heads"]
    return Dims(
        "llama", h, heads, c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads,
        c["intermediate_size"], c["vocab_size"], 0, tuple(bool(b) for b in arch.biases(c)),
    )  # fmt: skip


def _hf_settings(config: str) -> dict[str, Any]:
    """The model.* settings an HF config fixes."""
    d, c = _hf_dims(config), hf.read_config(config)
    blocks = c.get("n_layer" if d.structure == "gpt2" else "num_hidden_layers")
    if not isinstance(blocks, int):
        raise hf.CheckpointError(f"model.config={config}: config.json gives no number of layers")
    return {"num_blocks": blocks, "hidden": d.hidden, "heads": d.heads, "vocab_size": d.vocab, "ffn_hidden": d.ffn,
            "kv_heads": d.kv_heads}  # fmt: skip


def dims(cfg: ModelConfig) -> Dims:
    if cfg.family == "hf":
        return _hf_dims(cfg.config)
    h, heads = cfg.hidden, cfg.heads
    positions = 0 if cfg.family == "llama" else cfg.seq_len
    return Dims(cfg.family, h, heads, kv_heads(cfg), h // heads, ffn_hidden(cfg), cfg.vocab_size, positions)


@dataclass(frozen=True)
class LayerSpec:
    index: int
    kind: str  # "embedding" | "block" | "head"
    params: int
    fwd_flops_per_token: float  # matmuls + attention scores at cfg.seq_len
    output_bytes_per_token: int  # what a pipeline send of this layer's output carries; 0 for the head
    saved_bytes_per_token: int  # fp32 activations kept for backward (estimate, for the model's attention)
    saved_mask_bytes_per_token: int = 0  # boolean masks kept for backward (dropout's): a byte each in any precision


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


# -- the parameters of a layer, by the names of the modules workers build (runtime.training.model_families) ----------
Shapes = dict[str, tuple[int, ...]]


def _linear(name: str, into: int, out: int, bias: bool) -> Shapes:
    return {f"{name}.weight": (out, into), **({f"{name}.bias": (out,)} if bias else {})}


def _norm(name: str, h: int, bias: bool = True) -> Shapes:
    return {f"{name}.weight": (h,), **({f"{name}.bias": (h,)} if bias else {})}


def _gpt2_params(d: Dims, kind: str) -> Shapes:
    h, f, v = d.hidden, d.ffn, d.vocab
    if kind == "embedding":
        return {"tokens.weight": (v, h), "positions.weight": (d.positions, h)}
    if kind == "head":
        return {**_norm("norm", h), **_linear("lm_head", h, v, False)}

    def conv(name: str, into: int, out: int) -> Shapes:  # GPT-2's Conv1D stores its weight as [in, out]
        return {f"layer.{name}.weight": (into, out), f"layer.{name}.bias": (out,)}

    return {**_norm("layer.ln_1", h), **conv("attn.c_attn", h, 3 * h), **conv("attn.c_proj", h, h),
            **_norm("layer.ln_2", h), **conv("mlp.c_fc", h, f), **conv("mlp.c_proj", f, h)}  # fmt: skip


def _llama_params(d: Dims, kind: str) -> Shapes:
    h, f, v = d.hidden, d.ffn, d.vocab
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    if kind == "embedding":
        return {"tokens.weight": (v, h)}
    if kind == "head":
        return {**_norm("norm", h, bias=False), **_linear("lm_head", h, v, False)}
    qkv, out, mlp = d.biases
    a, m = "layer.self_attn", "layer.mlp"
    return {
        **_linear(f"{a}.q_proj", h, q, qkv), **_linear(f"{a}.k_proj", h, kv, qkv), **_linear(f"{a}.v_proj", h, kv, qkv),
        **_linear(f"{a}.o_proj", q, h, out), **_linear(f"{m}.gate_proj", h, f, mlp), **_linear(f"{m}.up_proj", h, f, mlp),
        **_linear(f"{m}.down_proj", f, h, mlp),
        **_norm("layer.input_layernorm", h, bias=False), **_norm("layer.post_attention_layernorm", h, bias=False),
    }  # fmt: skip


def _bert_params(d: Dims, kind: str) -> Shapes:
    h, f, v = d.hidden, d.ffn, d.vocab
    if kind == "embedding":
        return {"tokens.weight": (v, h), "positions.weight": (d.positions, h), **_norm("norm", h)}
    if kind == "head":  # BERT's prediction transform (dense, GELU, LayerNorm), then the projection with a bias
        return {**_linear("norm.dense", h, h, True), **_norm("norm.LayerNorm", h), **_linear("lm_head", h, v, True)}
    a = "layer.attention"
    return {
        **_linear(f"{a}.self.query", h, h, True), **_linear(f"{a}.self.key", h, h, True),
        **_linear(f"{a}.self.value", h, h, True), **_linear(f"{a}.output.dense", h, h, True),
        **_norm(f"{a}.output.LayerNorm", h), **_linear("layer.intermediate.dense", h, f, True),
        **_linear("layer.output.dense", f, h, True), **_norm("layer.output.LayerNorm", h),
    }  # fmt: skip


_PARAMS = {"gpt2": _gpt2_params, "llama": _llama_params, "bert": _bert_params}


def parameter_shapes(d: Dims, kind: str) -> Shapes:
    """Every parameter of a layer of this kind, by its name in the module a worker builds, with its shape."""
    return _PARAMS[d.structure](d, kind)


# Activations kept for backward, in elements per token, but for what the attention kernel keeps beyond q, k, v and
# its output (``_attention_saved``). These assume fused element-wise activations, as on a GPU; per-token scalars of
# the norms are left out.
def _saved(d: Dims, kind: str) -> int:
    h, f, v, heads = d.hidden, d.ffn, d.vocab, d.heads
    q, kv = heads * d.head_dim, d.kv_heads * d.head_dim
    if d.structure == "gpt2":
        # head: LayerNorm in, lm_head in, log-softmax. block: ln_1 in, c_attn in, q k v, attention out (= c_proj
        # in), ln_2 in, c_fc in, gelu in, c_proj in
        return {"embedding": 0, "head": 2 * h + v, "block": h + h + 3 * h + h + h + h + f + f}[kind]
    if d.structure == "llama":
        # The RMSNorm is unfused: it keeps its input, the normalised input and its output (3h), before attention,
        # before the MLP and in the head; q (rotated), k, v; attention out (= o_proj in); gate, up, silu out, down
        # in. head: RMSNorm, lm_head in, log-softmax.
        return {"embedding": 0, "head": 3 * h + v, "block": 3 * h + q + 2 * kv + q + 3 * h + 4 * f}[kind]
    # bert. embedding: the LayerNorm's input. head: dense in, gelu in, LayerNorm in, lm_head in, log-softmax.
    # block: qkv in, q k v, attention out (= dense in), LayerNorm in, intermediate in, gelu in, output in,
    # LayerNorm in
    return {"embedding": h, "head": 4 * h + v, "block": h + 3 * h + h + h + h + f + f + h}[kind]


def _attention_saved(heads: int, seq_len: int, attention: str) -> tuple[int, int]:
    """What a block's attention keeps per token beyond q, k, v and its output: elements of the compute precision,
    and mask bytes. fused: one log-sum-exp per head. eager: the softmax probabilities, a row of ``seq_len`` per
    head (the score matrix before the softmax is not kept: the softmax's backward needs its output alone).
    eager_dropout: the probabilities, the dropout's boolean mask and the dropped probabilities (what the product with
    v keeps): 5 bytes per head and position in half precision, Korthikanti et al.'s 5as/h (MLSys'23, Section 4.1)."""
    row = heads * seq_len
    return {"fused": (heads, 0), "eager": (row, 0), "eager_dropout": (2 * row, row)}[attention]


def layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """Sizes and costs of every layer, from the config alone. A token is multiplied with every matrix of a block
    or the head; the embedding's tables are looked up."""
    cfg.check()
    d = dims(cfg)
    # QK^T and AV over the full [t, t] square, forward: 2 * 2 * seq_len * (heads * head_dim) per token.
    attention_flops = 4 * cfg.seq_len * d.heads * d.head_dim
    attention, mask = _attention_saved(d.heads, cfg.seq_len, cfg.attention)
    specs = []
    for index in range(num_layers(cfg)):
        kind = layer_kind(cfg, index)
        shapes = parameter_shapes(d, kind).values()
        matmul = 0 if kind == "embedding" else sum(math.prod(s) for s in shapes if len(s) == 2)
        specs.append(
            LayerSpec(
                index=index,
                kind=kind,
                params=sum(math.prod(s) for s in shapes),
                fwd_flops_per_token=float(2 * matmul + (attention_flops if kind == "block" else 0)),
                output_bytes_per_token=0 if kind == "head" else FP32 * cfg.hidden,
                saved_bytes_per_token=FP32 * (_saved(d, kind) + (attention if kind == "block" else 0)),
                saved_mask_bytes_per_token=mask if kind == "block" else 0,
            )
        )
    return specs


def available_models() -> list[str]:
    """The models ready to run by name alone."""
    return sorted(path.stem for path in MODEL_CONF_DIR.glob("*.yaml") if path.stem not in TEMPLATES)


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
