"""REFT-load on the worker: a group's state rebuilt in the layers it holds, from its shards, each a record on this
node, received from a peer, or decoded from parity (``runtime.core.snapshot_layout.load_plan`` says which).

A record on this node is read by the kernel straight into the parameters and fresh moments, one ``preadv`` per block
of about ``snapshot.BLOCK`` bytes (its pieces as the vectors), each block checksummed as soon as it lands, while it is
in cache; no mapping, no intermediate buffer. A mapping would cost the kernel as much (a page-table entry per 4 KiB of
``/dev/shm``) and leave the copy to do. The bytes land before they are checked: they land only in layers built for
this restore, which a failed check never lets train (the restore raises ChecksumError). A shard in memory (received,
decoded) is copied in as bytes.

Where the bytes land is worked out once per restore as runs of contiguous memory per flat vector (``Region``): a
parameter is a run, and the fresh moments are carved in the vectors' order, so that adjacent parameters' moments are
one run. A shard's pieces are then a few slices found by bisection, not a walk over every tensor.
"""

from __future__ import annotations

import bisect
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
from ftlab.runtime.state.snapshot import BLOCK, MOMENTS, WORD, geometry
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
    steps = {_read_into(target, i, s) if isinstance(s, LocalRecord) and target.host else _copy_into(target, i, _data(s))
             for i, s in shards.items()}  # fmt: skip
    assert len(steps) == 1, f"shards of one snapshot at different steps {steps}"
    step = steps.pop()
    for state, device in states:
        state["step"] = torch.scalar_tensor(step, dtype=torch.float32, device=device)
    return sum(region.nbytes for region in target.regions)


Bytes = np.ndarray | torch.Tensor
"""Memory a restore writes, as bytes: a NumPy view of host memory (read into by the kernel, copied by ``memcpy``),
or a device tensor's bytes (copied by torch)."""


@dataclass(frozen=True)
class Region:
    """One of a group's flat vectors (its parameters, a moment) as the memory it lands in: runs of contiguous bytes,
    run i holding elements [starts[i], ends[i]) of the vector (elements in no run belong to layers not held)."""

    starts: list[int]
    ends: list[int]
    runs: list[Bytes]

    @property
    def nbytes(self) -> int:
        return (sum(self.ends) - sum(self.starts)) * WORD

    def spans(self, lo: int, hi: int) -> Iterator[tuple[int, Bytes]]:
        """(byte offset from element ``lo``, bytes) of the parts of elements [lo, hi) that the runs hold."""
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while i < len(self.runs) and self.starts[i] < hi:
            start, a, b = self.starts[i], max(lo, self.starts[i]), min(hi, self.ends[i])
            if a < b:
                yield (a - lo) * WORD, self.runs[i][(a - start) * WORD : (b - start) * WORD]
            i += 1


@dataclass(frozen=True)
class Target:
    """The group's state as the layers held will hold it: where each of its flat vectors lands (``regions``: the
    parameters, then ``MOMENTS`` in order), all on the host (``host``) or not."""

    geometry: Geometry
    regions: tuple[Region, ...]
    host: bool

    @property
    def step_at(self) -> int:
        """The byte offset of the step's word in a shard's record: after its part of the three flat vectors."""
        return 3 * self.geometry.chunk * WORD

    def spans(self, index: int) -> Iterator[tuple[int, Bytes]]:
        """(byte offset in the record, bytes) of the parts of shard ``index`` that land in the layers held, in order
        (padding, layers not held and the step's word are left out)."""
        c = self.geometry.chunk
        for number, region in enumerate(self.regions):
            for offset, run in region.spans(index * c, (index + 1) * c):
                yield number * c * WORD + offset, run


Held = list[tuple[int, int, torch.Tensor]]
"""(layer, index of its first element in the group's flat vectors, parameter) of each parameter held, in flat order."""


def _target(
    model: ModelConfig, group: Group, layers: dict[int, torch.nn.Module], optimizers: dict[int, torch.optim.Optimizer]
) -> tuple[Target, list[tuple[dict[str, torch.Tensor], torch.device]]]:
    """Where the group's state lands in the layers held (their parameters, fresh moments registered with their
    optimizers; a layer not held is a gap), and each parameter's optimizer state, whose step is set once read."""
    held = _held(model, group, layers)
    host = all(p.is_cpu for _, _, p in held)
    params = Region([offset for _, offset, _ in held], [offset + p.numel() for _, offset, p in held],
                    [_bytes(p, host) for _, _, p in held])  # fmt: skip
    fresh = Fresh([p for _, _, p in held] * len(MOMENTS))
    moments = [_fresh_moments(fresh, held, host) for _ in MOMENTS]
    states = []
    for (index, _, p), *tensors in zip(held, *(tensors for tensors, _ in moments), strict=True):
        optimizers[index].state[p] = state = dict(zip(MOMENTS, tensors, strict=True))
        states.append((state, p.device))
    return Target(geometry(model, group), (params, *(region for _, region in moments)), host), states


def _held(model: ModelConfig, group: Group, layers: dict[int, torch.nn.Module]) -> Held:
    held = []
    offset = 0
    for index in group.layers:
        module = layers.get(index)
        if module is None:  # a layer of the old group this worker does not hold now
            offset += sum(layer_numels(model, index))
            continue
        for p in module.parameters():
            assert p.element_size() == WORD, f"a snapshot holds 4-byte words (fp32 master weights), not {p.dtype}"
            held.append((index, offset, p))
            offset += p.numel()
    return held


def _bytes(t: torch.Tensor, host: bool) -> Bytes:
    """A tensor's bytes in place: a view, never a copy (which a load would fill in vain)."""
    if host:
        return np.frombuffer(t.detach().numpy(), np.uint8)  # refuses a tensor that is not contiguous
    return t.detach().view(-1).view(torch.uint8)


def _fresh_moments(fresh: Fresh, held: Held, host: bool) -> tuple[list[torch.Tensor], Region]:
    """A new moment for each parameter held, and the region they form. On the host they are carved from ``fresh``
    in flat order, and those adjacent both in the vector and in ``fresh`` form one run."""
    tensors = []
    runs: list[list[int]] = []  # [first element, end element, first byte in ``fresh``]
    for _, offset, p in held:
        at = fresh.used
        tensors.append(fresh.like(p))
        last = runs[-1] if runs else None
        if host and last is not None and last[1] == offset and last[2] + (offset - last[0]) * WORD == at:
            last[1] = offset + p.numel()  # next to the run before, in the vector and in memory: the same run
        else:
            runs.append([offset, offset + p.numel(), at])
    memory = ([fresh.bytes[at : at + (end - start) * WORD] for start, end, at in runs] if host
              else [_bytes(t, host) for t in tensors])  # fmt: skip
    return tensors, Region([start for start, _, _ in runs], [end for _, end, _ in runs], memory)


def _buffers(target: Target, index: int, nbytes: int) -> list[np.ndarray]:
    """The buffers that shard ``index``'s ``nbytes`` land in, in order: the layers' memory, and scratch for the rest
    (padding, layers not held; the step's word and the words after it last)."""
    step = target.step_at
    buffers: list[np.ndarray] = []
    at = 0
    for offset, run in target.spans(index):
        if offset > at:
            buffers.append(np.empty(offset - at, np.uint8))
        buffers.append(run)  # type: ignore[arg-type]  # a host target's runs are NumPy views
        at = offset + len(run)
    if step > at:
        buffers.append(np.empty(step - at, np.uint8))
    buffers.append(np.empty(nbytes - step, np.uint8))
    return buffers


def _read_into(target: Target, index: int, local: LocalRecord) -> float:
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
        buffers = _buffers(target, index, nbytes)
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


def _copy_into(target: Target, index: int, data: torch.Tensor) -> float:
    """Copy shard ``index`` from its bytes ``data`` into ``target``; returns its step."""
    if target.host:
        raw = data.cpu().numpy()
        for offset, run in target.spans(index):
            np.copyto(run, raw[offset : offset + len(run)])
    else:
        for offset, run in target.spans(index):
            run.copy_(data[offset : offset + len(run)])  # type: ignore[union-attr]  # a device target: tensors
    step = target.step_at
    return float(data[step : step + WORD].cpu().view(torch.float32))


class Fresh:
    """New tensors for the moments a restore sets, like their parameters. On the host they are carved from one
    mapping backed by huge pages where the kernel has them (``MADV_HUGEPAGE``), starting on one so that every page
    is huge: a process writing fresh memory faults in every page, and with 4 KiB pages that costs several times the
    copy into them. The pages fault in as the bytes land, each zeroed just before its bytes are written, while in
    cache. Each tensor still has a storage of its own, so a checkpoint or a transfer of one layer carries that layer's
    state alone."""

    def __init__(self, likes: list[torch.Tensor]) -> None:
        size = max(sum(_aligned(p.nbytes) for p in likes if p.is_cpu), 1)
        span = -(-size // HUGE_PAGE) * HUGE_PAGE  # its last huge page too, wherever the first starts
        mapping = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
        start = -np.frombuffer(mapping, np.uint8).ctypes.data % HUGE_PAGE  # untouched before it: never backed
        self._memory = memoryview(mapping)[start : start + size]
        self.bytes = np.frombuffer(self._memory, np.uint8)
        """The memory the tensors are carved from, as bytes."""
        self.used = 0
        """Where the next tensor starts in it."""

    def like(self, p: torch.Tensor) -> torch.Tensor:
        if not p.is_cpu:
            return torch.empty_like(p)
        nbytes = p.nbytes
        piece = self._memory[self.used : self.used + nbytes]
        self.used += _aligned(nbytes)
        return torch.frombuffer(piece, dtype=p.dtype).view_as(p)  # its storage keeps the mapping


def _huge_page() -> int:
    """The size of a transparent huge page, or of a page where the kernel has none."""
    try:
        return int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return mmap.PAGESIZE


HUGE_PAGE = _huge_page()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
