"""Runs one worker's Program for one iteration.

The loss of micro-batch ``m`` is the mean token cross-entropy of ``m`` scaled by micro_batch / global_batch, so the
sum over every micro-batch of every pipeline is the mean loss over the global batch, and the per-layer gradient sum
over replicas (``ReduceGrads``) is its gradient, whatever the layout.

With activation checkpointing the stage's forward runs under ``torch.utils.checkpoint`` (non-reentrant): only its
input is kept, and the backward recomputes the forward first. Recomputation replays the same operations on the
same inputs (and the same random state), so losses and gradients are bitwise those without it; a decoupled
backward recomputes once for its input half and keeps the graph for the weight half.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from ftlab.runtime import instructions as ins
from ftlab.runtime.comm import Aborted, GenerationComm, PostedRecv
from ftlab.runtime.data import Batches
from ftlab.runtime.model import StageModule

# p2p tags: one stream of activations and one of gradients per micro-batch.
_ACTIVATION, _GRADIENT = 0, 1
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
    labels: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    input_grads: dict[int, torch.Tensor] = field(default_factory=dict)


class _Receives:
    """The iteration's activation and gradient receives, in program order, each posted ``_RECEIVES_AHEAD`` receives
    before the instruction that needs it."""

    def __init__(self, comm: GenerationComm, program: ins.Program, shape: tuple[int, ...]) -> None:
        self.comm = comm
        self.shape = shape
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
            self.posted[tag] = self.comm.post_recv(self.shape, torch.float32, instruction.peer, _tag(*tag))


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
    ) -> None:
        self.stage = stage
        self.checkpointing = checkpointing
        self.first = stage.start == 0
        self.last = stage.stop == num_layers
        self.comm = comm
        self.batches = batches
        self.on_phase = on_phase
        plan = comm.plan
        self.loss_scale = plan.micro_batch / plan.global_batch
        self.activation_shape = (plan.micro_batch, batches.seq_len, hidden)

    def run(self, program: ins.Program, step: int) -> StepResult:
        """Everything up to and including ReduceGrads; OptimizerStep is the caller's commit point."""
        buffers = _Buffers()
        receives = _Receives(self.comm, program, self.activation_shape)
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
            if isinstance(instruction, (ins.ForwardPass, ins.BackwardPass, ins.BackwardInput, ins.BackwardWeight)):
                compute += time.perf_counter() - started
        return StepResult(loss=loss, compute_s=compute)

    def _execute(self, instruction: ins.Instruction, b: _Buffers, receives: _Receives, step: int) -> float:
        """Run one instruction; returns its contribution to the reported loss."""
        if isinstance(instruction, ins.LoadMicroBatch):
            tokens, labels = (torch.from_numpy(a) for a in self.batches.microbatch(step, instruction.microbatch))
            if self.first:
                b.inputs[instruction.microbatch] = tokens
            if self.last:
                b.labels[instruction.microbatch] = labels
        elif isinstance(instruction, ins.ForwardPass):
            return self._forward(instruction.microbatch, b)
        elif isinstance(instruction, ins.BackwardPass):
            self._backward(instruction.microbatch, b, weights=True, inputs=True)
        elif isinstance(instruction, ins.BackwardInput):
            self._backward(instruction.microbatch, b, weights=False, inputs=True)
        elif isinstance(instruction, ins.BackwardWeight):
            self._backward(instruction.microbatch, b, weights=True, inputs=False)
        elif isinstance(instruction, ins.SendActivation):
            self.comm.send(b.outputs[instruction.microbatch], instruction.peer, _tag(instruction.microbatch, _ACTIVATION))
        elif isinstance(instruction, ins.RecvActivation):
            b.inputs[instruction.microbatch] = receives.take(instruction).requires_grad_()
        elif isinstance(instruction, ins.SendGrad):
            grad = b.input_grads.pop(instruction.microbatch)
            self.comm.send(grad, instruction.peer, _tag(instruction.microbatch, _GRADIENT))
        elif isinstance(instruction, ins.RecvGrad):
            b.output_grads[instruction.microbatch] = receives.take(instruction)
        elif isinstance(instruction, ins.ReduceGrads):
            self.comm.flush_sends()
            self._reduce()
        else:
            raise TypeError(f"the executor cannot run {instruction!r}")
        return 0.0

    def _forward(self, mb: int, b: _Buffers) -> float:
        if self.checkpointing:
            out = checkpoint(self.stage, b.inputs[mb], b.labels.pop(mb, None), use_reentrant=False)
        else:
            out = self.stage(b.inputs[mb], b.labels.pop(mb, None))
        if self.last:
            out = out * self.loss_scale
            b.outputs[mb] = out
            return float(out.detach())
        b.outputs[mb] = out
        return 0.0

    def _backward(self, mb: int, b: _Buffers, weights: bool, inputs: bool) -> None:
        """Full backward (weights and inputs), or one half of a decoupled backward."""
        out, x = b.outputs[mb], b.inputs[mb]
        grad = None if self.last else b.output_grads[mb]
        if not weights:
            if not self.first:  # the first stage's input is token ids: no input gradient to send
                (b.input_grads[mb],) = torch.autograd.grad(out, x, grad_outputs=grad, retain_graph=True)
            return
        # After BackwardInput the graph is still alive; restrict accumulation to the parameters.
        targets = None if inputs else list(self.stage.parameters())
        torch.autograd.backward(out, grad_tensors=grad, inputs=targets)
        if inputs and not self.first:
            b.input_grads[mb] = x.grad
        del b.outputs[mb], b.inputs[mb]
        b.output_grads.pop(mb, None)

    def _reduce(self) -> None:
        for p in self.stage.parameters():
            if p.grad is None:  # a parameter no micro-batch used: every replica must still step it alike
                p.grad = torch.zeros_like(p)
        self.comm.all_reduce_gradients()
