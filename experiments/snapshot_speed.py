"""REFT's snapshot and restore paths against this machine's memory speed, in one process (``bench_snapshots``'
first part).

The bytes are those one worker writes in the overhead job's layout: stage 0 of a PP x DP grid of ``model``, every
member holding the group's state after an optimizer step, ARC's records (its shard and a copy of its peer's). Each
figure is the fastest of ``reps`` timings (the code's own cost: on a shared machine a slower one measures the
neighbours), one thread (``torch.set_num_threads(1)``), the candidates interleaved rep by rep, each starting with the
caches holding other bytes (``EVICT_BYTES`` written before it), as a snapshot's copy starts beside an iteration:

- ``memcpy``: a single-threaded copy of the same number of bytes between two buffers touched beforehand, the unit
  of every ratio;
- ``checksum_<name>``: each checksum candidate over the same bytes (``zlib.crc32`` as the reference; XXH3, which
  ``runtime.state.shm`` uses; CRC32C where its package is installed);
- ``snapshot``: the CPU time of ``write_records`` (copy, checksum, commit), the files touched by earlier snapshots
  as in a running job;
- ``shm_read``: the kernel's copy of the same records out of ``/dev/shm`` into a buffer (``readinto``), the floor of
  any restore by a process that has not mapped them (one restarted);
- ``fresh_pages``: faulting in new memory for the moments a restore sets (``snapshot_load.Fresh``, one write per
  4 KiB page), which a new process pays whatever it loads them from;
- ``restore``: reading the worker's own records back (checksums verified) into freshly built layers and their
  optimizer state, as a restarted worker does (``Worker._load_from_memory`` for records on its own node): the
  kernel's copy into moments whose fresh pages it faults in (huge pages where the host has them), then a checksum
  from cache;
- ``storage_cold`` and ``storage_cached``: the same layers loaded from a storage checkpoint of them (one file per
  layer, written and fsynced as ``protection=storage`` writes them, loaded as ``Worker._restore`` loads them), first
  with the files' pages dropped from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` after the fsync: the read
  goes to the device), then with them cached.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from ftlab.runtime.core.model_spec import load_model_config, num_layers
from ftlab.runtime.core.plan import grid_plan
from ftlab.runtime.core.snapshot_layout import groups_of, records_to_write
from ftlab.runtime.state import checkpoint, shm
from ftlab.runtime.state.snapshot import ShardFiles, member_state, write_records
from ftlab.runtime.state.snapshot_load import Fresh, LocalRecord, load_into
from ftlab.runtime.training.layer_state import decode, encode, layer_state
from ftlab.runtime.training.model import build_layer
from ftlab.runtime.training.optim import OptimSettings, layer_optimizer

SEED = 1
EVICT_BYTES = 256 << 20
"""Written before each timing, so that none starts with its bytes in a cache."""
OPTIM = OptimSettings(lr=1e-3, min_lr=1e-4, warmup_steps=1, total_steps=100, weight_decay=0.01, beta1=0.9, beta2=0.95)


def checksums() -> dict[str, Callable[[np.ndarray], int]]:
    """The candidates: zlib's CRC-32, XXH3 (64 and 128 bits) and, where installed, hardware CRC32C."""
    found: dict[str, Callable[[np.ndarray], int]] = {
        "zlib.crc32": zlib.crc32, "xxh3_64": xxhash.xxh3_64_intdigest, "xxh3_128": xxhash.xxh3_128_intdigest,
    }  # fmt: skip
    try:
        import crc32c  # not a dependency: measured where someone installed it
    except ImportError:
        return found
    found["crc32c"] = crc32c.crc32c
    return found


def trained_layers(model: Any, layers: tuple[int, ...]) -> tuple[dict[int, torch.nn.Module], dict[int, torch.optim.Optimizer]]:
    """The layers with optimizer state after one step (so both moments exist)."""
    modules = {i: build_layer(model, i, SEED) for i in layers}
    optimizers = {i: layer_optimizer(modules[i], OPTIM) for i in layers}
    for i, module in modules.items():
        for p in module.parameters():
            p.grad = torch.randn_like(p)
        optimizers[i].step()
    return modules, optimizers


def fresh_layers(model: Any, layers: tuple[int, ...]) -> tuple[dict[int, torch.nn.Module], dict[int, torch.optim.Optimizer]]:
    modules = {i: build_layer(model, i, SEED + 1) for i in layers}
    return modules, {i: layer_optimizer(modules[i], OPTIM) for i in layers}


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_storage(directory: Path, layers: tuple[int, ...], modules: dict[int, torch.nn.Module],
                 optimizers: dict[int, torch.optim.Optimizer]) -> None:  # fmt: skip
    for index in layers:  # as Worker._restore loads a StorageSource
        state = decode(checkpoint.layer_path(directory, index).read_bytes())
        modules[index].load_state_dict(state["module"])
        optimizers[index].load_state_dict(state["optimizer"])


def measure(model_name: str, stages: int, replicas: int, scratch: Path, memory: Path, reps: int) -> dict[str, Any]:
    """Seconds per figure (the fastest of ``reps``), the bytes, and each figure over memcpy's time for the same bytes.
    The records go in ``memory`` (a folder of a node's memory: under ``/dev/shm`` as in a job), the storage
    checkpoint in ``scratch`` (on disk)."""
    torch.set_num_threads(1)
    model = load_model_config(model_name)
    plan = grid_plan(list(range(stages * replicas)), stages, num_layers(model), 2 * replicas, 1)
    group = groups_of(plan)[0]
    worker = group.holders[0]
    records = records_to_write(plan, "arc", 1)[worker]
    modules, optimizers = trained_layers(model, group.layers)
    states = {group.layers: member_state(model, group, modules, optimizers)}
    files = ShardFiles(memory)
    for step in range(2):  # both slots of every file touched, as after a job's first two snapshots
        written = write_records(files, states, records, step, step - 1)
    nbytes = sum(r.nbytes for r in written)
    source, target = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    evict = np.zeros(EVICT_BYTES, np.uint8)
    storage = scratch / "checkpoint"
    paths = []
    for index in group.layers:  # as protection=storage saves a layer (Worker._checkpoint)
        paths.append(checkpoint.layer_path(storage, index))
        checkpoint.atomic_write(paths[-1], encode(layer_state(modules[index], optimizers[index])))

    def snapshot(rep: int) -> float:
        started = time.thread_time()
        write_records(files, states, records, 2 + rep, 1 + rep)
        return time.thread_time() - started

    moments = [p for index in group.layers for p in modules[index].parameters()] * 2

    def fresh_pages() -> float:
        started = time.perf_counter()
        fresh = Fresh(moments)
        for p in moments:
            fresh.like(p).view(-1).view(torch.uint8)[:: shm.PAGE].zero_()
        return time.perf_counter() - started

    def restore(rep: int) -> float:
        step = 2 + rep
        into = fresh_layers(model, group.layers)  # built before the clock starts, as a worker builds them
        started = time.perf_counter()
        load_into(model, group, {r.index: LocalRecord(memory, r, step) for r in written}, *into)
        return time.perf_counter() - started

    def storage_load(cold: bool) -> float:
        into = fresh_layers(model, group.layers)
        if cold:
            drop_cache(paths)
        started = time.perf_counter()
        load_storage(storage, group.layers, *into)
        return time.perf_counter() - started

    def shm_read() -> float:
        started = time.perf_counter()
        for record in written:
            with open(memory / record.name, "rb") as f:
                f.readinto(target[: record.nbytes])  # type: ignore[arg-type]
        return time.perf_counter() - started

    timings: dict[str, list[float]] = {}
    candidates = checksums()
    for rep in range(reps):
        timed: dict[str, Callable[[], float]] = {
            "memcpy": lambda: _timed(lambda: np.copyto(target, source)),
            **{f"checksum_{name}": (lambda f=f: _timed(lambda: f(target))) for name, f in candidates.items()},
            "snapshot": lambda: snapshot(rep),
            "shm_read": shm_read,
            "fresh_pages": fresh_pages,
            "restore": lambda: restore(rep),
            "storage_cold": lambda: storage_load(True),
            "storage_cached": lambda: storage_load(False),
        }  # fmt: skip
        for name, run in timed.items():
            evict.fill(rep)  # every figure starts from memory, as after an iteration of training
            timings.setdefault(name, []).append(run())
    seconds = {name: min(values) for name, values in timings.items()}
    ratios = {f"{name}_vs_memcpy": s / seconds["memcpy"] for name, s in seconds.items() if name != "memcpy"}
    return {
        "bytes": nbytes, "layers": list(group.layers), "memcpy_gb_s": nbytes / seconds["memcpy"] / 1e9,
        "seconds": seconds, "ratios": ratios,
        "load_speedup_cold": seconds["storage_cold"] / seconds["restore"],
        "load_speedup_cached": seconds["storage_cached"] / seconds["restore"],
    }  # fmt: skip


def _timed(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started
