"""REFT-load on the worker: a group's state rebuilt in the layers it holds, from its shards, each a record on this
node, received from a peer, or decoded from parity (``runtime.core.snapshot_layout.load_plan`` says which).

A record on this node is read by the kernel straight into the parameters and fresh moments, one ``preadv`` per block
of about ``snapshot.BLOCK`` bytes (its pieces as the vectors), each block checksummed as soon as it lands, while it is
in cache; no mapping, no intermediate buffer. A mapping would cost the kernel as much (a page-table entry per 4 KiB of
``/dev/shm``) and leave the copy to do. The bytes land before they are checked: they land only in layers built for
this restore, which a failed check never lets train (the restore raises ChecksumError). A shard in memory (received,
decoded) is copied in as bytes.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ftlab.runtime.core.contract import MemoryRecord
from ftlab.runtime.core.model_spec import ModelConfig
from ftlab.runtime.core.snapshot_layout import Geometry, Group, parity_sources
from ftlab.runtime.state import shm
from ftlab.runtime.state.snapshot import BLOCK, MOMENTS, WORD, Flat, GroupState, geometry
from ftlab.runtime.training.model import layer_numels

ALIGN = 64
"""Each moment starts on a cache line, as an allocator's would."""
IOV_MAX = os.sysconf("SC_IOV_MAX")


@dataclass(frozen=True)
class LocalRecord:
    """A record of ``step`` on this node, not read yet: a restore reads it straight into the layers; a decode or a
    send reads its bytes (``data``)."""

    directory: Path
    record: MemoryRecord
    step: int

    @property
    def path(self) -> Path:
        return self.directory / self.record.name

    def data(self) -> torch.Tensor:
        return read_record(self.directory, self.record, self.step, self.record.nbytes)


Shard = torch.Tensor | LocalRecord
"""A shard's bytes in memory, or the record on this node that holds them."""


def read_record(directory: Path, record: MemoryRecord, step: int, nbytes: int) -> torch.Tensor:
    """A record of ``step`` from this node's memory (its bytes, read in place: no copy), checked against its slot's
    checksum and the one reported when it was written; ChecksumError if it does not match (it is never loaded)."""
    path = directory / record.name
    if not path.exists():
        raise shm.ChecksumError(f"{record.name} is not in this node's memory")
    return torch.frombuffer(shm.read_verified(memoryview(shm.map_file(path, nbytes)), nbytes, step, record.crc or None),
                            dtype=torch.uint8)  # fmt: skip


def _data(shard: Shard) -> torch.Tensor:
    return shard.data() if isinstance(shard, LocalRecord) else shard


def decode_shard(geometry: Geometry, missing: int, shards: dict[int, Shard], parities: dict[int, Shard]) -> torch.Tensor:
    """Shard ``missing`` (its bytes) from the other shards and the other members' parities (each sub-chunk j of it
    is p_k XOR the other shards' sub-chunks in p_k, k = others(missing)[j])."""
    m, length = geometry.members, geometry.sub_chunk
    out = torch.empty(geometry.shard * WORD, dtype=torch.uint8)
    bits = out.view(torch.int32)
    words = {i: _data(s).view(torch.int32) for i, s in shards.items()}
    for k, parity in parities.items():
        sources = parity_sources(m, k)
        j = next(sub for shard, sub in sources if shard == missing)
        piece = bits[j * length : (j + 1) * length]
        piece.copy_(_data(parity).view(torch.int32))
        for shard, sub in sources:
            if shard != missing:
                piece.bitwise_xor_(words[shard][sub * length : (sub + 1) * length])
    return out


def load_into(
    model: ModelConfig, group: Group, shards: dict[int, Shard], layers: dict[int, torch.nn.Module],
    optimizers: dict[int, torch.optim.Optimizer],
) -> int:  # fmt: skip
    """Set the parameters and optimizer state of the group's layers this worker holds (built for this restore),
    byte for byte, from all the group's shards; returns the bytes set."""
    target, states = _target(model, group, layers, optimizers)
    steps = {_read_into(target, i, s) if isinstance(s, LocalRecord) and _on_host(target) else _copy_into(target, i, _data(s))
             for i, s in shards.items()}  # fmt: skip
    assert len(steps) == 1, f"shards of one snapshot at different steps {steps}"
    step = steps.pop()
    for state, device in states:
        state["step"] = torch.tensor(step, dtype=torch.float32, device=device)
    return sum(3 * t.numel() * WORD for t in target.params.tensors)


def _target(
    model: ModelConfig, group: Group, layers: dict[int, torch.nn.Module], optimizers: dict[int, torch.optim.Optimizer]
) -> tuple[GroupState, list[tuple[dict[str, torch.Tensor], torch.device]]]:
    """The group's state as the layers held will hold it (their parameters, fresh moments registered with their
    optimizers; a layer not held is a gap), and each parameter's optimizer state, whose step is set once read."""
    params: list[tuple[int, torch.Tensor]] = []
    moments: dict[str, list[tuple[int, torch.Tensor]]] = {name: [] for name in MOMENTS}
    states = []
    offset = 0
    fresh = Fresh([p for index in group.layers if index in layers for p in layers[index].parameters()] * len(MOMENTS))
    for index in group.layers:
        module = layers.get(index)
        if module is None:  # a layer of the old group this worker does not hold now
            offset += sum(layer_numels(model, index))
            continue
        for p in module.parameters():
            state = {name: fresh.like(p) for name in MOMENTS}
            optimizers[index].state[p] = state
            states.append((state, p.device))
            params.append((offset, p))
            for name in MOMENTS:
                moments[name].append((offset, state[name]))
            offset += p.numel()
    target = GroupState(geometry(model, group), Flat(params), {k: Flat(v) for k, v in moments.items()}, 0.0)
    return target, states


def _on_host(target: GroupState) -> bool:
    return all(t.device.type == "cpu" for t in target.params.tensors)


def _pieces(target: GroupState, index: int, nbytes: int) -> list[np.ndarray]:
    """The buffers that shard ``index``'s bytes land in, in order: the target's tensors, and scratch for padding,
    layers not held and the step's word (last)."""
    step = 3 * target.geometry.chunk * WORD
    buffers: list[np.ndarray] = []
    at = 0
    for offset, values in [*target.shard_pieces(index, 0, step // WORD), (step // WORD, None)]:
        if offset * WORD > at:
            buffers.append(np.empty(offset * WORD - at, np.uint8))
        if values is not None:
            buffers.append(values.view(torch.uint8).numpy())
            at = (offset + values.numel()) * WORD
    buffers.append(np.empty(nbytes - step, np.uint8))
    return buffers


def _read_into(target: GroupState, index: int, local: LocalRecord) -> float:
    """Read shard ``index`` from ``local`` into ``target``, check it, and return its step."""
    record, nbytes = local.record, local.record.nbytes
    try:
        fd = os.open(local.path, os.O_RDONLY)
    except FileNotFoundError:
        raise shm.ChecksumError(f"{record.name} is not in this node's memory") from None
    try:
        found = shm.find_slot(memoryview(os.pread(fd, shm.PAGE, 0)), local.step)
        if found is None or found[1].nbytes != nbytes:
            raise shm.ChecksumError(f"no committed slot of {record.name} holds step {local.step}")
        buffers = _pieces(target, index, nbytes)
        digest = shm.Checksum()
        at = shm.slot_offset(found[0], nbytes)
        for batch in _batches(buffers):  # each checksummed right after it lands, from cache
            want = sum(b.nbytes for b in batch)
            got = os.preadv(fd, batch, at)
            if got != want:  # a slot is never shorter than its bytes: a short read is a truncated file
                raise shm.ChecksumError(f"{record.name} ends {want - got} bytes early")
            for buffer in batch:
                digest.update(buffer)
            at += got
    finally:
        os.close(fd)
    value = digest.intdigest()
    if value != found[1].checksum or (record.crc and value != record.crc):
        raise shm.ChecksumError(f"the bytes of {record.name} at step {local.step} fail their checksum")
    return float(buffers[-1][:WORD].view(np.float32)[0])


def _batches(buffers: list[np.ndarray]) -> Iterator[list[np.ndarray]]:
    """The buffers in order, in batches of about ``BLOCK`` bytes (a larger buffer split) and ``IOV_MAX`` at most."""
    batch: list[np.ndarray] = []
    size = 0
    for buffer in buffers:
        for a in range(0, buffer.nbytes, BLOCK):
            piece = buffer[a : a + BLOCK]
            if batch and (size + piece.nbytes > BLOCK or len(batch) == IOV_MAX):
                yield batch
                batch, size = [], 0
            batch.append(piece)
            size += piece.nbytes
    if batch:
        yield batch


def _copy_into(target: GroupState, index: int, data: torch.Tensor) -> float:
    """Copy shard ``index`` from its bytes ``data`` into ``target``; returns its step."""
    for offset, values in target.shard_pieces(index, 0, 3 * target.geometry.chunk):
        values.view(torch.uint8).copy_(data[offset * WORD : (offset + values.numel()) * WORD])
    step = 3 * target.geometry.chunk * WORD
    return float(data[step : step + WORD].cpu().view(torch.float32))


class Fresh:
    """New tensors for the moments a restore sets, like their parameters. On the host they are carved from one
    mapping backed by huge pages where the kernel has them (``MADV_HUGEPAGE``): a process writing fresh memory faults
    in every page, and with 4 KiB pages that costs several times the copy into them. Each tensor still has a storage
    of its own, so a checkpoint or a transfer of one layer carries that layer's state alone."""

    def __init__(self, likes: list[torch.Tensor]) -> None:
        host = [p for p in likes if p.device.type == "cpu"]
        size = sum(_aligned(p.numel() * p.element_size()) for p in host)
        self._memory = memoryview(mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
        self._memory.obj.madvise(mmap.MADV_HUGEPAGE)  # type: ignore[union-attr]
        self._used = 0

    def like(self, p: torch.Tensor) -> torch.Tensor:
        if p.device.type != "cpu":
            return torch.empty_like(p)
        nbytes = p.numel() * p.element_size()
        piece = self._memory[self._used : self._used + nbytes]
        self._used += _aligned(nbytes)
        return torch.frombuffer(piece, dtype=p.dtype).view_as(p)  # its storage keeps the mapping


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
