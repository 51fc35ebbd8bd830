"""Every model as layers: an embedding, transformer blocks from `transformers`, and a loss head.

One table (``FAMILIES``) says, per architecture, how its layers are made from its `transformers` config: which of
the architecture's own decoder-layer classes a block wraps, the final norm, rotary embeddings or learned positions.
The built-in families (gpt2, llama, bert) make that config from ftlab's settings (``_BUILT_IN``); ``model=hf`` reads
it from the checkpoint's ``config.json`` (``hf_config``), so a Mistral or a Qwen2 is an entry, not code.

Each block wraps one `transformers` layer (GPT2Block, LlamaDecoderLayer, ...) so that it runs on its own: the
`transformers` models build the causal mask and the rotary position embeddings once at model level, which a pipeline
stage holding a few blocks does not have. Every block therefore runs with the ``sdpa`` attention implementation and
``is_causal=True`` and no mask (the default ``eager`` implementation would ignore ``is_causal`` and attend to the
future), and a rotary block computes its own rotary embeddings per forward. The decoder layers of the table share that
call: ``layer(hidden_states, is_causal=True[, position_embeddings=(cos, sin)])``.

BERT is trained with the same next-token objective as the decoders so that every model shares one data and loss
contract: its self-attention is made causal too (a bidirectional block would see the label it must predict), and
its head is BERT's MLM prediction head (dense, GELU, LayerNorm, vocabulary projection) applied to every position.
Parameter count, FLOPs and activation memory are those of BERT-large.

Dropout is zero everywhere, an HF config's too: a micro-batch must produce the same numbers whichever worker runs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import CONFIG_MAPPING, BertConfig, GPT2Config, LlamaConfig, PreTrainedConfig
from transformers.models.bert.modeling_bert import BertLayer, BertPredictionHeadTransform
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from ftlab.runtime.core import hf_checkpoint
from ftlab.runtime.core.model_spec import ModelConfig, ffn_hidden, kv_heads

ATTENTION = {"fused": "sdpa", "eager": "eager"}
"""``model.attention`` as transformers names it: sdpa honours is_causal without a mask and dispatches to fused kernels;
eager multiplies out the softmax probabilities (``runtime.core.model_spec.ATTENTIONS``)."""


class Embedding(nn.Module):
    """Token embedding, plus learned positions (GPT-2, BERT) and a LayerNorm (BERT: its blocks are post-norm)."""

    def __init__(self, vocab_size: int, hidden: int, positions: int | None, norm_eps: float | None) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, hidden)
        self.positions = nn.Embedding(positions, hidden) if positions is not None else None
        self.norm = nn.LayerNorm(hidden, eps=norm_eps) if norm_eps is not None else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        if self.positions is not None:
            x = x + self.positions(torch.arange(ids.shape[1], device=ids.device))
        if self.norm is not None:
            x = self.norm(x)
        return x


class Block(nn.Module):
    """One `transformers` decoder layer, run causally without a mask; a rotary one gets its embeddings here."""

    def __init__(self, layer: nn.Module, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = {}
        if self.rotary is not None:
            positions = torch.arange(x.shape[1], device=x.device)[None]
            extra["position_embeddings"] = self.rotary(x, positions)
        return self.layer(x, is_causal=True, **extra)


class Head(nn.Module):
    """Final norm (BERT: its prediction transform), an untied vocabulary projection, the mean cross-entropy.

    The projection is not tied to the token embedding: tying would put one parameter in the first and the last
    pipeline stage, whose gradients would need a reduction across stages. Untied, every parameter lives in
    exactly one layer; a checkpoint that ties them starts both from its one table (``hf_checkpoint.tensor_name``).
    """

    def __init__(self, norm: nn.Module, hidden: int, vocab_size: int, bias: bool) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = nn.Linear(hidden, vocab_size, bias=bias)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


@dataclass(frozen=True)
class Family:
    embedding: Callable[[PreTrainedConfig], nn.Module]
    block: Callable[[PreTrainedConfig, int], nn.Module]  # (config, block number from 0)
    head: Callable[[PreTrainedConfig], nn.Module]
    # Output projections of the residual branches: GPT-2 initialises them with std / sqrt(2 * num_blocks).
    residual_projections: tuple[str, ...]


def _modeling(model_type: str, name: str) -> type[nn.Module]:
    """A class of `transformers`' modeling module of ``model_type``, imported when a layer of it is first built."""
    return getattr(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"), name)


def _rotary(model_type: str, prefix: str) -> Family:
    """A Llama-shaped decoder (Llama, Mistral, Qwen2): pre-norm blocks with rotary positions, an RMSNorm head."""
    return Family(
        embedding=lambda hf: Embedding(hf.vocab_size, hf.hidden_size, None, None),
        block=lambda hf, i: Block(_modeling(model_type, f"{prefix}DecoderLayer")(hf, layer_idx=i),
                                  _modeling(model_type, f"{prefix}RotaryEmbedding")(hf)),  # fmt: skip
        head=lambda hf: Head(_modeling(model_type, f"{prefix}RMSNorm")(hf.hidden_size, eps=hf.rms_norm_eps),
                             hf.hidden_size, hf.vocab_size, False),  # fmt: skip
        residual_projections=("self_attn.o_proj", "mlp.down_proj"),
    )


FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        embedding=lambda hf: Embedding(hf.vocab_size, hf.n_embd, hf.n_positions, None),
        block=lambda hf, i: Block(GPT2Block(hf, layer_idx=i)),
        head=lambda hf: Head(nn.LayerNorm(hf.n_embd, hf.layer_norm_epsilon), hf.n_embd, hf.vocab_size, False),
        residual_projections=("attn.c_proj", "mlp.c_proj"),
    ),
    "llama": _rotary("llama", "Llama"),
    "mistral": _rotary("mistral", "Mistral"),
    "qwen2": _rotary("qwen2", "Qwen2"),
    "bert": Family(
        embedding=lambda hf: Embedding(hf.vocab_size, hf.hidden_size, hf.max_position_embeddings, hf.layer_norm_eps),
        block=lambda hf, i: Block(BertLayer(hf, layer_idx=i)),
        head=lambda hf: Head(BertPredictionHeadTransform(hf), hf.hidden_size, hf.vocab_size, True),
        residual_projections=("attention.output.dense", "layer.output.dense"),
    ),
}


def _gpt2_config(cfg: ModelConfig) -> GPT2Config:
    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.seq_len,
        n_embd=cfg.hidden,
        n_layer=cfg.num_blocks,
        n_head=cfg.heads,
        n_inner=ffn_hidden(cfg),
        # GPT-2's tanh GELU as one kernel: the function of "gelu_new" without the intermediates its formula keeps.
        activation_function="gelu_pytorch_tanh",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,  # GPT-2's 50256 lies outside small vocabularies; the layers never use it
        eos_token_id=None,
        attn_implementation=ATTENTION[cfg.attention],
    )


def _llama_config(cfg: ModelConfig) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=ffn_hidden(cfg),
        num_hidden_layers=cfg.num_blocks,
        num_attention_heads=cfg.heads,
        num_key_value_heads=kv_heads(cfg),
        max_position_embeddings=cfg.seq_len,
        rms_norm_eps=1e-5,  # Llama 2's value (the transformers default is 1e-6)
        attention_dropout=0.0,
        attn_implementation=ATTENTION[cfg.attention],
    )


def _bert_config(cfg: ModelConfig) -> BertConfig:
    return BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden,
        num_hidden_layers=cfg.num_blocks,
        num_attention_heads=cfg.heads,
        intermediate_size=ffn_hidden(cfg),
        max_position_embeddings=cfg.seq_len,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation=ATTENTION[cfg.attention],
    )


_BUILT_IN: dict[str, Callable[[ModelConfig], PreTrainedConfig]] = {
    "gpt2": _gpt2_config, "llama": _llama_config, "bert": _bert_config,
}  # fmt: skip


def _is_dropout(key: str, value: object) -> bool:
    return isinstance(value, float) and ("dropout" in key or key.endswith("pdrop"))


def hf_config(cfg: ModelConfig) -> PreTrainedConfig:
    """The `transformers` config of the model: a built-in family's from its settings, an HF model's from its
    config.json (read locally by its config class, never fetched), with every dropout at zero."""
    if cfg.family in _BUILT_IN:
        return _BUILT_IN[cfg.family](cfg)
    settings = dict(hf_checkpoint.read_config(cfg.config))
    settings.update({key: 0.0 for key, value in settings.items() if _is_dropout(key, value)})
    return CONFIG_MAPPING[settings["model_type"]].from_dict(settings, attn_implementation=ATTENTION[cfg.attention])
