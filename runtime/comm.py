"""Abortable communication between the workers of one generation.

Measured with gloo (design notes): when a rank dies only its direct neighbours see an error, everyone else blocks
until the gloo timeout; a short timeout on a recv closes the connection; destroying a group with an operation in
flight blocks for the whole timeout. Hence:

- every generation gets fresh groups on ``PrefixStore(f"gen{g}/...", store)``, built without any global default
  group, so survivors can form the next generation while the old one still has operations stuck in it;
- operations are issued asynchronously and waited for by the generation's waiter thread, while the caller polls
  an abort event (gloo point-to-point work never reports completion before ``wait()``, so every receive needs the
  waiter; one long-lived thread avoids starting a thread per operation, which costs milliseconds on a busy host);
- a generation that was aborted is never destroyed, only dropped into ``_RETIRED`` (its stuck threads time out on
  their own).
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from runtime.plan import Plan

_POLL_S = 0.05
_RETIRED: list[GenerationComm] = []


class _Waiter:
    """A thread that waits on work items in order and signals each completion. One per generation: a wait stuck in
    an aborted generation stays behind with it and never delays the next."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[dist.Work, threading.Event, list[BaseException]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="comm-waiter").start()

    def _run(self) -> None:
        while True:
            work, done, failure = self._jobs.get()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                failure.append(exc)
            done.set()

    def submit(self, work: dist.Work) -> tuple[threading.Event, list[BaseException]]:
        done, failure = threading.Event(), []
        self._jobs.put((work, done, failure))
        return done, failure


class Aborted(Exception):
    """The coordinator aborted the iteration in flight."""


class CommError(RuntimeError):
    """A peer failed in the middle of an operation (connection reset, timeout)."""


@contextmanager
def _peer_errors() -> Iterator[None]:
    """Gloo raises at once, while issuing, when a peer's connection is already closed: that is a CommError too."""
    try:
        yield
    except RuntimeError as exc:
        raise CommError(str(exc)) from exc


def _new_group(store: dist.Store, prefix: str, rank: int, size: int, backend: str, timeout_s: float) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


class GenerationComm:
    """The process groups of one plan generation, as seen by one worker."""

    def __init__(
        self,
        store: dist.Store,
        plan: Plan,
        worker: int,
        abort: threading.Event,
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> None:
        self.plan = plan
        self.worker = worker
        self.abort = abort
        self.device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        workers = plan.workers
        self._rank = {w: r for r, w in enumerate(workers)}
        generation = f"gen{plan.generation}"
        self.world = _new_group(store, f"{generation}/world", self._rank[worker], len(workers), backend, timeout_s)
        # One group per distinct replica set; every member builds the groups in the same order.
        self.reduce_groups: list[tuple[tuple[int, ...], dist.ProcessGroup]] = []
        for holders, layers in plan.reduction_groups():
            if worker in holders:
                key = "-".join(map(str, holders))
                group = _new_group(store, f"{generation}/reduce/{key}", holders.index(worker), len(holders), backend, timeout_s)
                self.reduce_groups.append((layers, group))
        self._pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._waiter = _Waiter()

    # -- waiting -------------------------------------------------------------------------------------------------
    def wait(self, work: dist.Work) -> None:
        """Block until ``work`` completes, raising Aborted as soon as the abort event is set."""
        if work.is_completed():
            self._raise_if_failed(work)
            return
        done, failure = self._waiter.submit(work)
        while not done.wait(_POLL_S):
            if self.abort.is_set():
                raise Aborted()
        if failure:
            raise CommError(str(failure[0])) from failure[0]

    @staticmethod
    def _raise_if_failed(work: dist.Work) -> None:
        with _peer_errors():
            work.wait()

    # -- point to point --------------------------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """Asynchronous: the tensor is kept alive until ``flush_sends``."""
        tensor = tensor.detach().contiguous()
        with _peer_errors():
            work = self.world.send([tensor], self._rank[peer], tag)
        self._pending_sends.append((work, tensor))

    def recv(self, shape: Iterable[int], dtype: torch.dtype, peer: int, tag: int) -> torch.Tensor:
        buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        with _peer_errors():
            work = self.world.recv([buffer], self._rank[peer], tag)
        self.wait(work)
        return buffer

    def send_bytes(self, data: bytes, peer: int, tag: int) -> None:
        """A byte string of any length: its size first, then the payload (tags ``tag`` and ``tag + 1``)."""
        self.send(torch.tensor([len(data)], dtype=torch.int64), peer, tag)
        self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), peer, tag + 1)

    def recv_bytes(self, peer: int, tag: int) -> bytes:
        size = int(self.recv((1,), torch.int64, peer, tag).item())
        return self.recv((size,), torch.uint8, peer, tag + 1).numpy().tobytes()

    def flush_sends(self) -> None:
        for work, _ in self._pending_sends:
            self.wait(work)
        self._pending_sends.clear()

    # -- collectives -----------------------------------------------------------------------------------------------
    def all_reduce_layers(self, grads_of: dict[int, list[torch.Tensor]]) -> None:
        """Sum each layer's gradients over every replica of the layer, in place.

        All groups' all-reduces are issued before any is waited for: gloo runs them on its own threads, so a worker
        that sits in several replica sets never waits on one group while a peer waits on another.
        """
        started = []
        for layers, group in self.reduce_groups:
            tensors = [g for layer in layers for g in grads_of[layer]]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            with _peer_errors():
                started.append((group.allreduce([flat]), flat, tensors))
        for work, flat, tensors in started:
            self.wait(work)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def retire(self) -> None:
        """Keep this generation's groups alive forever: destroying one with work in flight blocks (see above)."""
        _RETIRED.append(self)
