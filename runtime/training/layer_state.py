"""A layer's state (parameters and optimizer state) as bytes: what a checkpoint file and a layer transfer carry."""

from __future__ import annotations

import io
from typing import Any

import torch


def layer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"module": module.state_dict(), "optimizer": optimizer.state_dict()}


def encode(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def decode(data: bytes) -> dict[str, Any]:
    """On the CPU whatever device wrote it: ``load_state_dict`` copies it onto the receiving layer's device."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
