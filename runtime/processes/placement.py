"""Which communication backend a job uses, and which device each worker computes on (torch-free).

NCCL only works when every worker has a GPU of its own: each worker runs on ``cuda:<device index>`` and every
tensor it computes, holds or receives lives there. ``backend=auto`` therefore chooses NCCL only when each node
counts at least ``workers_per_node`` GPUs (a node's agent reports how many it sees); when the nodes are processes of
one machine (the local launcher, or several agents on one host), they share its GPUs, so the machine must count
one per worker of every node. Otherwise gloo, on the CPU.

A worker's device index is its rank within its node plus its node's offset: 0 on a host of its own, ``node *
workers_per_node`` where nodes share a machine. A node that joins later beyond the GPUs counted at the start has no
GPU of its own: its workers stop with an error that says so, rather than share a device.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def visible_gpus() -> int:
    """GPUs this process may use, without importing torch (an agent imports none): CUDA_VISIBLE_DEVICES where set,
    else the NVIDIA driver's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(list(_NVIDIA_GPUS.iterdir()))
    except OSError:
        return 0


def choose_backend(requested: str, gpus_of_node: Mapping[int, int], workers_per_node: int, shared_machine: bool) -> tuple[str, str]:
    """(backend, why) for ``requested`` (auto, gloo or nccl); a ValueError where NCCL is asked for and cannot work."""
    if requested == "gloo":
        return "gloo", "cluster.backend=gloo"
    nodes = len(gpus_of_node)
    if shared_machine:
        have = min(gpus_of_node.values(), default=0)
        need = nodes * workers_per_node
        enough = have >= need
        counted = f"{have} GPU(s) on this machine for {nodes} node(s) x {workers_per_node} worker(s)"
    else:
        have = min(gpus_of_node.values(), default=0)
        need = workers_per_node
        enough = have >= need
        counted = f"at least {have} GPU(s) on every node for {workers_per_node} worker(s) per node"
    if requested == "nccl":
        if not enough:
            raise ValueError(f"cluster.backend=nccl needs a GPU per worker, but there are {counted}: use "
                             f"cluster.backend=gloo or fewer workers")  # fmt: skip
        return "nccl", f"cluster.backend=nccl; {counted}"
    if requested != "auto":
        raise ValueError(f"cluster.backend={requested!r}: use auto, gloo or nccl")
    if enough and have > 0:
        return "nccl", f"auto: {counted}, one each"
    return "gloo", f"auto: {counted}, too few for one each"


def device_index(node: int, local_rank: int, workers_per_node: int, shared_machine: bool) -> int:
    return (node * workers_per_node if shared_machine else 0) + local_rank
