"""GPU types the analytic profile and the simulator can reason about without the hardware.

Figures are vendor datasheet numbers: dense (no structured sparsity) fp16/bf16 tensor-core peak, memory size as
``nvidia-smi`` reports it and its bandwidth, per-direction link bandwidths. Training never reaches peak, so
compute times divide by ``peak_flops * UTILISATION``; layers with little arithmetic (an embedding lookup) are
bound by memory bandwidth instead.

Sources:
- A40: NVIDIA A40 datasheet (149.7 TFLOP/s fp16/bf16 dense, 48 GB GDDR6 at 696 GB/s, PCIe Gen4 x16 = 32 GB/s per
  direction; A40 servers rarely bridge more than pairs with NVLink, so PCIe is the intra-node path). Network:
  the 200 Gb/s ConnectX-6 InfiniBand of the Oobleck paper's A40 cluster (SOSP'23, Section 7.1).
- A100-40GB, A100-80GB (SXM4): NVIDIA A100 datasheet (312 TFLOP/s bf16 dense, 40 GB HBM2 at 1555 GB/s or 80 GB HBM2e at
  2039 GB/s, NVLink 3 at
  600 GB/s bidirectional = 300 GB/s per direction). Network: DGX A100, one 200 Gb/s HDR InfiniBand port per GPU.
- V100-16GB (SXM2): NVIDIA V100 datasheet (125 TFLOP/s fp16 tensor, 16 GB HBM2 at 900 GB/s, NVLink 2 at 300 GB/s
  bidirectional = 150 GB/s per direction). Network: AWS p3.16xlarge, 25 Gb/s per node (shared by its 8 GPUs).
- H100-80GB (SXM5): NVIDIA H100 datasheet (989 TFLOP/s bf16 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s
  bidirectional = 450 GB/s per direction). Network: DGX H100, one 400 Gb/s ConnectX-7 port per GPU.
- H100-80GBx8: a DGX H100's eight H100s as one device, tensor-parallel over NVLink (ftlab has no tensor
  parallelism: a model too large for one GPU runs with one worker per node of eight): eight times an H100's
  compute, memory, memory bandwidth and network (its eight ports); its tensor-parallel all-reduces are not costed.
- H200-141GB (SXM): NVIDIA H200 datasheet (the H100's 989 TFLOP/s bf16 dense, 141 GB HBM3e at 4.8 TB/s, of which
  ``nvidia-smi`` reports 140 GiB; NVLink 4 as the H100's). Network: DGX H200, one 400 Gb/s ConnectX-7 port per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
GB_S = 1e9
GBIT_S = 1e9 / 8

UTILISATION = 0.45
"""Assumed fraction of peak reached by transformer training: Megatron-LM measured 44-52% of A100 peak on GPT
models at scale (Narayanan et al., SC'21, Table 1); we take the lower half of that range."""


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float
    """Dense fp16/bf16 tensor-core FLOP/s."""
    memory_bytes: int
    memory_bytes_per_s: float
    intra_node_bytes_per_s: float
    """GPU to GPU inside a node, one direction (NVLink, or PCIe where there is none)."""
    network_bytes_per_s: float
    """What one GPU gets of the inter-node network, one direction."""
    latency_s: float
    """Per message across nodes: the network's small-message latency (InfiniBand about 2 us end to end, 25 Gb/s
    Ethernet with TCP some 20 us), plus a few microseconds of launching the collective or send."""
    bf16: bool = True
    """Whether its tensor cores compute bf16 (Volta has fp16 only): ``train.precision=bf16`` is refused otherwise."""

    @property
    def effective_flops(self) -> float:
        return self.peak_flops * UTILISATION


DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("A40", 149.7e12, 48 * GIB, 696 * GB_S, 32 * GB_S, 200 * GBIT_S, 10e-6),
        DeviceSpec("A100-40GB", 312e12, 40 * GIB, 1555 * GB_S, 300 * GB_S, 200 * GBIT_S, 10e-6),
        DeviceSpec("A100-80GB", 312e12, 80 * GIB, 2039 * GB_S, 300 * GB_S, 200 * GBIT_S, 10e-6),
        DeviceSpec("V100-16GB", 125e12, 16 * GIB, 900 * GB_S, 150 * GB_S, 25 * GBIT_S / 8, 30e-6, bf16=False),
        DeviceSpec("H100-80GB", 989e12, 80 * GIB, 3350 * GB_S, 450 * GB_S, 400 * GBIT_S, 10e-6),
        DeviceSpec("H100-80GBx8", 8 * 989e12, 8 * 80 * GIB, 8 * 3350 * GB_S, 450 * GB_S, 8 * 400 * GBIT_S, 10e-6),
        DeviceSpec("H200-141GB", 989e12, 140 * GIB, 4800 * GB_S, 450 * GB_S, 400 * GBIT_S, 10e-6),
    )
}


def device(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}") from None
