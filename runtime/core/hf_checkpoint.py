"""A Hugging Face checkpoint read without torch: its ``config.json`` and the headers of its safetensors files.

``model=hf`` trains any decoder of ``ARCHITECTURES`` from its own ``config.json``. Preflight reads the config with
``json`` and the tensors' names and shapes from the safetensors headers (an 8-byte length, then JSON), so a wrong path,
an unsupported architecture or weights that do not fit the config are refused in milliseconds, before torch is
imported. Workers later read only their own layers' tensors, by the names ``tensor_name`` gives.

The table below is all ftlab knows per architecture: where its checkpoint keeps the token table, the learned positions,
the blocks and the final norm, and which projections carry biases. Everything else comes from the config: the
layers themselves are the architecture's own `transformers` modules (``runtime.training.model_families``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

Biases = tuple[bool, bool, bool]
"""Whether q/k/v, the attention output and the MLP projections have biases (the "llama" structure only)."""


@dataclass(frozen=True)
class Architecture:
    structure: str
    """Which parameters a layer has and which activations it keeps (``model_spec``): "gpt2" or "llama"."""
    tokens: str
    blocks: str
    """The checkpoint's prefix of block ``i``'s tensors is ``f"{blocks}.{i}."``."""
    norm: str
    positions: str | None = None
    biases: Callable[[Mapping[str, Any]], Biases] = lambda config: (False, False, False)


_LLAMA_NAMES = {"tokens": "model.embed_tokens", "blocks": "model.layers", "norm": "model.norm"}

ARCHITECTURES: dict[str, Architecture] = {
    "gpt2": Architecture("gpt2", "transformer.wte", "transformer.h", "transformer.ln_f", "transformer.wpe"),
    "llama": Architecture(
        "llama", **_LLAMA_NAMES,
        biases=lambda c: (c.get("attention_bias", False), c.get("attention_bias", False), c.get("mlp_bias", False)),
    ),  # fmt: skip
    "mistral": Architecture("llama", **_LLAMA_NAMES),
    "qwen2": Architecture("llama", **_LLAMA_NAMES, biases=lambda c: (True, False, False)),
}
LM_HEAD = "lm_head.weight"


class CheckpointError(ValueError):
    """A model.config or model.weights that ftlab cannot train from; the message says what to change."""


def config_path(config: str) -> Path:
    """The config.json a ``model.config`` names: the file itself, or the one in the directory."""
    path = Path(config)
    return path / "config.json" if path.is_dir() else path


@lru_cache(maxsize=32)
def read_config(config: str) -> Mapping[str, Any]:
    """The parsed config.json of ``model.config``, its architecture checked against ``ARCHITECTURES``."""
    path = config_path(config)
    if not path.is_file():
        raise CheckpointError(
            f"model.config={config}: no such file{' (the directory has no config.json)' if Path(config).is_dir() else ''}"
            f": give a Hugging Face model directory (save_pretrained's) or its config.json"
        )
    try:
        parsed = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"model.config={config}: {path} is not JSON ({exc})") from None
    kind = parsed.get("model_type") if isinstance(parsed, dict) else None
    if kind not in ARCHITECTURES:
        raise CheckpointError(
            f"model.config={config}: model_type {kind!r} is not supported; model=hf trains the decoders "
            f"{', '.join(ARCHITECTURES)} (BERT is model=bert-large)"
        )
    return parsed


def architecture(config: str) -> Architecture:
    return ARCHITECTURES[read_config(config)["model_type"]]


def sliding_window(config: Mapping[str, Any]) -> int | None:
    """The attention window some layer of the model uses, if any (Mistral, Qwen2 with use_sliding_window)."""
    window = config.get("sliding_window")
    if window is None or config.get("use_sliding_window") is False:
        return None
    kinds = config.get("layer_types")
    return window if kinds is None or "sliding_attention" in kinds else None


# -- the weights ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stored:
    file: str
    shape: tuple[int, ...]


def _header(file: Path) -> dict[str, Any]:
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


@lru_cache(maxsize=8)
def stored_tensors(weights: str) -> Mapping[str, Stored]:
    """Every tensor of the safetensors files in ``weights`` (a sharded checkpoint's too), by name: file and shape."""
    directory = Path(weights)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise CheckpointError(
            f"model.weights={weights}: {'no such directory' if not directory.is_dir() else 'no .safetensors file in it'}"
            f": give the directory save_pretrained wrote (model.safetensors or its shards), or leave model.weights "
            f"out to start from the seed"
        )
    found: dict[str, Stored] = {}
    for file in files:
        try:
            header = _header(file)
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"model.weights={weights}: {file.name} is not a safetensors file ({exc})") from None
        for name, entry in header.items():
            found[name] = Stored(os.fspath(file), tuple(entry["shape"]))
    return found


def tensor_name(arch: Architecture, config: Mapping[str, Any], kind: str, block: int, local: str,
                stored: Mapping[str, Stored]) -> str:  # fmt: skip
    """The checkpoint's name of parameter ``local`` of a layer (the names of ``runtime.training.model_families``'s
    Embedding, Block and Head). A head whose projection the checkpoint ties to the token table reads that table."""
    owner, _, rest = local.partition(".")
    if kind == "block":
        return f"{arch.blocks}.{block}.{rest}"
    if kind == "embedding":
        return f"{arch.tokens if owner == 'tokens' else arch.positions}.{rest}"
    if owner == "norm":
        return f"{arch.norm}.{rest}"
    tied = LM_HEAD not in stored and config.get("tie_word_embeddings", True)
    return f"{arch.tokens}.weight" if tied else LM_HEAD


def check_layer_weights(
    config: str, weights: str, index: int, kind: str, block: int, shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Refuse weights that lack a tensor of layer ``index`` or hold one of another shape than ``shapes`` says."""
    stored = stored_tensors(weights)
    arch, parsed = architecture(config), read_config(config)
    names = {local: tensor_name(arch, parsed, kind, block, local, stored) for local in shapes}
    missing = sorted(name for name in names.values() if name not in stored)
    if missing:
        raise CheckpointError(
            f"model.weights={weights} lacks layer {index}'s ({kind}) tensors {', '.join(missing)}: point model.weights "
            f"at the checkpoint of model.config={config}, or leave it out to start from the seed"
        )
    for local, name in names.items():
        if stored[name].shape != tuple(shapes[local]):
            raise CheckpointError(
                f"model.weights={weights}: tensor {name} has shape {list(stored[name].shape)} but model.config="
                f"{config} makes it {list(shapes[local])}: use the weights saved with this config"
            )
