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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, GPT2Config, LlamaConfig, PreTrainedConfig
from transformers.models.bert.modeling_bert import BertLayer, BertPredictionHeadTransform
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from ftlab.runtime.core.model_spec import ModelConfig, ffn_hidden, kv_heads


# One attention implementation for all: sdpa honours is_causal without a mask, and dispatches to fused kernels.
ATTENTION = "sdpa"


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
    ),
    "llama": Family(
        hf_config=_llama_config,
        embedding=lambda cfg, hf: Embedding(cfg.vocab_size, cfg.hidden, None, None),
        block=lambda hf, i: Block(LlamaDecoderLayer(hf, layer_idx=i), LlamaRotaryEmbedding(hf)),
        head=lambda cfg, hf: Head(LlamaRMSNorm(cfg.hidden, eps=hf.rms_norm_eps), cfg.hidden, cfg.vocab_size, False),
        residual_projections=("self_attn.o_proj", "mlp.down_proj"),
    ),
    "bert": Family(
        hf_config=_bert_config,
        embedding=lambda cfg, hf: Embedding(cfg.vocab_size, cfg.hidden, cfg.seq_len, hf.layer_norm_eps),
        block=lambda hf, i: Block(BertLayer(hf, layer_idx=i)),
        head=lambda cfg, hf: Head(BertPredictionHeadTransform(hf), cfg.hidden, cfg.vocab_size, True),
        residual_projections=("attention.output.dense", "layer.output.dense"),
    ),
}
