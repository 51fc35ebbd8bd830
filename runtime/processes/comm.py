"""Abortable communication between the workers of one generation.

Measured with gloo (design notes): when a rank dies only its direct neighbours see an error, everyone else blocks
until the gloo timeout; a short timeout on a recv closes the connection; destroying a group with an operation in
flight blocks for the whole timeout. Hence:

- every generation gets fresh groups on ``PrefixStore(f"gen{g}/...", store)``, built without any global default
  group, so survivors can form the next generation while the old one still has operations stuck in it;
- the worker's main thread waits for its operations directly, as DeepSpeed's engine does: a receive completes with
  no thread hand-off between the data arriving and the computation that needs it;
- an abort comes from the worker's abort thread, which calls ``interrupt``: it closes every connection of the
  generation on purpose (a receive with a 1 ms timeout from each peer, whose timeout closes that pair), so any wait
  in the main thread fails at once, on this worker and on the peers waiting for it;
- a generation that was aborted is never destroyed, only dropped into ``_RETIRED``;
- a group is built once every member has arrived at its rendezvous, waited for in short polls that ask whether the
  generation was aborted meanwhile (``_arrive``): a member that died before it arrived would leave the others in the
  store's wait for the whole timeout, where no abort reaches them.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ftlab.runtime.core.plan import Plan

_RETIRED: list[GenerationComm] = []
# The tag of AOR's gradient-chunk exchange inside a reduce group (which carries nothing else point to point).
_AOR_TAG = 7
# No message is ever sent with this tag: a receive on it only exists to time out and close its connection.
_INTERRUPT_TAG = 1 << 30
_INTERRUPT_TIMEOUT = datetime.timedelta(milliseconds=1)
_ARRIVAL_POLL = datetime.timedelta(milliseconds=200)


class Aborted(Exception):
    """The coordinator aborted the iteration in flight."""


class CommError(RuntimeError):
    """A peer failed in the middle of an operation (connection reset, timeout)."""


def _close_connections(group: dist.ProcessGroup, rank: int, size: int) -> None:
    """Close this worker's connection to every peer in ``group``: a gloo receive that times out closes its pair."""
    probes = []
    for peer in range(size):
        if peer != rank:
            with contextlib.suppress(RuntimeError):  # that connection is closed already
                probes.append(group.recv([torch.empty(1)], peer, _INTERRUPT_TAG))
    for probe in probes:
        with contextlib.suppress(RuntimeError):  # the timeout, which is the point
            probe.wait(_INTERRUPT_TIMEOUT)


def _arrive(store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float, aborted: Callable[[], bool]) -> None:
    """Wait until every member of the group ``prefix`` has arrived; Aborted as soon as ``aborted`` says so, CommError
    after ``timeout_s`` (a member that never came)."""
    arrivals = dist.PrefixStore(f"{prefix}/arrived", store)
    arrivals.set(str(rank), b"1")
    deadline = time.monotonic() + timeout_s
    while True:
        if aborted():
            raise Aborted()
        try:
            arrivals.wait([str(r) for r in range(size)], _ARRIVAL_POLL)
            return
        except RuntimeError as exc:  # the poll timed out (DistStoreError), or the store is gone
            if time.monotonic() > deadline:
                raise CommError(f"the members of {prefix} did not all arrive within {timeout_s:g} s: {exc}") from exc


def _new_group(
    store: dist.Store, prefix: str, rank: int, size: int, backend: str, timeout_s: float, host_addr: str | None = None
) -> dist.ProcessGroup:
    """A group of its own on ``store``. With gloo, ``host_addr`` is the address this worker's connections bind to
    and advertise to its peers (through the store), so peers on other hosts connect to it; None: gloo's default
    (the address the host name resolves to, else loopback)."""
    prefixed = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    if host_addr is None:
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host_addr)]
    return dist.ProcessGroupGloo(prefixed, rank, size, options)


@dataclass
class _Sharded:
    chunk: torch.Tensor
    peer_chunk: Callable[[], torch.Tensor] | None


@dataclass
class PostedRecv:
    comm: GenerationComm
    work: dist.Work
    buffer: torch.Tensor

    def result(self) -> torch.Tensor:
        self.comm.wait(self.work)
        return self.buffer


class GenerationComm:
    """The process groups of one plan generation, as seen by one worker."""

    def __init__(
        self,
        store: dist.Store,
        plan: Plan,
        worker: int,
        backend: str = "gloo",
        timeout_s: float = 120.0,
        helpers: Iterable[int] = (),
        host_addr: str | None = None,
        device: torch.device | None = None,
        abort_requested: Callable[[], bool] = lambda: False,
    ) -> None:
        """``helpers``: live workers outside the plan that join the generation's world group (after the plan's
        workers, in order) to send what only their node holds, e.g. snapshot records after a restart.
        ``host_addr``: the address of this worker's node, which its peers connect to (``_new_group``).
        ``device``: where buffers and received tensors are placed (the worker's own GPU with NCCL).
        ``abort_requested``: whether the coordinator aborted this generation, asked while the groups wait for their
        members (raises Aborted; CommError when a member never comes)."""
        self.plan = plan
        self.worker = worker
        self.aborted = threading.Event()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = device
        workers = (*plan.workers, *sorted(helpers))
        self._rank = {w: r for r, w in enumerate(workers)}
        generation = f"gen{plan.generation}"

        def group(prefix: str, rank: int, size: int) -> dist.ProcessGroup:
            _arrive(store, prefix, rank, size, timeout_s, abort_requested)
            try:
                return _new_group(store, prefix, rank, size, backend, timeout_s, host_addr)
            except RuntimeError as exc:  # a member died between its arrival and its connections
                raise CommError(f"{prefix}: {exc}") from exc

        self.world = group(f"{generation}/world", self._rank[worker], len(workers))
        # (group, this worker's rank in it, its size) for every group, which ``interrupt`` closes.
        self._groups = [(self.world, self._rank[worker], len(workers))]
        # One group per distinct replica set; every member builds the groups in the same order.
        self.reduce_groups: list[tuple[tuple[int, ...], dist.ProcessGroup]] = []
        self._member: dict[tuple[int, ...], tuple[int, int]] = {}
        """This worker's (rank, size) in the reduce group of each set of layers."""
        for holders, layers in plan.reduction_groups():
            if worker in holders:
                key = "-".join(map(str, holders))
                reduce = group(f"{generation}/reduce/{key}", holders.index(worker), len(holders))
                self.reduce_groups.append((layers, reduce))
                self._groups.append((reduce, holders.index(worker), len(holders)))
                self._member[layers] = holders.index(worker), len(holders)
        self._pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._buckets: dict[tuple[int, ...], tuple[torch.Tensor, dist.ProcessGroup]] = {}
        self._sharded: dict[tuple[int, ...], _Sharded] = {}

    # -- waiting and aborting ------------------------------------------------------------------------------------
    def wait(self, work: dist.Work) -> None:
        """Block until ``work`` completes; Aborted if ``interrupt`` ended it, CommError if a peer failed."""
        with self._failures():
            work.wait()

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        """Issuing or waiting: Aborted once ``interrupt`` was called, else a gloo error is a peer's failure."""
        if self.aborted.is_set():
            raise Aborted()
        try:
            yield
        except RuntimeError as exc:
            if self.aborted.is_set():
                raise Aborted() from exc
            raise CommError(str(exc)) from exc

    def interrupt(self) -> None:
        """Abort this generation: every operation in flight or issued later fails at once. Called from another thread
        than the one waiting (one at a time: the worker's lock orders it with a generation change), maybe twice."""
        self.aborted.set()
        for group, rank, size in self._groups:
            if self.device.type == "cuda":
                # NCCL aborts its communicators itself (ncclCommAbort: every wait on them fails); gloo's abort()
                # leaves waits blocked, hence the closed connections below.
                abort = getattr(group, "abort", None) or group._get_backend(self.device).abort
                with contextlib.suppress(RuntimeError):  # aborted already
                    abort()
            else:
                _close_connections(group, rank, size)

    # -- point to point --------------------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """Asynchronous: the tensor is kept alive until ``flush_sends``."""
        tensor = tensor.detach().to(self.device).contiguous()
        with self._failures():
            work = self.world.send([tensor], self._rank[peer], tag)
        self._pending_sends.append((work, tensor))

    def post_recv(self, shape: Iterable[int], dtype: torch.dtype, peer: int, tag: int) -> PostedRecv:
        """Post a receive now, to be waited for later (``PostedRecv.result``)."""
        buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        with self._failures():
            work = self.world.recv([buffer], self._rank[peer], tag)
        return PostedRecv(self, work, buffer)

    def recv(self, shape: Iterable[int], dtype: torch.dtype, peer: int, tag: int) -> torch.Tensor:
        return self.post_recv(shape, dtype, peer, tag).result()

    def send_bytes(self, data: bytes, peer: int, tag: int) -> None:
        """A byte string of any length: its size first, then the payload (tags ``tag`` and ``tag + 1``)."""
        self.send(torch.tensor([len(data)], dtype=torch.int64), peer, tag)
        self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer, tag + 1)

    def recv_bytes(self, peer: int, tag: int) -> bytes:
        size = int(self.recv((1,), torch.int64, peer, tag).item())
        return self.recv((size,), torch.uint8, peer, tag + 1).cpu().numpy().tobytes()

    def flush_sends(self) -> None:
        for work, _ in self._pending_sends:
            self.wait(work)
        self._pending_sends.clear()

    # -- collectives -----------------------------------------------------------------------------------------------
    def bucket_gradients(self, layers: dict[int, torch.nn.Module], padded: dict[tuple[int, ...], int] | None = None) -> None:
        """Make the gradients of each replica set's layers views into one flat buffer, which ``all_reduce_gradients``
        reduces in place: no copy in or out (DDP's ``gradient_as_bucket_view``). Autograd accumulates into the views
        and the optimizers zero them in place, so they stay views for the whole generation. ``padded``: groups whose
        buffer is longer (ZeRO-1 cuts it into equal chunks; the padding stays zero)."""
        self._buckets = {}
        self._sharded = {}
        for group_layers, group in self.reduce_groups:
            params = [p for index in group_layers for p in layers[index].parameters()]
            (dtype,) = {p.dtype for p in params}
            size = (padded or {}).get(group_layers, sum(p.numel() for p in params))
            flat = torch.zeros(size, dtype=dtype, device=self.device)
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self._buckets[group_layers] = (flat, group)

    def gradient_bucket(self, group_layers: tuple[int, ...]) -> torch.Tensor:
        return self._buckets[group_layers][0]

    def member(self, group_layers: tuple[int, ...]) -> tuple[int, int]:
        """This worker's (rank, size) among the holders of ``group_layers``."""
        return self._member[group_layers]

    def shard_gradients(
        self, group_layers: tuple[int, ...], chunk: torch.Tensor, peer_chunk: Callable[[], torch.Tensor] | None = None
    ) -> None:
        """ZeRO-1 for this group: ``all_reduce_gradients`` reduce-scatters its bucket, leaving this member's chunk of
        the sum in ``chunk``. With ``peer_chunk`` (AOR) the member then sends its chunk to the member before it and
        receives the next member's chunk into the tensor ``peer_chunk()`` gives."""
        self._sharded[group_layers] = _Sharded(chunk, peer_chunk)

    def all_reduce_gradients(self) -> None:
        """Sum each layer's gradients over every replica of the layer, in place.

        All groups' all-reduces are issued before any is waited for: gloo runs them on its own threads, so a worker
        that sits in several replica sets never waits on one group while a peer waits on another.
        """
        started = []
        for group_layers, (flat, group) in self._buckets.items():
            sharded = self._sharded.get(group_layers)
            with self._failures():
                if sharded is None:
                    started.append(group.allreduce([flat]))
                else:
                    started.append(group._reduce_scatter_base(sharded.chunk, flat))
        for work in started:
            self.wait(work)
        exchanged = []
        for group_layers, sharded in self._sharded.items():
            if sharded.peer_chunk is None:
                continue
            group = self._buckets[group_layers][1]
            rank, size = self._member[group_layers]
            with self._failures():
                exchanged.append(group.send([sharded.chunk], (rank - 1) % size, _AOR_TAG))
                exchanged.append(group.recv([sharded.peer_chunk()], (rank + 1) % size, _AOR_TAG))
        for work in exchanged:
            self.wait(work)

    def all_gather(self, group_layers: tuple[int, ...], out: torch.Tensor, chunk: torch.Tensor) -> None:
        """``out`` (every member's chunk, in member order) from each member's ``chunk``, over the group's holders."""
        group = self._buckets[group_layers][1]
        with self._failures():
            work = group._allgather_base(out, chunk)
        self.wait(work)

    def gather_rows(self, row: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every world member's ``row`` (each the same shape and dtype), by worker."""
        flat = row.flatten()
        rows = torch.empty(len(self._rank) * flat.numel(), dtype=row.dtype, device=self.device)  # gloo wants it flat
        with self._failures():
            work = self.world._allgather_base(rows, flat.to(self.device).contiguous())
        self.wait(work)
        rows = rows.view(len(self._rank), *row.shape).cpu()
        return {worker: rows[rank] for worker, rank in self._rank.items()}

    def retire(self) -> None:
        """Keep this generation's groups alive forever: destroying one with work in flight blocks (see above)."""
        _RETIRED.append(self)
