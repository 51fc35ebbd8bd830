"""A layer's starting weights from a Hugging Face checkpoint (``model.weights``): its own tensors and no others.

Each tensor is read by name with safetensors' ``safe_open(...).get_tensor``, which maps the file and copies out that
tensor alone, so a stage holding a few layers of a large model reads a few layers' bytes. Names come from
``runtime.core.hf_checkpoint.tensor_name``; preflight has already checked that every one exists in the shape the
config makes it. Tensors stored in bf16 or fp16 start fp32 master weights.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from safetensors import safe_open
from torch import nn

from ftlab.runtime.core import hf_checkpoint
from ftlab.runtime.core.model_spec import ModelConfig, layer_kind


def load_layer(cfg: ModelConfig, index: int, module: nn.Module) -> None:
    """Overwrite every parameter of layer ``index`` (built as ``module``) with its tensor from ``cfg.weights``."""
    stored = hf_checkpoint.stored_tensors(cfg.weights)
    arch, config = hf_checkpoint.architecture(cfg.config), hf_checkpoint.read_config(cfg.config)
    kind = layer_kind(cfg, index)
    by_file: dict[str, dict[str, str]] = defaultdict(dict)
    for local, _ in module.named_parameters():
        name = hf_checkpoint.tensor_name(arch, config, kind, index - 1, local, stored)
        by_file[stored[name].file][local] = name
    tensors = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            tensors.update({local: f.get_tensor(name).to(torch.float32) for local, name in names.items()})
    module.load_state_dict(tensors, strict=True)
