"""Per-layer costs of a model on a device: measured for real, or derived from FLOPs for a GPU type.

Planners (Oobleck's templates, ReCycle's schedule) and the simulator read a ModelProfile and never the model
itself. Two sources give the same shape:

- ``measure_profile`` runs every layer on this machine: forward, full backward, and backward split into the
  input gradient and the weight gradients (what decoupled backward runs), saved activations counted by autograd's
  saved-tensor hooks, and link bandwidths measured between two local gloo processes. Results are cached as JSON
  under a key of everything that changes them.
- ``analytic_profile`` derives the same numbers from ``layer_specs`` and a GPU in ``runtime.devices``.

Planners import this module for the dataclasses alone, so torch is imported only where something is measured.

Memory follows ``runtime.model.training_memory_bytes``: fp32 weights (``param_bytes``) and 12 more bytes per
parameter for the gradient and AdamW's two moments (``optimizer_bytes``).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from runtime.devices import device as device_spec

if TYPE_CHECKING:
    import torch

    from runtime.model import LayerSpec, ModelConfig

FP32 = 4
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 gradient + AdamW's exp_avg and exp_avg_sq
DEFAULT_CACHE_DIR = Path(".ftlab/profiles")
LINK_PROBE_BYTES = 4 << 20  # large enough to be bandwidth-bound on loopback, small enough to take milliseconds
LINK_PROBE_ROUNDS = 5


@dataclass(frozen=True)
class LayerProfile:
    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    """Times per micro-batch; the two backward halves add up to one full backward."""
    param_bytes: int
    optimizer_bytes: int
    output_bytes: int
    """Per micro-batch: what a pipeline send of this layer's output carries (0 for the last layer)."""
    saved_bytes: int
    """Per micro-batch: activations kept from forward until backward."""

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_input_s + self.bwd_weight_s


@dataclass(frozen=True)
class ModelProfile:
    model: str
    device: str
    micro_batch: int
    seq_len: int
    layers: tuple[LayerProfile, ...]
    device_memory_bytes: int
    p2p_bytes_per_s: float
    intra_node_allreduce_bytes_per_s: float
    inter_node_allreduce_bytes_per_s: float
    """All-reduce bandwidths are bus bandwidths: an all-reduce of n bytes over k ranks takes 2(k-1)/k * n / bw."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> ModelProfile:
        return ModelProfile(**{**data, "layers": tuple(LayerProfile(**layer) for layer in data["layers"])})


# ---------------------------------------------------------------------------------------------------- analytic


def profile_from_specs(
    model: str, specs: list[LayerSpec], device_name: str, micro_batch: int, seq_len: int
) -> ModelProfile:
    """A profile from per-token FLOPs and bytes: forward is bound by arithmetic or, for layers with little of it
    (an embedding lookup), by writing its activations to memory; backward is twice forward, split evenly between
    the input gradient and the weight gradients."""
    gpu = device_spec(device_name)
    tokens = micro_batch * seq_len
    layers = []
    for spec in specs:
        written = (spec.output_bytes_per_token + spec.saved_bytes_per_token) * tokens
        fwd = max(spec.fwd_flops_per_token * tokens / gpu.effective_flops, written / gpu.memory_bytes_per_s)
        layers.append(
            LayerProfile(
                fwd_s=fwd,
                bwd_input_s=fwd,
                bwd_weight_s=fwd,
                param_bytes=FP32 * spec.params,
                optimizer_bytes=OPTIMIZER_BYTES_PER_PARAM * spec.params,
                output_bytes=spec.output_bytes_per_token * tokens,
                saved_bytes=spec.saved_bytes_per_token * tokens,
            )
        )
    return ModelProfile(
        model=model,
        device=gpu.name,
        micro_batch=micro_batch,
        seq_len=seq_len,
        layers=tuple(layers),
        device_memory_bytes=gpu.memory_bytes,
        p2p_bytes_per_s=gpu.network_bytes_per_s,
        intra_node_allreduce_bytes_per_s=gpu.intra_node_bytes_per_s,
        inter_node_allreduce_bytes_per_s=gpu.network_bytes_per_s,
    )


def analytic_profile(cfg: ModelConfig, device_name: str, micro_batch: int, seq_len: int) -> ModelProfile:
    """The profile of ``cfg`` on a GPU of ``runtime.devices``; attention FLOPs are those at ``cfg.seq_len``."""
    from runtime.model import layer_specs

    return profile_from_specs(cfg.name, layer_specs(cfg), device_name, micro_batch, seq_len)


# ---------------------------------------------------------------------------------------------------- measured


@dataclass(frozen=True)
class ProfileKey:
    """Everything that changes a measured profile; a cached profile is used only for an equal key."""

    model: str
    """The model config as sorted JSON: any field of it changes the key."""
    micro_batch: int
    seq_len: int
    dtype: str
    device: str
    torch_version: str
    workers_per_node: int
    repeats: int
    warmup: int
    links: bool

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]


def device_name(device: str) -> str:
    """A name that tells machines apart: the GPU model, or the CPU model and the host memory."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {psutil.virtual_memory().total / (1 << 30):.0f} GiB"


def device_memory_bytes(device: str, workers_per_node: int) -> int:
    """A GPU's own memory, or on a CPU machine the host memory shared by the node's worker processes."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return psutil.virtual_memory().total // workers_per_node


def _fastest(run: Callable[[], float], repeats: int, warmup: int) -> float:
    """The fastest of ``repeats`` runs: other processes on a shared machine only ever add time."""
    for _ in range(warmup):
        run()
    return min(run() for _ in range(repeats))


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def measure_layer(
    cfg: ModelConfig,
    index: int,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    device: str,
    repeats: int,
    warmup: int,
) -> LayerProfile:
    """Time one layer alone as a one-layer pipeline stage, with the input it gets in a pipeline."""
    import torch

    from runtime.model import StageModule, build_layer

    stage = StageModule(cfg, {index: build_layer(cfg, index, seed=0, device=device)}).to(dtype)
    params = [p for p in stage.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(index)
    if index == 0:
        x = torch.randint(cfg.vocab_size, (micro_batch, seq_len), generator=generator).to(device)
    else:
        x = torch.randn(micro_batch, seq_len, cfg.hidden, generator=generator, dtype=dtype).to(device)
        x.requires_grad_(True)
    labels = None
    if stage.is_last:
        labels = torch.randint(cfg.vocab_size, (micro_batch, seq_len), generator=generator).to(device)

    def forward() -> torch.Tensor:
        return stage(x, labels)

    def timed_forward() -> float:
        start = time.perf_counter()
        forward()
        _sync(device)
        return time.perf_counter() - start

    def timed_full_backward() -> float:
        out = forward()
        grad = None if stage.is_last else torch.ones_like(out)
        _sync(device)
        start = time.perf_counter()
        torch.autograd.grad(out, params + ([x] if x.requires_grad else []), grad)
        _sync(device)
        return time.perf_counter() - start

    def timed_split_backward() -> tuple[float, float]:
        out = forward()
        grad = None if stage.is_last else torch.ones_like(out)
        _sync(device)
        start = time.perf_counter()
        if x.requires_grad:  # the first layer's input is token ids: it has no input gradient to compute
            torch.autograd.grad(out, [x], grad, retain_graph=True)
            _sync(device)
        middle = time.perf_counter()
        torch.autograd.grad(out, params, grad)
        _sync(device)
        return middle - start, time.perf_counter() - middle

    fwd = _fastest(timed_forward, repeats, warmup)
    full = _fastest(timed_full_backward, repeats, warmup)
    splits = [timed_split_backward() for _ in range(repeats)]
    bwd_input = min(s[0] for s in splits)
    bwd_weight = min(s[1] for s in splits)
    # Running the halves separately walks the graph twice; scale them to the full backward so that a schedule
    # without decoupling pays what it really pays, and one with decoupling sees the measured proportion.
    scale = full / (bwd_input + bwd_weight)

    out = forward()
    return LayerProfile(
        fwd_s=fwd,
        bwd_input_s=bwd_input * scale,
        bwd_weight_s=bwd_weight * scale,
        param_bytes=FP32 * sum(p.numel() for p in params),
        optimizer_bytes=OPTIMIZER_BYTES_PER_PARAM * sum(p.numel() for p in params),
        output_bytes=0 if stage.is_last else out.numel() * out.element_size(),
        saved_bytes=saved_activation_bytes(forward, params),
    )


def saved_activation_bytes(forward: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> int:
    """Bytes autograd keeps for backward during ``forward()``, each storage counted once and weights left out
    (they are held anyway and counted in param_bytes)."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(storages.values())


def _link_worker(rank: int, store_path: str, nbytes: int, rounds: int, results: mp.Queue) -> None:
    """One of two gloo processes: ping-pong for p2p bandwidth, then all-reduce for bus bandwidth."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        else:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
    p2p = 2 * rounds * nbytes / (time.perf_counter() - start)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        dist.all_reduce(buffer)
    # Two ranks: a ring all-reduce moves 2(k-1)/k = 1 times the buffer per rank.
    allreduce = rounds * nbytes / (time.perf_counter() - start)
    if rank == 0:
        results.put((p2p, allreduce))
    dist.destroy_process_group()


def measure_links(nbytes: int = LINK_PROBE_BYTES, rounds: int = LINK_PROBE_ROUNDS) -> tuple[float, float]:
    """(p2p, all-reduce) bytes/s between two fresh local processes over gloo.

    On one machine every link is loopback, so the same all-reduce figure stands for intra- and inter-node.
    """
    context = mp.get_context("spawn")  # a fork would copy this process's torch threads and state
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [context.Process(target=_link_worker, args=(r, store, nbytes, rounds, results)) for r in range(2)]
        for proc in procs:
            proc.start()
        try:
            p2p, allreduce = results.get(timeout=120)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    return p2p, allreduce


def measure_profile(
    cfg: ModelConfig,
    micro_batch: int,
    seq_len: int | None = None,
    device: str = "cpu",
    workers_per_node: int = 1,
    repeats: int = 5,
    warmup: int = 2,
    dtype: str = "float32",
    links: bool = True,
    cache_dir: str | Path | None = DEFAULT_CACHE_DIR,
) -> ModelProfile:
    """Measure every layer of ``cfg`` on ``device``, or return the cached profile of the very same setting.

    ``links=False`` skips the bandwidth probe (a few seconds to start two processes) and records infinite
    bandwidths: communication then costs nothing in the planners.
    """
    import torch

    seq_len = cfg.seq_len if seq_len is None else seq_len
    if not 0 < seq_len <= cfg.seq_len:
        raise ValueError(f"seq_len {seq_len} must be in 1..{cfg.seq_len} (the positions of model {cfg.name})")
    key = ProfileKey(
        model=json.dumps(asdict(cfg), sort_keys=True),
        micro_batch=micro_batch,
        seq_len=seq_len,
        dtype=dtype,
        device=device_name(device),
        torch_version=torch.__version__,
        workers_per_node=workers_per_node,
        repeats=repeats,
        warmup=warmup,
        links=links,
    )
    path = Path(cache_dir) / f"{cfg.name}-{key.digest()}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("key") == asdict(key):
            return ModelProfile.from_dict(cached["profile"])

    from runtime.model import num_layers

    torch_dtype = getattr(torch, dtype)
    layers = tuple(
        measure_layer(cfg, index, micro_batch, seq_len, torch_dtype, device, repeats, warmup)
        for index in range(num_layers(cfg))
    )
    p2p, allreduce = measure_links() if links else (float("inf"), float("inf"))
    profile = ModelProfile(
        model=cfg.name,
        device=key.device,
        micro_batch=micro_batch,
        seq_len=seq_len,
        layers=layers,
        device_memory_bytes=device_memory_bytes(device, workers_per_node),
        p2p_bytes_per_s=p2p,
        intra_node_allreduce_bytes_per_s=allreduce,
        inter_node_allreduce_bytes_per_s=allreduce,
    )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": asdict(key), "profile": profile.to_dict()}, indent=1))
        tmp.replace(path)  # readers never see half a file
    return profile

