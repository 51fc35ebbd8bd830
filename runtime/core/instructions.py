"""The instruction language shared by policies, the runtime and the simulator.

The vocabulary is DeepSpeed's pipeline instructions (``deepspeed.runtime.pipe.schedule``: LoadMicroBatch,
ForwardPass, BackwardPass, Send/RecvActivation, Send/RecvGrad, ReduceGrads, OptimizerStep), with what they lack for
fault tolerance added: a global micro-batch id instead of a buffer slot (so a micro-batch can be followed across
workers and rerouted), an explicit peer worker on every send and receive (so a stage can talk to another pipeline's
worker), decoupled backward (input gradient now, weight gradient later), and layer transfers for recovery.

They are plain frozen dataclasses rather than subclasses of DeepSpeed's: importing DeepSpeed imports torch, and the
contract between policies, runtime and simulator must load in milliseconds (``tests/test_contract.py``).
``runtime.core.scheduler`` produces DeepSpeed's 1F1B order, and ``tests/test_scheduler.py`` holds it to DeepSpeed's own
``TrainSchedule``, instruction by instruction.

A Program is one worker's instruction list: for one iteration, or for the layer transfers of a reconfiguration.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Instruction:
    def __str__(self) -> str:
        fields = ", ".join(f"{'mb' if k == 'microbatch' else k}={v}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


@dataclass(frozen=True)
class MicroBatchInstruction(Instruction):
    """An instruction about one micro-batch (its global id)."""

    microbatch: int


@dataclass(frozen=True)
class PeerInstruction(MicroBatchInstruction):
    """A point-to-point transfer of one micro-batch's tensor with ``peer`` (a worker id)."""

    peer: int


@dataclass(frozen=True)
class LoadMicroBatch(MicroBatchInstruction):
    """First stage: load the input tokens; last stage: load the labels."""


@dataclass(frozen=True)
class ForwardPass(MicroBatchInstruction):
    pass


@dataclass(frozen=True)
class BackwardPass(MicroBatchInstruction):
    """Full backward: input gradient and weight gradients together."""


@dataclass(frozen=True)
class BackwardInput(MicroBatchInstruction):
    """Decoupled backward, first half: the gradient with respect to the stage input only (ReCycle, Zero Bubble)."""


@dataclass(frozen=True)
class BackwardWeight(MicroBatchInstruction):
    """Decoupled backward, second half: the weight gradients, deferrable into a pipeline bubble."""


@dataclass(frozen=True)
class SendActivation(PeerInstruction):
    pass


@dataclass(frozen=True)
class RecvActivation(PeerInstruction):
    pass


@dataclass(frozen=True)
class SendGrad(PeerInstruction):
    pass


@dataclass(frozen=True)
class RecvGrad(PeerInstruction):
    pass


@dataclass(frozen=True)
class ReduceGrads(Instruction):
    """All-reduce each layer's gradient over every replica of that layer (the plan's reduction groups)."""


@dataclass(frozen=True)
class OptimizerStep(Instruction):
    """Commit point: the worker reports the iteration ready and steps its optimizers once the coordinator commits.

    ``early`` (the staggered optimizer): the worker steps as soon as its own gradients are reduced and it reported
    Ready, while the other stages still work and the coordinator collects the iteration, and keeps the state from
    before the step until the commit; an Abort puts that state back, so the iteration still commits everywhere or
    nowhere (``runtime.processes.worker``).
    """

    early: bool = False


@dataclass(frozen=True)
class LayerInstruction(Instruction):
    """A transfer of one layer's parameters with its optimizer state to or from ``peer``, for recovery."""

    layer: int
    peer: int


@dataclass(frozen=True)
class SendLayer(LayerInstruction):
    pass


@dataclass(frozen=True)
class RecvLayer(LayerInstruction):
    pass


@dataclass(frozen=True)
class ForwardRedundant(MicroBatchInstruction):
    """Bamboo's eager forward redundant computation: the forward of ``microbatch`` through layers ``[start, stop)``
    (the next stage's, of which this worker keeps a copy) on the activation this worker's own forward produced. The
    result is dropped: it is the work a takeover of that stage needs, run in a bubble of the pipeline, and it leaves
    no state (the loss head of a last stage is not run: there are no labels here)."""

    start: int
    stop: int


@dataclass(frozen=True)
class ReducedInstruction(Instruction):
    """The reduced gradients of layers ``[start, stop)`` between their holder and ``peer``, which keeps a redundant
    copy of those layers and steps it with them at the commit, so the copy stays exactly current (Bamboo). They come
    after ``ReduceGrads``, before ``OptimizerStep``."""

    peer: int
    start: int
    stop: int


@dataclass(frozen=True)
class SendReduced(ReducedInstruction):
    pass


@dataclass(frozen=True)
class RecvReduced(ReducedInstruction):
    pass


Program = list[Instruction]


def kept_copy(program: Program) -> range | None:
    """The layers of which a worker running ``program`` keeps a redundant copy (it receives their reduced
    gradients), or None: what it keeps besides its stage."""
    kept = [i for i in program if isinstance(i, RecvReduced)]
    return range(kept[0].start, kept[0].stop) if kept else None


COMPUTE = (ForwardPass, BackwardPass, BackwardInput, BackwardWeight, ForwardRedundant)
"""The instructions that run the model's layers: what a worker's compute time counts."""


def phase_of(instruction: Instruction) -> str:
    """The phase of an iteration an instruction belongs to (where a phase fault stops a worker): forward,
    backward, reduce, or "" for the others. The optimizer phase begins at the coordinator's commit."""
    if isinstance(instruction, (ForwardPass, LoadMicroBatch, RecvActivation, SendActivation, ForwardRedundant)):
        return "forward"
    if isinstance(instruction, (BackwardPass, BackwardInput, BackwardWeight, RecvGrad, SendGrad)):
        return "backward"
    if isinstance(instruction, (ReduceGrads, ReducedInstruction)):
        return "reduce"
    return ""
