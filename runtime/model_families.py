"""The three model families as layers: an embedding, transformer blocks from `transformers`, and a loss head.

Each block wraps one `transformers` layer (GPT2Block, LlamaDecoderLayer, BertLayer) so that it runs on its own: the
`transformers` models build the causal mask and the rotary position embeddings once at model level, which a pipeline
stage holding a few blocks does not have. Every block therefore runs with the ``sdpa`` attention implementation and
``is_causal=True`` and no mask (the default ``eager`` implementation would ignore ``is_causal`` and attend to the
future), and a Llama block computes its own rotary embeddings per forward.

BERT is trained with the same next-token objective as the decoders so that every model shares one data and loss
contract: its self-attention is made causal too (a bidirectional block would see the label it must predict), and
its head is BERT's MLM prediction head (dense, GELU, LayerNorm, vocabulary projection) applied to every position.
Parameter count, FLOPs and activation memory are those of BERT-large.

Dropout is zero everywhere: a micro-batch must produce the same numbers whichever worker runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, GPT2Config, LlamaConfig, PreTrainedConfig
from transformers.models.bert.modeling_bert import BertLayer, BertPredictionHeadTransform
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

if TYPE_CHECKING:
    from runtime.model import ModelConfig

# One attention implementation for all: sdpa honours is_causal without a mask, and dispatches to fused kernels.
ATTENTION = "sdpa"


def ffn_hidden(cfg: ModelConfig) -> int:
    """The MLP width: the configured one, else 4*hidden (GPT-2, BERT) or Llama's 8/3*hidden rounded up to 256."""
    if cfg.ffn_hidden is not None:
        return cfg.ffn_hidden
    if cfg.family == "llama":
        return 256 * math.ceil(8 * cfg.hidden / 3 / 256)
    return 4 * cfg.hidden


def kv_heads(cfg: ModelConfig) -> int:
    return cfg.kv_heads if cfg.kv_heads is not None else cfg.heads


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
    """One `transformers` layer, run causally without a mask; Llama's gets its rotary embeddings here."""

    def __init__(self, layer: nn.Module, rotary: LlamaRotaryEmbedding | None = None) -> None:
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
    exactly one layer.
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
    hf_config: Callable[[ModelConfig], PreTrainedConfig]
    embedding: Callable[[ModelConfig, PreTrainedConfig], nn.Module]
    block: Callable[[PreTrainedConfig, int], nn.Module]  # (config, block number from 0)
    head: Callable[[ModelConfig, PreTrainedConfig], nn.Module]
    # Output projections of the residual branches: GPT-2 initialises them with std / sqrt(2 * num_blocks).
    residual_projections: tuple[str, ...]
    # fp32 elements per token a block / the head keeps for backward (formulas below).
    block_saved: Callable[[ModelConfig], int]
    head_saved: Callable[[ModelConfig], int]


# Activations kept for backward, in elements per token. These assume fused attention (flash or memory-efficient
# sdpa, which keeps q, k, v, the output and a log-sum-exp per head rather than the [t, t] probabilities) and fused
# element-wise activations, as on a GPU; per-token scalars of the norms are left out. The CPU's default math
# kernel keeps the [heads, t, t] probabilities as well. tests/test_model.py checks these against what autograd saves.


def _gpt2_block_saved(cfg: ModelConfig) -> int:
    h, f = cfg.hidden, ffn_hidden(cfg)
    # ln_1 in, c_attn in, q k v, attention out (= c_proj in) + lse, ln_2 in, c_fc in, gelu in, c_proj in
    return h + h + 3 * h + h + cfg.heads + h + h + f + f


def _llama_block_saved(cfg: ModelConfig) -> int:
    h, f = cfg.hidden, ffn_hidden(cfg)
    kv = kv_heads(cfg) * (cfg.hidden // cfg.heads)
    # LlamaRMSNorm is unfused: it keeps its input, the normalised input and its output (3h), before attention and
    # before the MLP; q (rotated), k, v; attention out (= o_proj in) + lse; gate, up, silu out, down in.
    return 3 * h + h + 2 * kv + h + cfg.heads + 3 * h + 4 * f


def _bert_block_saved(cfg: ModelConfig) -> int:
    h, f = cfg.hidden, ffn_hidden(cfg)
    # qkv in, q k v, attention out (= dense in) + lse, LayerNorm in, intermediate in, gelu in, output in, LayerNorm in
    return h + 3 * h + h + cfg.heads + h + h + f + f + h


def _gpt2_head_saved(cfg: ModelConfig) -> int:
    return 2 * cfg.hidden + cfg.vocab_size  # LayerNorm in, lm_head in, log-softmax


def _llama_head_saved(cfg: ModelConfig) -> int:
    return 3 * cfg.hidden + cfg.vocab_size  # RMSNorm in, normalised, out (= lm_head in); log-softmax


def _bert_head_saved(cfg: ModelConfig) -> int:
    return 4 * cfg.hidden + cfg.vocab_size  # dense in, gelu in, LayerNorm in, lm_head in, log-softmax


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
        attn_implementation=ATTENTION,
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
        attn_implementation=ATTENTION,
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
        attn_implementation=ATTENTION,
    )


FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        hf_config=_gpt2_config,
        embedding=lambda cfg, hf: Embedding(cfg.vocab_size, cfg.hidden, cfg.seq_len, None),
        block=lambda hf, i: Block(GPT2Block(hf, layer_idx=i)),
        head=lambda cfg, hf: Head(nn.LayerNorm(cfg.hidden, hf.layer_norm_epsilon), cfg.hidden, cfg.vocab_size, False),
        residual_projections=("attn.c_proj", "mlp.c_proj"),
        block_saved=_gpt2_block_saved,
        head_saved=_gpt2_head_saved,
    ),
    "llama": Family(
        hf_config=_llama_config,
        embedding=lambda cfg, hf: Embedding(cfg.vocab_size, cfg.hidden, None, None),
        block=lambda hf, i: Block(LlamaDecoderLayer(hf, layer_idx=i), LlamaRotaryEmbedding(hf)),
        head=lambda cfg, hf: Head(LlamaRMSNorm(cfg.hidden, eps=hf.rms_norm_eps), cfg.hidden, cfg.vocab_size, False),
        residual_projections=("self_attn.o_proj", "mlp.down_proj"),
        block_saved=_llama_block_saved,
        head_saved=_llama_head_saved,
    ),
    "bert": Family(
        hf_config=_bert_config,
        embedding=lambda cfg, hf: Embedding(cfg.vocab_size, cfg.hidden, cfg.seq_len, hf.layer_norm_eps),
        block=lambda hf, i: Block(BertLayer(hf, layer_idx=i)),
        head=lambda cfg, hf: Head(BertPredictionHeadTransform(hf), cfg.hidden, cfg.vocab_size, True),
        residual_projections=("attention.output.dense", "layer.output.dense"),
        block_saved=_bert_block_saved,
        head_saved=_bert_head_saved,
    ),
}
