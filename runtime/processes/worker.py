"""The worker process: holds some layers with their optimizer state and runs the programs it is given.

Every decision is the coordinator's. The worker reports an iteration Ready once its gradients are reduced and steps
its optimizers only on the coordinator's Commit, so an iteration commits on every worker or on none.

The staggered optimizer (``OptimizerStep(early=True)``) keeps that rule while taking the step off the path from
the commit to the next iteration: the worker steps right after reporting Ready, while the coordinator still waits
for the other stages and sends the commit, with the state from before the step copied aside (``optim.StepUndo``);
a Commit keeps the step, an Abort puts the copy back, so every survivor reports the committed step after an abort.
Why undo rather than computing the update into a buffer applied on Commit: the fused AdamW kernel updates in place,
so a buffer costs the same copy plus a second pass on Commit, on the path this is meant to shorten; aborts are rare.

Global clipping and fp16 (``runtime.core.precision``): the Ready carries the squared norms of the worker's reduced
gradients, and the Commit says what to do with them (``runtime.control.update.Update``): multiply them by a factor
before stepping, or skip the step. The staggered optimizer steps before that answer, so it is refused with either.
"""

from __future__ import annotations

import argparse
import datetime
import os
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from ftlab.runtime.state import checkpoint, shm
from ftlab.runtime.core import instructions as ins
from ftlab.runtime.processes import messages as msg
from ftlab.runtime.processes.comm import Aborted, CommError, GenerationComm
from ftlab.runtime.core.contract import MemoryRecord, MemorySource, Source, StorageSource
from ftlab.runtime.training.data import Batches
from ftlab.runtime.processes.executor import Executor
from ftlab.runtime.processes.hold import hold, worker_point
from ftlab.runtime.training.host_allocator import steady_allocations
from ftlab.runtime.core.instructions import Instruction
from ftlab.runtime.training.layer_state import decode, encode, layer_state
from ftlab.runtime.training.model import StageModule, build_layer
from ftlab.runtime.core.model_spec import ModelConfig, num_layers
from ftlab.runtime.training.mixed import grad_sq, scale_gradients
from ftlab.runtime.control.update import Update
from ftlab.runtime.training.optim import StepUndo, layer_optimizer, lr_at, step_all
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.core.scheduler import storage_read_chains
from ftlab.runtime.state.snapshot import Snapshotter, geometry, member_state
from ftlab.runtime.state.snapshot_load import LocalRecord, Shard, decode_shard, load_into, read_record
from ftlab.runtime.core.snapshot_layout import Fetch, groups_of, load_plan
from ftlab.runtime.processes.zero import ZeroGroup

# Transfer tags sit far above the activation and gradient tags (2 per micro-batch); snapshot loads, then storage reads
# passed on (2 per layer), above those.
_TRANSFER_TAG = 1 << 24
_LOAD_TAG = 1 << 25
_RESTORE_TAG = 1 << 27


class Channel:
    """A control connection that several threads may send on."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: object) -> None:
        with self._lock:
            self.conn.send(message)


class Worker:
    def __init__(
        self, channel: Channel, aborts: Connection, node: int, worker: int, heartbeat_s: float,
        coordinator_addr: str = "127.0.0.1", host_addr: str = "127.0.0.1", device_index: int = 0,
    ) -> None:  # fmt: skip
        self.channel = channel
        self.device_index = device_index
        self.device = torch.device("cpu")
        """Where this worker's layers, optimizer state, buffers and received tensors live: ``cuda:<device_index>``
        with NCCL (chosen at the first Configure, which says the backend), the CPU with gloo."""
        self.coordinator_addr = coordinator_addr
        """Where the coordinator's rendezvous store listens."""
        self.host_addr = host_addr
        """This node's address: the worker's connections to its peers bind to it, and peers connect to it."""
        self.aborts = aborts
        self.node = node
        self.worker = worker
        self.heartbeat_s = heartbeat_s
        # The abort thread fails the main thread's communication; this lock orders it with a generation change.
        self._comm_lock = threading.Lock()
        self._aborted_generation = -1
        self.layers: dict[int, torch.nn.Module] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.step = 0  # optimizer steps committed
        self.setup: dict[str, Any] = {}
        self.store: dist.TCPStore | None = None
        self.comm: GenerationComm | None = None
        self.executor: Executor | None = None
        self.program: list[Any] = []
        self.armed: set[tuple[int, str]] = set()
        self.undo = StepUndo()
        """An optimizer step taken before its commit (``OptimizerStep(early=True)``), until Commit or Abort."""
        self.host = ThreadPoolExecutor(1, thread_name_prefix="host")
        """The host thread: snapshot copies and AOR's recomputation, off the critical path, one at a time in order."""
        self.snapshotter: Snapshotter | None = None
        self._snapshot_step = -1
        """The step of the snapshot copied last (a failed copy is reported under it)."""
        self._snapshot_s: float | None = None
        """Time the main thread spent on snapshots since the last Ready (None: none was taken)."""
        self.zero: dict[tuple[int, ...], ZeroGroup] = {}
        """ZeRO-1 (train.zero=1): this worker's part of each group of replicas it belongs to."""
        self.torn: int | None = None
        """ZeRO-1: the step whose commit failed here and left this worker no state (``_forget_state``), until it
        is configured again."""
        self._recomputing: list[Future[None]] = []

    # -- threads -----------------------------------------------------------------------------------------------
    def _receive(self) -> Any:
        """The next control message. The main thread reads them itself: a message wakes it with no hand-off. A
        ``Shutdown`` ends the process wherever it comes: between steps when the job is done, or in the middle of one
        when the coordinator was stopped (a signal), which shuts the job down without ending the step."""
        try:
            message = self.channel.conn.recv()
        except (EOFError, OSError):
            os._exit(3)  # the coordinator is gone: nothing this worker holds is of use any more
        if isinstance(message, msg.Shutdown):
            _exit_cleanly()
        return message

    def _watch_aborts(self) -> None:
        """The coordinator repeats every Abort on a second connection, read here, because the main thread may be
        blocked in a wait that only ``interrupt`` ends. The main thread acknowledges the control channel's copy."""
        while True:
            try:
                message = self.aborts.recv()
            except (EOFError, OSError):
                os._exit(3)
            self._interrupt(message.generation)

    def _interrupt(self, generation: int) -> None:
        """Make every wait of ``generation`` fail now, even one that was not yet issued."""
        with self._comm_lock:
            self._aborted_generation = max(self._aborted_generation, generation)
            if self.comm is not None and self.comm.plan.generation == generation:
                self.comm.interrupt()

    def _heartbeat(self) -> None:
        # A SIGSTOPped worker stops this thread too, which is how a hang is detected.
        while True:
            self.channel.send(msg.Heartbeat())
            time.sleep(self.heartbeat_s)

    # -- main loop ---------------------------------------------------------------------------------------------
    def serve(self) -> NoReturn:
        """Carry out the coordinator's messages until its ``Shutdown`` (``_receive``) or its loss ends the process."""
        threading.Thread(target=self._watch_aborts, daemon=True, name="aborts").start()
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        while True:
            message = self._receive()
            if isinstance(message, msg.Configure):
                self._configure(message)
            elif isinstance(message, msg.RunStep):
                self._run_step(message.step, message.loss_scale)
            elif isinstance(message, msg.Abort):
                self._abort(message.generation)
            elif isinstance(message, msg.ArmFault):
                self.armed.add((message.step, message.phase))
            elif isinstance(message, msg.SaveCheckpoint):
                self._save(message)
            elif isinstance(message, msg.TakeSnapshot):
                self._snapshot(message)
            elif isinstance(message, msg.Commit):
                pass  # a commit for an iteration this worker already abandoned: ignore
            else:
                raise TypeError(f"unexpected control message {message!r}")

    def _configure(self, message: msg.Configure) -> None:
        self._finish_snapshot()  # its layers may be dropped or replaced below
        if message.setup:
            self.setup = message.setup
        plan = Plan.from_dict(message.plan)
        model: ModelConfig = self.setup["model"]
        if self.store is None:
            self._place(self.setup["backend"])
            self.store = dist.TCPStore(
                self.coordinator_addr,
                message.store_port,
                is_master=False,
                timeout=datetime.timedelta(seconds=self.setup["comm_timeout_s"]),
            )
        if self.comm is not None:
            self.comm.retire()
            with self._comm_lock:
                self.comm = None
        try:
            comm = GenerationComm(
                self.store, plan, self.worker, self.setup["backend"], self.setup["comm_timeout_s"], message.helpers,
                self.host_addr, self.device, abort_requested=lambda: self._aborted_generation >= plan.generation,
            )
        except Aborted:
            return  # the main loop acknowledges the Abort that follows
        except CommError as exc:  # a member never came: its death is the coordinator's to notice
            self.channel.send(msg.Failed(plan.step, str(exc)))
            return
        with self._comm_lock:
            self.comm = comm
            if self._aborted_generation >= plan.generation:  # the Abort overtook this Configure
                comm.interrupt()
        if self.worker not in plan.workers:  # a helper: it only sends its node's snapshot records
            self.executor = None
            self._configure_helper(plan, message)
            return
        _, _, stage = plan.stage_of(self.worker)
        missing: list[int] = []
        try:
            received = self._transfer(message.transfers)
            missing = [index for index in stage.layers if index not in self.layers]
            if missing and plan.step != 0 and message.restore is None:
                raise RuntimeError(f"layers {missing} are missing at step {plan.step} and nothing provides them")
            for index in missing:
                self._add_layer(index)
            started = time.perf_counter()
            restored, source = self._restore(missing, message.restore, plan, message.helpers)
        except (Aborted, CommError) as exc:
            for index in missing:  # loaded in part, or not at all: this worker does not hold them
                del self.layers[index], self.optimizers[index]
            if isinstance(exc, CommError):
                self.channel.send(msg.Failed(plan.step, str(exc)))
            return  # the main loop acknowledges the Abort that follows
        restore_s = time.perf_counter() - started
        # Layers this stage no longer runs are kept until the plan's first step: should the reconfiguration fail,
        # they are still where the last confirmed plan put them.
        self.step = plan.step
        tokens = np.load(self.setup["tokens_path"], mmap_mode="r")
        batches = Batches(tokens, model.seq_len, plan.global_batch, plan.micro_batch, self.setup["seed"])
        stage_module = StageModule(model, {i: self.layers[i] for i in stage.layers})
        self._shard_optimizers(plan, comm)
        self.executor = Executor(
            stage_module, num_layers(model), model.hidden, comm, batches, self._phase,
            checkpointing=self.setup["activation_checkpointing"], precision=self.setup["precision"],
            redundant=self._kept_copy(message.program),
        )  # fmt: skip
        self.torn = None
        self.program = message.program
        self.channel.send(msg.Configured(plan.generation, self.step, received, restored, restore_s, source))

    def _kept_copy(self, program: list[Instruction]) -> StageModule | None:
        """Bamboo: the copy of the next stage's layers this worker keeps current (its program receives their reduced
        gradients), copied to it in place before; None for a worker that keeps none."""
        layers = ins.kept_copy(program)
        if layers is None:
            return None
        missing = [index for index in layers if index not in self.layers]
        if missing:
            raise RuntimeError(f"worker {self.worker} should keep a copy of layers {missing}, which it does not hold")
        return StageModule(self.setup["model"], {i: self.layers[i] for i in layers})

    def _place(self, backend: str) -> None:
        """NCCL: compute on this worker's own GPU, made the current device so that NCCL's communicators and every
        implicit CUDA allocation use it too."""
        if backend != "nccl":
            return
        count = torch.cuda.device_count()
        if self.device_index >= count:
            raise RuntimeError(
                f"worker {self.worker} should run on cuda:{self.device_index}, but its host has {count} GPU(s): a node "
                f"that joined beyond the GPUs counted at the start has none of its own; use cluster.backend=gloo"
            )
        torch.cuda.set_device(self.device_index)
        self.device = torch.device("cuda", self.device_index)

    def _shard_optimizers(self, plan: Plan, comm: GenerationComm) -> None:
        """Gradient buckets for the plan, and with train.zero=1 the ZeRO-1 groups, which take over the layers'
        optimizer state (loaded whole, from scratch, storage or memory)."""
        if not self.setup["zero"]:
            comm.bucket_gradients(self.layers)
            return
        if self.zero:
            raise RuntimeError("train.zero=1: a worker was reconfigured without a restart, which ZeRO-1 does not support")
        model = self.setup["model"]
        groups = [g for g in groups_of(plan) if g.members > 1 and self.worker in g.holders]
        comm.bucket_gradients(self.layers, {g.layers: geometry(model, g).members * geometry(model, g).chunk for g in groups})
        for g in groups:
            self.zero[g.layers] = ZeroGroup(model, g, g.holders.index(self.worker), self.layers, self.optimizers,
                                            self.setup["optim"], comm, self.setup["aor"])  # fmt: skip
            for index in g.layers:
                self.optimizers[index].state.clear()  # the group's chunks hold it now

    def _configure_helper(self, plan: Plan, message: msg.Configure) -> None:
        try:
            if isinstance(message.restore, MemorySource):
                self._load_from_memory(message.restore, plan, message.helpers, [])
        except Aborted:
            return
        except CommError as exc:
            self.channel.send(msg.Failed(plan.step, str(exc)))
            return
        self.channel.send(msg.Configured(plan.generation, self.step))

    def _add_layer(self, index: int) -> None:
        self.layers[index] = build_layer(self.setup["model"], index, self.setup["seed"], self.device)
        self.optimizers[index] = layer_optimizer(self.layers[index], self.setup["optim"])

    def _transfer(self, program: tuple[Instruction, ...]) -> int:
        """Run this worker's part of the layer transfers (``runtime.core.scheduler.transfer_programs``: its sends, then
        its receives); returns the bytes received. Each layer has its own tag, the same at both ends."""
        assert self.comm is not None
        received = 0
        if program and self.setup["zero"]:
            raise RuntimeError("train.zero=1 splits each layer's optimizer state: layers cannot be copied in place")
        for instruction in program:
            tag = _TRANSFER_TAG + 2 * instruction.layer
            if isinstance(instruction, ins.SendLayer):
                state = layer_state(self.layers[instruction.layer], self.optimizers[instruction.layer])
                self.comm.send_bytes(encode(state), instruction.peer, tag)
            elif isinstance(instruction, ins.RecvLayer):
                self._phase(self.step, "transfer")
                data = self.comm.recv_bytes(instruction.peer, tag)
                state = decode(data)
                self._add_layer(instruction.layer)
                self.layers[instruction.layer].load_state_dict(state["module"])
                self.optimizers[instruction.layer].load_state_dict(state["optimizer"])
                received += len(data)
            else:
                raise TypeError(f"not a layer transfer: {instruction}")
        self.comm.flush_sends()
        return received

    def _drop_stale_layers(self) -> None:
        assert self.executor is not None
        kept = [self.executor.stage, *([self.executor.redundant] if self.executor.redundant else [])]
        for index in [i for i in self.layers if not any(m.start <= i < m.stop for m in kept)]:
            del self.layers[index], self.optimizers[index]

    def _run_step(self, step: int, loss_scale: float) -> None:
        if self._said_torn(step):
            return
        assert self.executor is not None, "RunStep before Configure"
        self._drop_stale_layers()
        try:
            result = self.executor.run(self.program, step, loss_scale)
        except Aborted:
            return  # the main loop acknowledges the Abort that follows on the control channel
        except CommError as exc:
            self.channel.send(msg.Failed(step, str(exc)))
            return
        self._finish_snapshot()
        snapshot_s, self._snapshot_s = self._snapshot_s, None
        self.channel.send(msg.Ready(step, result.loss, result.compute_s, snapshot_s, self._grad_sq()))
        early = isinstance(self.program[-1], ins.OptimizerStep) and self.program[-1].early
        if early:  # the staggered optimizer: step while the coordinator collects the iteration; undo on Abort
            self._phase(step, "optimizer")
            self.undo.save(self.optimizers)
            step_all(self.optimizers, step, self.setup["optim"])  # never with ZeRO-1 (refused at composition)
        decision = self._receive()
        if isinstance(decision, msg.Commit) and decision.step == step:
            if early:
                self.undo.discard()
            else:
                self._phase(step, "optimizer")
                try:
                    self._step_optimizers(step, decision.update)
                except (Aborted, CommError) as exc:
                    # ZeRO-1's all-gather failed: this member's chunk stepped, others' never arrived. Nothing here
                    # is at one step any more; the restart that follows restores saved state.
                    self._forget_state(step)
                    if isinstance(exc, CommError):
                        self.channel.send(msg.Failed(step, str(exc)))
                    return
            self.step = step + 1
        elif isinstance(decision, msg.Abort):
            self._abort(decision.generation)
        else:
            raise RuntimeError(f"expected Commit({step}) or Abort, got {decision!r}")

    def _step_optimizers(self, step: int, update: Update) -> None:
        zero_layers = {index for layers in self.zero for index in layers}
        whole = {i: o for i, o in self.optimizers.items() if i not in zero_layers}
        if update.skip:  # an fp16 overflow: the step commits with no update
            for opt in whole.values():
                opt.zero_grad(set_to_none=False)
        else:
            scale_gradients(whole, update.factor)
            step_all(whole, step, self.setup["optim"])
        for group in self.zero.values():
            recompute = group.step(lr_at(step, self.setup["optim"]), update)
            if recompute is not None:
                self._recomputing.append(self.host.submit(recompute))

    def _grad_sq(self) -> dict[tuple[int, int], float] | None:
        """The squared norm of every piece of the model this worker holds, where the job asks for them."""
        if not self.setup["norms"]:
            return None
        zero_layers = {index for layers in self.zero for index in layers}
        whole = {i: layer for i, layer in self.layers.items() if i not in zero_layers}
        return grad_sq(whole, {layers[0]: (g.member, g.param.grad) for layers, g in self.zero.items()})

    def _forget_state(self, step: int) -> None:
        self.layers.clear()
        self.optimizers.clear()
        self.zero.clear()
        self.executor = None
        self.torn = step

    def _said_torn(self, step: int) -> bool:
        """Whether a failed ZeRO-1 commit left this worker no state; if so, it says it cannot take part in
        ``step`` (Failed) and waits for the Abort. The coordinator sends the next request (a step, a checkpoint)
        without waiting for a commit, and learns of the failure only from the lost member's death."""
        if self.torn is None:
            return False
        self.channel.send(msg.Failed(step, f"worker {self.worker} holds no state: the commit of step {self.torn} "
                                           f"lost a member of its ZeRO-1 all-gather"))  # fmt: skip
        return True

    def _abort(self, generation: int) -> None:
        self._finish_snapshot()  # the state it copies is the committed one: let it complete, and say so
        if self.undo.armed:
            self.undo.restore()  # an early optimizer step of the abandoned iteration
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)  # partial gradients of the abandoned iteration
        self.channel.send(msg.AbortDone(generation, self.step, tuple(sorted(self.layers))))

    def _phase(self, step: int, phase: str) -> None:
        if (step, phase) in self.armed:
            self.channel.send(msg.AtPhase(step, phase))
            while True:  # the fault injector kills this process now
                time.sleep(1)

    # -- checkpoints -------------------------------------------------------------------------------------------
    def _save(self, message: msg.SaveCheckpoint) -> None:
        if self._said_torn(message.step):
            return
        directory = checkpoint.step_dir(message.directory, message.step)
        nbytes = 0
        optimizers = dict(self.optimizers)
        for group in self.zero.values():  # every member of a ZeRO-1 group takes part, writer or not
            optimizers.update(group.gather(self.layers))
        for index in message.layers:
            data = encode(layer_state(self.layers[index], optimizers[index]))
            path = checkpoint.layer_path(directory, index)
            try:
                checkpoint.atomic_write(path, data)
            except OSError as exc:  # storage, not training, failed: the coordinator abandons this save and goes on
                self.channel.send(msg.Saved(message.step, nbytes, checkpoint.write_error(exc, path)))
                return
            nbytes += len(data)
            self._phase(message.step, "checkpoint")  # a fault armed here finds the checkpoint half written
        self.channel.send(msg.Saved(message.step, nbytes))

    def _restore(
        self, layers: list[int], source: Source | None, plan: Plan, helpers: tuple[int, ...]
    ) -> tuple[int, str]:
        """Load ``layers`` (built fresh) from ``source``; (bytes loaded, where from: memory, parity or storage)."""
        if source is None:
            return 0, ""
        if isinstance(source, MemorySource):
            return self._load_from_memory(source, plan, helpers, layers)
        if not isinstance(source, StorageSource):
            raise TypeError(f"this worker cannot restore from {source!r}")
        return self._load_from_storage(source, layers), "storage"

    def _load_from_storage(self, source: StorageSource, layers: list[int]) -> int:
        """Load ``layers`` from the checkpoint, each layer read from storage once for all the workers that load it
        and passed along their chain (``scheduler.storage_read_chains``), which every worker derives alike from what
        each one lacks: a stage's replicas do not all read it. Returns the bytes loaded into this worker's layers."""
        assert self.comm is not None
        wanted = torch.zeros(num_layers(self.setup["model"]), dtype=torch.uint8)
        wanted[layers] = 1
        restoring = {w: row.nonzero().flatten().tolist() for w, row in self.comm.gather_rows(wanted).items()}
        nbytes = 0
        for index, chain in storage_read_chains(restoring).items():
            if self.worker not in chain:
                continue
            at = chain.index(self.worker)
            if at == 0:
                data = checkpoint.layer_path(Path(source.directory), index).read_bytes()
            else:
                data = self.comm.recv_bytes(chain[at - 1], _RESTORE_TAG + 2 * index)
            if at + 1 < len(chain):
                self.comm.send_bytes(data, chain[at + 1], _RESTORE_TAG + 2 * index)  # tags: size, then payload
            state = decode(data)
            self.layers[index].load_state_dict(state["module"])
            self.optimizers[index].load_state_dict(state["optimizer"])
            nbytes += len(data)
        self.comm.flush_sends()
        return nbytes

    # -- snapshots (REFT) --------------------------------------------------------------------------------------
    @property
    def memory(self) -> Path:
        """This node's host memory for snapshots (its agent's directory)."""
        return shm.node_dir(self.setup["memory_root"], self.node)

    def _snapshot(self, message: msg.TakeSnapshot) -> None:
        started = time.perf_counter()
        self._finish_snapshot()
        if self.snapshotter is None:
            self.snapshotter = Snapshotter(self.memory, self._phase, self.host)
        if self.executor is None:
            return  # its state was torn by a failed commit (ZeRO-1): this snapshot stays incomplete
        model = self.setup["model"]
        groups = {g.layers: g for g in groups_of(self.comm.plan)}  # type: ignore[union-attr]
        states = {
            layers: self.zero[layers].state() if layers in self.zero
            else member_state(model, groups[layers], self.layers, self.optimizers)
            for layers in {r.layers for r in message.records}
        }  # fmt: skip
        self.snapshotter.start(states, message.records, message.step, message.keep)
        self._snapshot_step = message.step
        self._snapshot_s = (self._snapshot_s or 0.0) + time.perf_counter() - started

    def _finish_snapshot(self) -> None:
        """Wait for the host thread's work (AOR's recomputation, the snapshot being copied) and report the
        snapshot's records."""
        running = self.snapshotter is not None and self.snapshotter.running
        if not running and not self._recomputing:
            return
        started = time.perf_counter()
        for recomputation in self._recomputing:
            recomputation.result()
        self._recomputing.clear()
        try:
            report = self.snapshotter.finish() if running else None  # type: ignore[union-attr]
        except OSError as exc:  # host memory, not training, failed: this snapshot stays incomplete and training goes on
            report = None
            error = f"{exc.strerror or exc} copying into {self.memory}"
            self.channel.send(msg.Snapshotted(self._snapshot_step, (), 0.0, 0.0, error))
        self._snapshot_s = (self._snapshot_s or 0.0) + time.perf_counter() - started
        if report is not None:
            self.channel.send(msg.Snapshotted(report.step, report.records, report.copy_s, report.cpu_s))

    def _load_from_memory(self, source: MemorySource, plan: Plan, helpers: tuple[int, ...], layers: list[int]) -> tuple[int, str]:
        """REFT-load: send the records of this node that others need, then rebuild every old group that overlaps
        ``layers`` from this node's records, peers' records and parity. Every record is checked against the checksum
        reported when it was written (where it is read), and a shard decoded from parity against the one its owner
        reported (unless the owner died before it could report it), so the state loaded is the snapshot's bit for
        bit."""
        assert self.comm is not None
        mine = load_plan(source, plan, helpers)[self.worker]
        read: dict[MemoryRecord, torch.Tensor] = {}  # a record several peers need is read (and checked) once
        for record, receiver, tag in mine.sends:
            if record not in read:
                read[record] = read_record(self.memory, record, source.step, record.nbytes)
            self.comm.send(read[record], receiver, _LOAD_TAG + tag)
        model = self.setup["model"]
        crcs = {(layers_, index): crc for layers_, index, crc in source.shard_crcs}
        nbytes, decoded = 0, False
        wanted = {index: self.layers[index] for index in layers}
        for load in mine.groups:
            g = geometry(model, load.group)
            shards = {i: self._fetch(f, source.step) for i, f in load.shards.items()}
            for i, fetches in load.decode.items():
                shards[i] = decode_shard(g, i, shards, {f.record.index: self._fetch(f, source.step) for f in fetches})
                decoded = True
                expected = crcs.get((load.group.layers, i))  # None: its owner died before it reported the shard
                if expected is not None and shm.checksum(shards[i].numpy()) != expected:
                    raise shm.ChecksumError(f"shard {i} of {load.group.describe()} decoded for step {source.step} "
                                            f"does not match the checksum its owner reported")  # fmt: skip
            nbytes += load_into(model, load.group, shards, wanted, self.optimizers)
        self.comm.flush_sends()
        return nbytes, "parity" if decoded else "memory"

    def _fetch(self, fetch: Fetch, step: int) -> Shard:
        """A record on this node (read where it is used), or received from the peer that read (and checked) it on
        its node."""
        assert self.comm is not None
        if fetch.sender is None:
            return LocalRecord(self.memory, fetch.record, step)
        return self.comm.recv((fetch.record.nbytes,), torch.uint8, fetch.sender, _LOAD_TAG + fetch.tag)


def main() -> None:
    parser = argparse.ArgumentParser(description="ftlab worker (started by a node agent)")
    parser.add_argument("--coordinator-addr", default="127.0.0.1")
    parser.add_argument("--coordinator-port", type=int, required=True)
    parser.add_argument("--host-addr", default="127.0.0.1")
    parser.add_argument("--device-index", type=int, default=0, help="this worker's GPU, where it runs on one")
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--incarnation", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steady_allocations()  # every iteration at one speed, the one the profile measured
    hold(worker_point(args.worker, args.incarnation))  # where a test holds a starting worker (``hold``)
    # The secret comes from the environment the agent gave this process (never its command line); it is not kept.
    secret = os.environ.pop(msg.SECRET_ENV)
    channel = Channel(msg.connect(args.coordinator_addr, args.coordinator_port, secret))
    channel.send(msg.Hello("worker", args.node, os.getpid(), args.worker, args.incarnation, host=args.host_addr))
    aborts = msg.connect(args.coordinator_addr, args.coordinator_port, secret)
    aborts.send(msg.Hello("aborts", args.node, os.getpid(), args.worker, args.incarnation, host=args.host_addr))
    del secret
    worker = Worker(channel, aborts, args.node, args.worker, args.heartbeat_s, args.coordinator_addr, args.host_addr,
                    args.device_index)  # fmt: skip
    try:
        worker.serve()
    except Exception:  # noqa: BLE001 - reported to the coordinator, which marks the run failed
        channel.send(msg.Crashed(traceback.format_exc()))
        raise


def _exit_cleanly() -> NoReturn:
    # Retired process groups may still own threads stuck in aborted operations; running their destructors at
    # interpreter exit would abort the process. Everything worth keeping was committed or checkpointed.
    os._exit(0)


if __name__ == "__main__":
    main()
