"""Runs one worker's Program for one iteration.

The loss of micro-batch ``m`` is the mean token cross-entropy of ``m`` scaled by micro_batch / global_batch, so the
sum over every micro-batch of every pipeline is the mean loss over the global batch, and the per-layer gradient sum
over replicas (``ReduceGrads``) is its gradient, whatever the layout.

With activation checkpointing (``runtime.training.passes``) a stage keeps only its inputs between forward and backward.

With ``train.precision`` bf16 or fp16 the whole iteration runs in one autocast region (``runtime.training.mixed``),
and activations and their gradients cross stages in the compute precision: receive buffers are posted in it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.processes.comm import Aborted, GenerationComm, PostedRecv
from ftlab.runtime.training.data import Batches
from ftlab.runtime.training.mixed import DTYPES, autocast
from ftlab.runtime.training.model import StageModule
from ftlab.runtime.training.passes import MicroBatch, StagePasses

# p2p tags: one stream of activations and one of gradients per micro-batch.
_ACTIVATION, _GRADIENT = 0, 1
_REDUCED_TAG = 1 << 26
"""Bamboo: a stage's reduced gradients to the holder of its redundant copy (one message an iteration)."""
# Receives posted ahead of the one being waited for. A gloo send to a peer that has not posted its receive yet waits
# for the peer's "ready" notice and then goes out from the sender's communication thread, which on a busy host
# waits for a CPU behind the sender's own computation; posted early, the receive is there when the sender sends.
_RECEIVES_AHEAD = 2


def _tag(microbatch: int, stream: int) -> int:
    return microbatch * 2 + stream


@dataclass
class StepResult:
    loss: float
    compute_s: float


@dataclass
class _Buffers:
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    """Loaded tokens or received activations, until the forward."""
    labels: dict[int, torch.Tensor] = field(default_factory=dict)
    live: dict[int, MicroBatch] = field(default_factory=dict)
    """Micro-batches from their forward until their weight gradients."""
    input_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """Input gradients until they are sent."""


class _Receives:
    """The iteration's activation and gradient receives, in program order, each posted ``_RECEIVES_AHEAD`` receives
    before the instruction that needs it."""

    def __init__(self, comm: GenerationComm, program: ins.Program, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.comm = comm
        self.shape = shape
        self.dtype = dtype
        self.upcoming = deque(i for i in program if isinstance(i, (ins.RecvActivation, ins.RecvGrad)))
        self.posted: dict[tuple[int, int], PostedRecv] = {}
        self._post_ahead()

    def take(self, instruction: ins.RecvActivation | ins.RecvGrad) -> torch.Tensor:
        posted = self.posted.pop(_key(instruction))
        self._post_ahead()  # before waiting: the next one may arrive meanwhile
        return posted.result()

    def _post_ahead(self) -> None:
        while self.upcoming and len(self.posted) <= _RECEIVES_AHEAD:
            instruction = self.upcoming.popleft()
            tag = _key(instruction)
            self.posted[tag] = self.comm.post_recv(self.shape, self.dtype, instruction.peer, _tag(*tag))


def _key(instruction: ins.RecvActivation | ins.RecvGrad) -> tuple[int, int]:
    stream = _ACTIVATION if isinstance(instruction, ins.RecvActivation) else _GRADIENT
    return instruction.microbatch, stream


class Executor:
    def __init__(
        self,
        stage: StageModule,
        num_layers: int,
        hidden: int,
        comm: GenerationComm,
        batches: Batches,
        on_phase: Callable[[int, str], None] = lambda step, phase: None,
        checkpointing: bool = False,
        precision: str = "fp32",
        redundant: StageModule | None = None,
    ) -> None:
        self.stage = stage
        self.redundant = redundant
        """Bamboo: the copy of the next stage's layers this worker keeps (``ins.ForwardRedundant``, ``RecvReduced``)."""
        self.first = stage.start == 0
        self.last = stage.stop == num_layers
        self.comm = comm
        self.batches = batches
        self.on_phase = on_phase
        plan = comm.plan
        self.precision = precision
        self.passes = StagePasses(stage, plan.micro_batch / plan.global_batch, checkpointing, DTYPES[precision])
        self.activation_shape = (plan.micro_batch, batches.seq_len, hidden)

    def run(self, program: ins.Program, step: int, loss_scale: float = 1.0) -> StepResult:
        """Everything up to and including ReduceGrads; OptimizerStep is the caller's commit point. ``loss_scale``:
        fp16's, which the gradients are multiplied by (the reported loss is not)."""
        self.passes.loss_seed = loss_scale
        with autocast(self.precision, self.comm.device):
            return self._run(program, step)

    def _run(self, program: ins.Program, step: int) -> StepResult:
        buffers = _Buffers()
        receives = _Receives(self.comm, program, self.activation_shape, DTYPES[self.precision])
        loss = 0.0
        compute = 0.0
        phase = ""
        for instruction in program:
            if self.comm.aborted.is_set():
                raise Aborted()
            new_phase = ins.phase_of(instruction)
            if new_phase and new_phase != phase:
                phase = new_phase
                self.on_phase(step, phase)
            started = time.perf_counter()
            if isinstance(instruction, ins.OptimizerStep):
                break
            loss += self._execute(instruction, buffers, receives, step)
            if isinstance(instruction, ins.COMPUTE):
                compute += time.perf_counter() - started
        return StepResult(loss=loss, compute_s=compute)

    def _execute(self, instruction: ins.Instruction, b: _Buffers, receives: _Receives, step: int) -> float:
        """Run one instruction; returns its contribution to the reported loss."""
        if isinstance(instruction, ins.LoadMicroBatch):
            device = self.comm.device  # the worker's own GPU with NCCL
            tokens, labels = (torch.from_numpy(a).to(device) for a in self.batches.microbatch(step, instruction.microbatch))
            if self.first:
                b.inputs[instruction.microbatch] = tokens
            if self.last:
                b.labels[instruction.microbatch] = labels
        elif isinstance(instruction, ins.ForwardPass):
            mb = instruction.microbatch
            b.live[mb] = self.passes.forward(b.inputs.pop(mb), b.labels.pop(mb, None))
            return float(b.live[mb].result.detach()) if self.last else 0.0
        elif isinstance(instruction, ins.BackwardPass):
            self._keep_input_grad(instruction.microbatch, b, self.passes.backward(b.live.pop(instruction.microbatch)))
        elif isinstance(instruction, ins.BackwardInput):
            mb = instruction.microbatch
            self._keep_input_grad(mb, b, self.passes.backward_input(b.live[mb]))
        elif isinstance(instruction, ins.BackwardWeight):
            self.passes.backward_weight(b.live.pop(instruction.microbatch))
        elif isinstance(instruction, ins.SendActivation):
            mb = instruction.microbatch
            self.comm.send(b.live[mb].result, instruction.peer, _tag(mb, _ACTIVATION))
        elif isinstance(instruction, ins.RecvActivation):
            b.inputs[instruction.microbatch] = receives.take(instruction).requires_grad_()
        elif isinstance(instruction, ins.SendGrad):
            grad = b.input_grads.pop(instruction.microbatch)
            self.comm.send(grad, instruction.peer, _tag(instruction.microbatch, _GRADIENT))
        elif isinstance(instruction, ins.RecvGrad):
            b.live[instruction.microbatch].grad = receives.take(instruction)
        elif isinstance(instruction, ins.ReduceGrads):
            self.comm.flush_sends()
            self._reduce()
        elif isinstance(instruction, ins.ForwardRedundant):
            self._forward_redundant(b.live[instruction.microbatch].result)
        elif isinstance(instruction, ins.SendReduced):
            grads = torch.cat([p.grad.reshape(-1) for p in self.stage.parameters()])  # type: ignore[union-attr]
            self.comm.send(grads, instruction.peer, _REDUCED_TAG)
        elif isinstance(instruction, ins.RecvReduced):
            self._receive_reduced(instruction.peer)
        else:
            raise TypeError(f"the executor cannot run {instruction!r}")
        return 0.0

    @staticmethod
    def _keep_input_grad(mb: int, b: _Buffers, grad: torch.Tensor | None) -> None:
        if grad is not None:  # the first stage's input is token ids: no input gradient to send
            b.input_grads[mb] = grad

    def _forward_redundant(self, activation: torch.Tensor) -> None:
        """The next stage's forward on its kept copy, without the loss head of a last stage; nothing is kept."""
        assert self.redundant is not None, "ForwardRedundant on a worker that keeps no copy of the next stage"
        r = self.redundant
        with torch.no_grad():
            x = activation.detach()
            for index in range(r.start, r.stop - 1 if r.is_last else r.stop):
                x = r.layer(index)(x)

    def _receive_reduced(self, peer: int) -> None:
        """The next stage's reduced gradients into the kept copy's, which the commit's optimizer step applies (every
        optimizer this worker holds steps), so the copy stays equal to the stage's own layers."""
        assert self.redundant is not None, "RecvReduced on a worker that keeps no copy of the next stage"
        params = list(self.redundant.parameters())
        flat = self.comm.recv((sum(p.numel() for p in params),), params[0].dtype, peer, _REDUCED_TAG)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def _reduce(self) -> None:
        for p in self.stage.parameters():
            if p.grad is None:  # a parameter no micro-batch used: every replica must still step it alike
                p.grad = torch.zeros_like(p)
        self.comm.all_reduce_gradients()
