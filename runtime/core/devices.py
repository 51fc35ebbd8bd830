"""GPU types the analytic profile and the simulator can reason about without the hardware, and the nodes a cluster
config builds of them.

Figures are vendor datasheet numbers: dense (no structured sparsity) peaks per math mode, memory size as
``nvidia-smi`` reports it and its bandwidth, per-direction link bandwidths. The peak a job computes at follows its
``train.precision`` (``DeviceSpec.peak_flops``): fp16 and bf16 on the tensor cores, tf32 on the tensor cores with
fp32 storage, fp32 on the plain fp32 units (PyTorch leaves TF32 matmuls off unless asked). Training never reaches
peak, so compute times divide by the peak times the cluster's ``device_efficiency`` (``NodeSpec.flops``); layers
with little arithmetic (an embedding lookup) are bound by memory bandwidth instead.

Sources (peaks as fp16/bf16 tensor, tf32 tensor, fp32 non-tensor, TFLOP/s dense):
- A40: NVIDIA A40 datasheet (149.7 / 74.8 / 37.4, 48 GB GDDR6 at 696 GB/s, PCIe Gen4 x16 = 32 GB/s per direction;
  A40 servers rarely bridge more than pairs with NVLink, so PCIe is the intra-node path). Network: the 200 Gb/s
  ConnectX-6 InfiniBand of the Oobleck paper's A40 cluster (SOSP'23, Section 7.1).
- A100-40GB, A100-80GB (SXM4): NVIDIA A100 datasheet (312 / 156 / 19.5, 40 GB HBM2 at 1555 GB/s or 80 GB HBM2e at
  2039 GB/s, NVLink 3 at 600 GB/s bidirectional = 300 GB/s per direction). Network: DGX A100, one 200 Gb/s HDR
  InfiniBand port per GPU.
- V100-16GB (SXM2): NVIDIA V100 datasheet (125 fp16, no bf16, no tf32 / 15.7, 16 GB HBM2 at 900 GB/s, NVLink 2 at
  300 GB/s bidirectional = 150 GB/s per direction). Network: AWS p3.16xlarge, 25 Gb/s per node (shared by its 8
  GPUs).
- H100-80GB (SXM5): NVIDIA H100 datasheet (989 / 494 / 67, 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s
  bidirectional = 450 GB/s per direction). Network: DGX H100, one 400 Gb/s ConnectX-7 port per GPU.
- H100-80GBx8: a DGX H100's eight H100s as one device, tensor-parallel over NVLink (ftlab has no tensor
  parallelism: a model too large for one GPU runs with one worker per node of eight): eight times an H100's
  compute, memory, memory bandwidth and network (its eight ports); its tensor-parallel all-reduces are not costed.
- H200-141GB (SXM): NVIDIA H200 datasheet (the H100's peaks, 141 GB HBM3e at 4.8 TB/s, of which ``nvidia-smi``
  reports 140 GiB; NVLink 4 as the H100's). Network: DGX H200, one 400 Gb/s ConnectX-7 port per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

GIB = 1 << 30
GB_S = 1e9
GBIT_S = 1e9 / 8
TFLOPS = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    tensor_flops: float
    """Dense fp16 tensor-core FLOP/s (bf16's too, where it computes bf16)."""
    tf32_flops: float | None
    """Dense tf32 tensor-core FLOP/s; None where it has no tf32 (Volta)."""
    fp32_flops: float
    """fp32 FLOP/s off the tensor cores."""
    memory_bytes: int
    memory_bytes_per_s: float
    intra_node_bytes_per_s: float
    """GPU to GPU inside a node, one direction (NVLink, or PCIe where there is none)."""
    network_bytes_per_s: float
    """The inter-node network of its reference server, per GPU, one direction: a node's network unless its cluster
    states one (``cluster.node_network_gbps``) is this times its GPUs."""
    latency_s: float
    """Per message across nodes: the network's small-message latency (InfiniBand about 2 us end to end, 25 Gb/s
    Ethernet with TCP some 20 us), plus a few microseconds of launching the collective or send."""
    bf16: bool = True
    """Whether its tensor cores compute bf16 (Volta has fp16 only)."""

    def computes(self, precision: str) -> bool:
        return self._peak(precision) is not None

    def peak_flops(self, precision: str) -> float:
        """The dense peak of ``train.precision``'s math mode."""
        peak = self._peak(precision)
        if peak is None:
            raise ValueError(f"a {self.name} does not compute {precision}")
        return peak

    def _peak(self, precision: str) -> float | None:
        return {
            "fp32": self.fp32_flops,
            "tf32": self.tf32_flops,
            "bf16": self.tensor_flops if self.bf16 else None,
            "fp16": self.tensor_flops,
        }[precision]


DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("A40", 149.7 * TFLOPS, 74.8 * TFLOPS, 37.4 * TFLOPS, 48 * GIB, 696 * GB_S, 32 * GB_S, 200 * GBIT_S,
                   10e-6),
        DeviceSpec("A100-40GB", 312 * TFLOPS, 156 * TFLOPS, 19.5 * TFLOPS, 40 * GIB, 1555 * GB_S, 300 * GB_S,
                   200 * GBIT_S, 10e-6),
        DeviceSpec("A100-80GB", 312 * TFLOPS, 156 * TFLOPS, 19.5 * TFLOPS, 80 * GIB, 2039 * GB_S, 300 * GB_S,
                   200 * GBIT_S, 10e-6),
        DeviceSpec("V100-16GB", 125 * TFLOPS, None, 15.7 * TFLOPS, 16 * GIB, 900 * GB_S, 150 * GB_S, 25 * GBIT_S / 8,
                   30e-6, bf16=False),
        DeviceSpec("H100-80GB", 989 * TFLOPS, 494 * TFLOPS, 67 * TFLOPS, 80 * GIB, 3350 * GB_S, 450 * GB_S,
                   400 * GBIT_S, 10e-6),
        DeviceSpec("H100-80GBx8", 8 * 989 * TFLOPS, 8 * 494 * TFLOPS, 8 * 67 * TFLOPS, 8 * 80 * GIB, 8 * 3350 * GB_S,
                   450 * GB_S, 8 * 400 * GBIT_S, 10e-6),
        DeviceSpec("H200-141GB", 989 * TFLOPS, 494 * TFLOPS, 67 * TFLOPS, 140 * GIB, 4800 * GB_S, 450 * GB_S,
                   400 * GBIT_S, 10e-6),
    )
}  # fmt: skip


def device(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}") from None


class NodeSettings(Protocol):
    """The ``cluster.*`` settings a node is built from (``runtime.core.config.ClusterConfig``)."""

    device: str
    workers_per_node: int
    device_efficiency: float
    node_network_gbps: float | None
    intra_node_gbps: float | None


@dataclass(frozen=True)
class NodeSpec:
    """A node as a cluster config has it: its GPUs, the link between them, its network, and the fraction of peak
    its GPUs reach in training."""

    gpu: DeviceSpec
    gpus: int
    network_bytes_per_s: float
    """The node's network, all its GPUs together, one direction."""
    intra_node_bytes_per_s: float
    efficiency: float

    @property
    def gpu_network_bytes_per_s(self) -> float:
        """One GPU's share of the node's network. A plan's GPUs reach the network at the same moments (every
        pipeline sends its activations in the same phase, every replica set all-reduces at the end of the
        iteration), so each gets the node's network over its GPUs."""
        return self.network_bytes_per_s / self.gpus

    def flops(self, precision: str) -> float:
        """What one GPU computes at in ``precision``: its peak times the efficiency."""
        return self.gpu.peak_flops(precision) * self.efficiency


def node_spec(c: NodeSettings) -> NodeSpec:
    """The node of ``c``: its own network and intra-node link where it states them, the device's otherwise."""
    gpu = device(c.device)
    per_gpu = gpu.network_bytes_per_s
    network = per_gpu * c.workers_per_node if c.node_network_gbps is None else c.node_network_gbps * GBIT_S
    intra = gpu.intra_node_bytes_per_s if c.intra_node_gbps is None else c.intra_node_gbps * GBIT_S
    return NodeSpec(gpu, c.workers_per_node, network, intra, c.device_efficiency)
