"""Per-layer costs of a model on a device: measured for real, or derived from FLOPs for a GPU type.

Planners (Oobleck's templates, ReCycle's schedule) and the simulator read a ``runtime.core.costs.ModelProfile`` and never
the model itself. Two sources give the same shape:

- ``measure_profile`` runs every layer on this machine: forward, full backward, backward split into the input
  gradient and the weight gradients (what decoupled backward runs), and one optimizer step; and it measures the
  links between two local gloo processes (bandwidth and per-message latency). Results are cached as JSON under a key
  of everything that changes them; the cache is read without importing torch.
- ``analytic_profile`` derives the same numbers from ``layer_specs`` and a GPU in ``runtime.core.devices``.

Memory figures come from ``runtime.core.model_spec`` in both cases (``costs.layer_bytes``): one formula for every planner.
Torch is imported only where something is measured.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from ftlab.runtime.core.costs import LayerProfile, ModelProfile, layer_bytes, profile_from_specs
from ftlab.runtime.core.devices import NodeSpec
from ftlab.runtime.training.host_allocator import steady_allocations
from ftlab.runtime.core.model_spec import ModelConfig, layer_specs, num_layers

if TYPE_CHECKING:
    import torch

    from ftlab.runtime.training.model import StageModule

LINK_PROBE_BYTES = 4 << 20  # large enough to be bandwidth-bound on loopback, small enough to take milliseconds
LINK_PROBE_ROUNDS = 5
LATENCY_PROBE_ROUNDS = 50  # one-float ping-pongs: the per-message cost a bandwidth figure leaves out


def analytic_profile(
    cfg: ModelConfig, node: NodeSpec, micro_batch: int, seq_len: int, precision: str = "fp32"
) -> ModelProfile:
    """The profile of ``cfg`` on a node of GPUs of ``runtime.core.devices``, in ``precision``; attention FLOPs are
    those at ``cfg.seq_len``."""
    return profile_from_specs(cfg.name, layer_specs(cfg), node, micro_batch, seq_len, precision)


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
    threads: int = 0
    """Torch's compute threads while measuring (0: whatever the measuring process had)."""
    format: int = 5
    """The profile's own format: 2 measures the optimizer step and the link latency; 3 records the threads; 4 times
    a one-thread CPU layer on its thread's CPU time (``layer_clock``); 5 times layers with the workers' fixed malloc
    thresholds (``runtime.training.host_allocator``)."""

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:20]


def device_name(device: str) -> str:
    """A name that tells machines apart: the GPU model, or the CPU model and the host memory."""
    if device.startswith("cuda"):
        import torch

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


def layer_clock(device: str, threads: int) -> Callable[[], float]:
    """The clock a layer is timed on. A CPU layer computed by one torch thread runs on the calling thread alone
    (autograd too), so that thread's CPU time is the layer's cost: on a shared machine the wall clock also counts
    whatever other processes took of the core meanwhile, which even the fastest of a few repeats keeps when every
    repeat is longer than the scheduler's time slice (what the simulator models instead, with ``sim.host_cores``).
    Anything else (a GPU, several threads) is timed on the wall clock."""
    return time.thread_time if device == "cpu" and threads == 1 else time.perf_counter


def stage_inputs(
    cfg: ModelConfig, stage: StageModule, micro_batch: int, seq_len: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The input a pipeline stage (a ``StageModule``) gets, seeded by its first layer: token ids for the first stage,
    hidden states (with their gradient) for the others; and the labels the last stage computes its loss on."""
    import torch

    generator = torch.Generator().manual_seed(stage.start)
    if stage.start == 0:
        x = torch.randint(cfg.vocab_size, (micro_batch, seq_len), generator=generator).to(device)
    else:
        x = torch.randn(micro_batch, seq_len, cfg.hidden, generator=generator, dtype=dtype).to(device)
        x.requires_grad_(True)
    labels = None
    if stage.is_last:
        labels = torch.randint(cfg.vocab_size, (micro_batch, seq_len), generator=generator).to(device)
    return x, labels


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
    clock: Callable[[], float] = time.perf_counter,
) -> LayerProfile:
    """Time one layer alone as a one-layer pipeline stage, with the input it gets in a pipeline, on ``clock``
    (``layer_clock``)."""
    import torch

    from ftlab.runtime.training.model import StageModule, build_layer
    from ftlab.runtime.training.optim import OptimSettings, layer_optimizer

    stage = StageModule(cfg, {index: build_layer(cfg, index, seed=0, device=device)}).to(dtype)
    params = [p for p in stage.parameters() if p.requires_grad]
    x, labels = stage_inputs(cfg, stage, micro_batch, seq_len, dtype, device)

    def forward() -> torch.Tensor:
        return stage(x, labels)

    def timed_forward() -> float:
        start = clock()
        forward()
        _sync(device)
        return clock() - start

    def timed_full_backward() -> float:
        out = forward()
        grad = None if stage.is_last else torch.ones_like(out)
        _sync(device)
        start = clock()
        torch.autograd.grad(out, params + ([x] if x.requires_grad else []), grad)
        _sync(device)
        return clock() - start

    def timed_split_backward() -> tuple[float, float]:
        out = forward()
        grad = None if stage.is_last else torch.ones_like(out)
        _sync(device)
        start = clock()
        if x.requires_grad:  # the first layer's input is token ids: it has no input gradient to compute
            torch.autograd.grad(out, [x], grad, retain_graph=True)
            _sync(device)
        middle = clock()
        torch.autograd.grad(out, params, grad)
        _sync(device)
        return middle - start, clock() - middle

    optimizer = layer_optimizer(stage, OptimSettings(1e-3, 1e-4, 1, 10, 0.01, 0.9, 0.95))

    def timed_optimizer_step() -> float:
        for p in params:
            p.grad = torch.ones_like(p)
        _sync(device)
        start = clock()
        optimizer.step()
        _sync(device)
        return clock() - start

    fwd = _fastest(timed_forward, repeats, warmup)
    full = _fastest(timed_full_backward, repeats, warmup)
    splits = [timed_split_backward() for _ in range(repeats)]
    bwd_input = min(s[0] for s in splits)
    bwd_weight = min(s[1] for s in splits)
    # Running the halves separately walks the graph twice; scale them to the full backward so that a schedule
    # without decoupling pays what it really pays, and one with decoupling sees the measured proportion.
    scale = full / (bwd_input + bwd_weight)

    return LayerProfile(
        fwd_s=fwd,
        bwd_input_s=bwd_input * scale,
        bwd_weight_s=bwd_weight * scale,
        optimizer_s=_fastest(timed_optimizer_step, repeats, warmup),
        **layer_bytes(layer_specs(cfg)[index], micro_batch, seq_len),
    )


def fastest_of(first: ModelProfile, second: ModelProfile) -> ModelProfile:
    """Two measurements of one setting as one: each layer's fastest times and the faster links, since other
    processes on a shared machine only ever add time."""
    layers = tuple(
        replace(a, fwd_s=min(a.fwd_s, b.fwd_s), bwd_input_s=min(a.bwd_input_s, b.bwd_input_s),
                bwd_weight_s=min(a.bwd_weight_s, b.bwd_weight_s), optimizer_s=min(a.optimizer_s, b.optimizer_s))
        for a, b in zip(first.layers, second.layers, strict=True)
    )  # fmt: skip
    return replace(
        first, layers=layers, p2p_bytes_per_s=max(first.p2p_bytes_per_s, second.p2p_bytes_per_s),
        intra_node_allreduce_bytes_per_s=max(first.intra_node_allreduce_bytes_per_s,
                                             second.intra_node_allreduce_bytes_per_s),
        inter_node_allreduce_bytes_per_s=max(first.inter_node_allreduce_bytes_per_s,
                                             second.inter_node_allreduce_bytes_per_s),
        latency_s=min(first.latency_s, second.latency_s),
    )  # fmt: skip


def _ping_pong(rank: int, buffer: torch.Tensor, rounds: int) -> float:
    """Seconds for ``rounds`` round trips of ``buffer`` between the two ranks."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        else:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
    return time.perf_counter() - start


def _link_worker(rank: int, store_path: str, nbytes: int, rounds: int, results: mp.Queue) -> None:
    """One of two gloo processes: ping-pong for p2p bandwidth and latency, then all-reduce for bus bandwidth."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    latency = _ping_pong(rank, torch.ones(1), LATENCY_PROBE_ROUNDS) / (2 * LATENCY_PROBE_ROUNDS)
    elapsed = _ping_pong(rank, buffer, rounds)
    # The bandwidth term is what the messages cost beyond their latency (at least half, against noise).
    p2p = 2 * rounds * nbytes / max(elapsed - 2 * rounds * latency, elapsed / 2)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        dist.all_reduce(buffer)
    # Two ranks: a ring all-reduce moves 2(k-1)/k = 1 times the buffer per rank.
    allreduce = rounds * nbytes / (time.perf_counter() - start)
    if rank == 0:
        results.put((p2p, allreduce, latency))
    dist.destroy_process_group()


@dataclass(frozen=True)
class HostLoad:
    """What ``cores_by_load`` measured: each sweep's rates, entry 0 each process's alone, entry k - 1 the first k's
    side by side."""

    sweeps: tuple[tuple[tuple[float, ...], ...], ...]

    @property
    def worth(self) -> tuple[float, ...]:
        """The cores' worth k processes computing at once got together, k = 1 .. n (``sim.host_cores_by_load``),
        each sweep's rates counted against its own rates alone: entry 0 is 1. Each number's median over the sweeps."""
        return _medians(_worth(sweep) for sweep in self.sweeps)

    @property
    def alone(self) -> tuple[float, ...]:
        """Each process's rate alone, micro-batches a second (the median over the sweeps): over the rate the
        simulation charges its layers, how fast this host computes them (``sim.host_layer_speed``)."""
        return _medians(sweep[0] for sweep in self.sweeps)


def _medians(rows: Iterable[Sequence[float]]) -> tuple[float, ...]:
    """Each column's median."""
    return tuple(statistics.median(column) for column in zip(*rows, strict=True))


def _worth(sweep: tuple[tuple[float, ...], ...]) -> list[float]:
    """One sweep's cores' worth by number at once, each rate counted against the process's rate alone: one alone,
    then the sum over the first k side by side (at least 0.05: a process the scheduler starved for the whole
    measurement still counts)."""
    alone, *together = sweep
    return [1.0, *(max(sum(r / a for r, a in zip(first_k, alone)), 0.05) for first_k in together)]


def cores_by_load(
    cfg: ModelConfig, ranges: list[tuple[int, int]], micro_batch: int, seq_len: int, threads: int = 1,
    seconds: float = 1.5, sweeps: int = 1,
) -> HostLoad:  # fmt: skip
    """The cores' worth a job's workers get when ``k`` of them compute at once, for k = 1 .. len(ranges) (the
    simulator's ``sim.host_cores_by_load``): one process per worker, each computing the forward and backward of its
    layers ``ranges[i]`` (start, stop) over and over, first each alone, then the first k side by side for every k >= 2;
    each's rate side by side over its rate alone, added up. One alone is the reference: entry 0 is 1.

    Unlike ``host_share``'s spinners, which touch no memory, this counts what the workers' own computations cost
    each other: their working sets in the shared caches and the switches between more processes than cores. And it
    counts them for each number at once, since a pipeline's workers do not all compute at every moment: past the
    cores, more processes of a plan's stages get fewer cores' worth than the core count, where spinners get the
    core count for any number. Alone means alone among these processes: other load on the machine slows both runs.

    ``sweeps``: measure every number that many times over, one number after the other in each sweep, and keep each
    number's median: on a shared machine one sweep differs enough from the next to put a simulation off by
    itself."""
    context = mp.get_context("spawn")  # each process builds its layers with torch of its own
    out = context.Queue()
    commands = [context.Queue() for _ in ranges]
    procs = [
        context.Process(target=_compute, args=(i, cfg, start, stop, micro_batch, seq_len, threads, commands[i], out))
        for i, (start, stop) in enumerate(ranges)
    ]  # fmt: skip
    for proc in procs:
        proc.start()

    def sweep() -> tuple[tuple[float, ...], ...]:
        """Each process's rate alone, then the first k's side by side for k = 2 .. n."""
        solo = {}
        for command in commands:  # one at a time, the others waiting
            command.put(seconds / 2)
            index, rate = out.get(timeout=300)
            solo[index] = rate
        rates = [tuple(solo[i] for i in range(len(procs)))]
        for k in range(2, len(procs) + 1):
            for command in commands[:k]:
                command.put(seconds)
            rates.append(tuple(rate for _, rate in sorted(out.get(timeout=300) for _ in range(k))))
        return tuple(rates)

    try:
        for _ in procs:  # every process built and warmed up: none is still starting while another runs alone
            out.get(timeout=300)
        measured = tuple(sweep() for _ in range(sweeps))
    finally:
        for command in commands:
            command.put(None)
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return HostLoad(measured)


def _compute(
    index: int, cfg: ModelConfig, start: int, stop: int, micro_batch: int, seq_len: int, threads: int,
    commands: Any, out: Any,  # noqa: ANN401 - multiprocessing queues
) -> None:  # fmt: skip
    """``cores_by_load``'s process ``index``: layers [start, stop) computed as their worker computes them, for as many
    seconds as each command says (None: done), reporting its rate."""
    import torch

    from ftlab.runtime.processes.agent import die_with_parent
    from ftlab.runtime.training.model import StageModule, build_layer

    die_with_parent()  # a measurement interrupted (its caller killed) leaves no process waiting for commands
    torch.set_num_threads(threads)
    steady_allocations()
    stage = StageModule(cfg, {i: build_layer(cfg, i, seed=0) for i in range(start, stop)})
    x, labels = stage_inputs(cfg, stage, micro_batch, seq_len, torch.float32, "cpu")

    def rate(duration: float) -> float:
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < duration:
            result = stage(x, labels)
            result.backward(None if stage.is_last else torch.ones_like(result))
            done += 1
        return done / (time.perf_counter() - started)

    rate(0.2)  # warm-up: first allocations, caches
    out.put((index, None))  # built and warmed up
    while (duration := commands.get()) is not None:
        out.put((index, rate(duration)))


def _spin(go: Any, seconds: float, out: Any) -> None:  # noqa: ANN401 - a multiprocessing event and queue
    """A single-threaded CPU-bound process for ``seconds`` of wall time from ``go``: the share of a core it got."""
    go.wait()
    started, cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - started < seconds:
        sum(range(10_000))
    out.put((time.thread_time() - cpu) / (time.perf_counter() - started))


def host_share(processes: int, seconds: float = 1.5) -> float:
    """How many cores ``processes`` CPU-bound processes get now: the shares of a core each got, running side by
    side for ``seconds`` (its CPU time over the wall time), added up. On a shared machine this is what a job of as
    many worker processes gets from the scheduler beside everyone else's processes (``sim.host_cores``).

    The spinners start spinning together, once every one of them has started: one started early would spin alone
    for a while and count cores that the job's workers, all busy at once, never get."""
    context = mp.get_context("fork")  # a spinner needs nothing of this process: the cheapest start
    out, go = context.Queue(), context.Event()
    procs = [context.Process(target=_spin, args=(go, seconds, out)) for _ in range(processes)]
    for proc in procs:
        proc.start()
    go.set()
    shares = [out.get() for _ in procs]
    for proc in procs:
        proc.join()
    return max(sum(shares), 0.05)


def measure_links(nbytes: int = LINK_PROBE_BYTES, rounds: int = LINK_PROBE_ROUNDS) -> tuple[float, float, float]:
    """(p2p bytes/s, all-reduce bytes/s, seconds per message) between two fresh local processes over gloo.

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
            p2p, allreduce, latency = results.get(timeout=120)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
    return p2p, allreduce, latency


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
    cache_dir: str | Path | None = None,
    threads: int = 0,
    again: bool = False,
) -> ModelProfile:
    """Measure every layer of ``cfg`` on ``device``, or return the cached profile of the very same setting.

    ``again``: measure even where a profile is cached, and cache the fastest of both (``fastest_of``): a profile
    taken while other load held the cores is slow for as long as that load lasted, and two profiles minutes apart
    on a shared machine can differ by far more than the simulator's targets.

    ``links=False`` skips the bandwidth probe (a few seconds to start two processes) and records infinite
    bandwidths: communication then costs nothing in the planners. ``threads``: measure with as many torch threads
    as a worker computes with (``cluster.threads_per_worker``); on a CPU a layer timed with every core is faster
    than the single-threaded worker that runs it. 0 leaves the measuring process's setting.
    """
    seq_len = cfg.seq_len if seq_len is None else seq_len
    if not 0 < seq_len <= cfg.seq_len:
        raise ValueError(f"seq_len {seq_len} must be in 1..{cfg.seq_len} (the positions of model {cfg.name})")
    key = ProfileKey(
        model=json.dumps(asdict(cfg), sort_keys=True),
        micro_batch=micro_batch,
        seq_len=seq_len,
        dtype=dtype,
        device=device_name(device),
        torch_version=importlib.metadata.version("torch"),
        workers_per_node=workers_per_node,
        repeats=repeats,
        warmup=warmup,
        links=links,
        threads=threads,
    )
    path = Path(cache_dir) / f"{cfg.name}-{key.digest()}.json" if cache_dir is not None else None
    earlier = None
    if path is not None and path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("key") == asdict(key):
            earlier = ModelProfile.from_dict(cached["profile"])
            if not again:
                return earlier

    import torch

    steady_allocations()  # as in the workers that will run these layers (``runtime.training.host_allocator``)
    torch_dtype = getattr(torch, dtype)
    clock = layer_clock(device, threads)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        layers = tuple(
            measure_layer(cfg, index, micro_batch, seq_len, torch_dtype, device, repeats, warmup, clock)
            for index in range(num_layers(cfg))
        )
    finally:
        torch.set_num_threads(before)
    p2p, allreduce, latency = measure_links() if links else (float("inf"), float("inf"), 0.0)
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
        latency_s=latency,
    )
    if earlier is not None:
        profile = fastest_of(earlier, profile)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # jobs of a parallel sweep may measure the same profile
        tmp.write_text(json.dumps({"key": asdict(key), "profile": profile.to_dict()}, indent=1))
        tmp.replace(path)  # readers never see half a file
    return profile

