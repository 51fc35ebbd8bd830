"""REFT's snapshots on the worker: copying its shards into its node's memory off the critical path (loading a
snapshot back, REFT-load, is ``runtime.state.snapshot_load``). ``runtime.core.snapshot_layout`` says what each record
holds; ``runtime.state.shm`` how it sits in a file.

**HAS, the choice.** The copy runs on a thread of the worker (its host thread), started as soon as the committed step's state is
final (right after the optimizer step) and overlapping the whole next iteration: the forward and backward passes
and the gradient all-reduce only read the parameters and optimizer state, so the copy sees step s untouched. The
worker waits for it, if it is still running, before it reports the next iteration Ready, i.e. before the
coordinator can commit step s + 1 and let any optimizer write the state (and so that the coordinator knows the
snapshot complete when it commits, and the next snapshot never overwrites it). Double buffering would cost a second
copy of the state on the device and a copy on the critical path to fill it; copying at commit would put the whole
copy there. The GIL is no obstacle: torch's copies and XORs and the checksum release it. On this CPU runtime there is
no separate copy engine, so "bubbles first" is the operating system's: the copy thread runs whenever the training
thread blocks on communication (the pipeline's bubbles) and otherwise beside it; ``ft/snapshot_s`` measures what is
left on the critical path (starting the copy and waiting for it before Ready).

**The state as flat vectors.** A group's parameters are laid end to end in layer order and module order; Adam's
two moments follow the same layout; the optimizer's step count is one number (every parameter of a group has taken
the same number of steps). Shard i is chunk i of each of the three with the step after them (``snapshot_layout``).

**At memory speed.** A worker's own records are memory copies only: a tensor's bytes copied into the record's
pre-touched file, checksummed block by block while in cache (``fill_record``), and read back by the kernel straight
into the parameters and moments (``snapshot_load``): no serialisation, no intermediate buffer, no communication.
Only a record on another node crosses the comm backend, as over a network.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ftlab.runtime.state import shm
from ftlab.runtime.core.contract import MemoryRecord
from ftlab.runtime.training.model import layer_numels
from ftlab.runtime.core.model_spec import ModelConfig
from ftlab.runtime.core.snapshot_layout import Geometry, Group, parity_sources

MOMENTS = ("exp_avg", "exp_avg_sq")
WORD = 4
"""The layout's element (``snapshot_layout``): the state is fp32 master weights and fp32 moments, whatever precision
training computes in. Records are copied as bytes, never converted."""


# -- the flat layout of a group's state ----------------------------------------------------------------------------
def group_numels(model: ModelConfig, layers: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for index in layers for n in layer_numels(model, index))


def geometry(model: ModelConfig, group: Group) -> Geometry:
    return Geometry(sum(group_numels(model, group.layers)), group.members, group.q)


class Flat:
    """Some tensors laid end to end in one flat index space (gaps read as zeros)."""

    def __init__(self, segments: Sequence[tuple[int, torch.Tensor]]) -> None:
        self.starts = [start for start, _ in segments]
        self.tensors = [t.detach().reshape(-1) for _, t in segments]
        wrong = {t.dtype for t in self.tensors if t.element_size() != WORD}
        assert not wrong, f"a snapshot holds 4-byte words (fp32 master weights and moments), not {wrong}"

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset from ``lo``, 1-D view) of the parts of [lo, hi) the tensors cover."""
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while i < len(self.tensors) and self.starts[i] < hi:
            start, t = self.starts[i], self.tensors[i]
            a, b = max(lo, start), min(hi, start + t.numel())
            if a < b:
                yield a - lo, t[a - start : b - start]
            i += 1


@dataclass
class GroupState:
    """What a member holds of its group's state: the parameters, the moments of the chunks it has, the step."""

    geometry: Geometry
    params: Flat
    moments: dict[str, Flat]
    step: float

    def shard_pieces(self, index: int, lo: int, hi: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(offset from ``lo``, values) covering elements [lo, hi) of shard ``index`` (padding is left out)."""
        c = self.geometry.chunk
        sources = [self.params, self.moments[MOMENTS[0]], self.moments[MOMENTS[1]]]
        for region, flat in enumerate(sources):
            a, b = max(lo, region * c), min(hi, (region + 1) * c)
            if a < b:
                base = index * c - region * c
                for offset, values in flat.pieces(a + base, b + base):
                    yield offset + a - lo, values
        if lo <= 3 * c < hi:
            yield 3 * c - lo, torch.tensor([self.step], dtype=torch.float32)

    def tensors(self) -> tuple[tuple[int, int], ...]:
        """Where the state's tensors are (address, elements): equal while it is the same tensors, updated in place."""
        flats = [self.params, *self.moments.values()]
        return tuple((t.data_ptr(), t.numel()) for flat in flats for t in flat.tensors)


def member_state(
    model: ModelConfig, group: Group, layers: dict[int, torch.nn.Module], optimizers: dict[int, torch.optim.Optimizer]
) -> GroupState:
    """The state of ``group`` as a member holding all its layers with their optimizers sees it."""
    params, moments = [], {name: [] for name in MOMENTS}
    steps = set()
    offset = 0
    for index in group.layers:
        optimizer = optimizers[index]
        for p in layers[index].parameters():
            state = optimizer.state[p]
            params.append((offset, p))
            for name in MOMENTS:
                moments[name].append((offset, state[name]))
            steps.add(float(state["step"]))
            offset += p.numel()
    assert len(steps) == 1, f"the parameters of {group.describe()} are at different optimizer steps {steps}"
    return GroupState(geometry(model, group), Flat(params), {k: Flat(v) for k, v in moments.items()}, steps.pop())


# -- writing records -----------------------------------------------------------------------------------------------
BLOCK = 1 << 20
"""Bytes copied, then checksummed, at a time: small enough that the checksum reads them from cache, large enough that
Python's cost per block is small beside the copy."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor's bytes, whatever its dtype: a record holds bit patterns, never converted values."""
    return t.view(torch.uint8)


Source = np.ndarray | torch.Tensor
"""A piece of the state as bytes: a NumPy view of host memory (copied by ``memcpy`` with no dispatch cost), or a
device tensor's (copied by torch)."""
Run = tuple[int, int, list[Source]]
"""(start, end, sources): bytes [start, end) of a record, copied from the sources laid end to end."""


def copy_runs(state: GroupState, index: int) -> list[Run]:
    """How shard ``index``'s parameters and moments are copied: runs of adjacent sources of about ``BLOCK`` bytes
    at most, in order (the bytes between runs are padding; the step's word follows, ``fill_record``)."""
    runs: list[Run] = []
    for offset, values in state.shard_pieces(index, 0, 3 * state.geometry.chunk):
        data = _bytes(values)
        for a in range(0, data.numel(), BLOCK):
            block, at = data[a : a + BLOCK], offset * WORD + a
            source: Source = block.numpy() if block.device.type == "cpu" else block
            last = runs[-1] if runs else None
            if last is not None and last[1] == at and last[1] - last[0] + block.numel() <= BLOCK:
                runs[-1] = (last[0], at + block.numel(), [*last[2], source])
            else:
                runs.append((at, at + block.numel(), [source]))
    return runs


def fill_record(state: GroupState, record: MemoryRecord, out: torch.Tensor, runs: list[Run] | None = None) -> int:
    """Write ``record``'s bytes into ``out`` (uint8, its length) and return their checksum: a shard or copy as it
    is, copied run by run (``runs``: ``copy_runs`` of its shard, kept by the caller while the state's tensors stay),
    each run checksummed right after its copy, from cache; or a parity as the XOR of its sources' sub-chunks."""
    g = state.geometry
    raw = out.numpy()
    if record.kind not in ("shard", "copy"):
        bits = out.view(torch.int32)
        bits.zero_()
        length = g.sub_chunk
        for shard, sub in parity_sources(g.members, record.index):
            for offset, values in state.shard_pieces(shard, sub * length, (sub + 1) * length):
                bits[offset : offset + values.numel()].bitwise_xor_(values.view(torch.int32))
        return shm.checksum(raw)
    digest = shm.Checksum()
    end = 0  # bytes of ``out`` written and checksummed
    for start, stop, sources in copy_runs(state, record.index) if runs is None else runs:
        if start > end:  # padding, and whatever a previous snapshot left there
            raw[end:start] = 0
            digest.update(raw[end:start])
        at = start
        for source in sources:
            at += _put(source, out, raw, at)
        digest.update(raw[start:stop])
        end = stop
    step = 3 * g.chunk * WORD
    raw[end:] = 0
    raw[step : step + WORD] = np.array([state.step], np.float32).view(np.uint8)
    digest.update(raw[end:])
    return digest.intdigest()


def _put(source: Source, out: torch.Tensor, raw: np.ndarray, at: int) -> int:
    """Copy ``source`` into ``out`` (``raw``: its bytes) from byte ``at``; returns its length."""
    if isinstance(source, np.ndarray):
        np.copyto(raw[at : at + source.size], source)
        return source.size
    out[at : at + source.numel()].copy_(source)
    return source.numel()


class ShardFiles:
    """The records this worker writes, each a file in its node's memory, mapped once and kept, with how each is
    copied (``copy_runs``) while the state's tensors stay the same."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._maps: dict[str, tuple[torch.Tensor, int]] = {}
        self._runs: dict[str, tuple[tuple[tuple[int, int], ...], list[Run]]] = {}

    def runs(self, state: GroupState, record: MemoryRecord) -> list[Run]:
        tensors = state.tensors()
        found = self._runs.get(record.name)
        if found is None or found[0] != tensors:  # new layers or optimizer state: the old runs copy stale tensors
            found = self._runs[record.name] = (tensors, copy_runs(state, record.index))
        return found[1]

    def mapping(self, name: str, capacity: int) -> torch.Tensor:
        found = self._maps.get(name)
        if found is None or found[1] != capacity:
            path = self.directory / name
            os.close(shm.open_file(path, capacity))
            tensor = torch.from_file(str(path), shared=True, size=shm.file_bytes(capacity), dtype=torch.uint8)
            found = self._maps[name] = (tensor, capacity)
        return found[0]


@dataclass(frozen=True)
class SnapshotReport:
    step: int
    records: tuple[MemoryRecord, ...]
    """With their checksums and sizes."""
    copy_s: float
    cpu_s: float
    """The CPU time of the copy's thread: what the copy cost the cores beside training, whatever it waited for.
    (A worker of several threads, ``cluster.threads_per_worker``, may share a large tensor's copy among them: their
    part is not counted.)"""


def write_records(
    files: ShardFiles, states: dict[tuple[int, ...], GroupState], records: Sequence[MemoryRecord], step: int,
    keep: int, on_record: Callable[[], None] = lambda: None,
) -> list[MemoryRecord]:  # fmt: skip
    """Write each record of ``step`` into the slot of its file that does not hold ``keep``; returns them with their
    checksums (``MemoryRecord.crc``). ``on_record`` runs after each record's bytes and before its commit (a test hook: a kill there tears
    the slot)."""
    written = []
    for record in records:
        state = states[record.layers]
        nbytes = state.geometry.record(record.kind) * WORD
        mapping = files.mapping(record.name, nbytes)
        raw = mapping.numpy()
        slot = shm.choose_slot(shm.headers(memoryview(raw)), keep)
        raw[slot * shm.HEADER_BYTES : (slot + 1) * shm.HEADER_BYTES] = 0  # the slot is no longer committed
        offset = shm.slot_offset(slot, nbytes)
        runs = files.runs(state, record) if record.kind in ("shard", "copy") else None
        digest = fill_record(state, record, mapping[offset : offset + nbytes], runs)
        on_record()
        header = np.frombuffer(shm.encode_header(step, nbytes, digest), dtype=np.uint8)
        raw[slot * shm.HEADER_BYTES : slot * shm.HEADER_BYTES + header.size] = header
        written.append(replace(record, crc=digest, nbytes=nbytes))
    return written


class Snapshotter:
    """One snapshot at a time, copied on the worker's host thread; ``finish`` waits for it (the only point on the
    critical path). The host thread runs one job at a time, in order: AOR's recomputation of a step (``runtime.processes.zero``)
    before the snapshot of that step."""

    def __init__(self, directory: Path, on_phase: Callable[[int, str], None], host: ThreadPoolExecutor) -> None:
        self.files = ShardFiles(directory)
        self.on_phase = on_phase
        self.host = host
        self._copy: Future[SnapshotReport] | None = None

    def start(self, states: dict[tuple[int, ...], GroupState], records: Sequence[MemoryRecord], step: int, keep: int) -> None:
        assert self._copy is None, "a snapshot is already being copied"

        def copy() -> SnapshotReport:
            started, cpu = time.perf_counter(), time.thread_time()
            written = write_records(self.files, states, records, step, keep, lambda: self.on_phase(step, "snapshot"))
            return SnapshotReport(step, tuple(written), time.perf_counter() - started, time.thread_time() - cpu)

        self._copy = self.host.submit(copy)

    @property
    def running(self) -> bool:
        return self._copy is not None

    def finish(self) -> SnapshotReport | None:
        """Wait for the snapshot in flight, if any; its report (an error in the copy is raised here)."""
        if self._copy is None:
            return None
        copy, self._copy = self._copy, None
        return copy.result()
