"""The instruction language shared by policies, the runtime and the simulator.

Each class extends DeepSpeed's pipeline instruction of the same meaning where one exists, so DeepSpeed's schedules
and ours print and compare alike. Two things DeepSpeed's instructions lack are added: a global micro-batch id instead
of a buffer slot (so a micro-batch can be followed across workers and rerouted), and an explicit peer worker on
every send and receive (so a stage can talk to another pipeline's worker). Decoupled backward (input gradient now,
weight gradient later) and layer-state transfers for recovery are new instructions.

A Program is one worker's instruction list for one iteration.
"""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds


class MicroBatchInstruction(ds.BufferOpInstruction):
    """An instruction about one micro-batch; ``buffer_id`` holds the global micro-batch id."""

    def __init__(self, microbatch: int, **kwargs: int) -> None:
        super().__init__(buffer_id=microbatch, **kwargs)

    @property
    def microbatch(self) -> int:
        return self.buffer_id

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.kwargs.items()))))


class PeerInstruction(MicroBatchInstruction):
    """A point-to-point transfer of one micro-batch's tensor with ``peer`` (a worker id)."""

    def __init__(self, microbatch: int, peer: int) -> None:
        super().__init__(microbatch, peer=peer)


class LoadMicroBatch(MicroBatchInstruction, ds.LoadMicroBatch):
    """First stage: load the input tokens; last stage: load the labels."""


class ForwardPass(MicroBatchInstruction, ds.ForwardPass):
    pass


class BackwardPass(MicroBatchInstruction, ds.BackwardPass):
    """Full backward: input gradient and weight gradients together."""


class BackwardInput(MicroBatchInstruction):
    """Decoupled backward, first half: the gradient with respect to the stage input only (ReCycle, Zero Bubble)."""


class BackwardWeight(MicroBatchInstruction):
    """Decoupled backward, second half: the weight gradients, deferrable into a pipeline bubble."""


class SendActivation(PeerInstruction, ds.SendActivation):
    pass


class RecvActivation(PeerInstruction, ds.RecvActivation):
    pass


class SendGrad(PeerInstruction, ds.SendGrad):
    pass


class RecvGrad(PeerInstruction, ds.RecvGrad):
    pass


class ReduceGrads(ds.ReduceGrads):
    """All-reduce each layer's gradient over every replica of that layer (the plan's reduction groups)."""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self).__name__)


class OptimizerStep(ds.OptimizerStep):
    """Commit point: the worker reports the iteration ready and steps its optimizers once the coordinator commits."""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self).__name__)


class LayerInstruction(ds.PipeInstruction):
    """A transfer of one layer's parameters with its optimizer state, for recovery."""

    def __init__(self, layer: int, peer: int) -> None:
        super().__init__(layer=layer, peer=peer)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.layer, self.peer))  # type: ignore[attr-defined]


class SendLayer(LayerInstruction):
    pass


class RecvLayer(LayerInstruction):
    pass


Program = list[ds.PipeInstruction]
