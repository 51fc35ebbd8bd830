"""The one cost model: what a layer range costs in time and memory, and what every instruction of a program costs.

Planners (Oobleck's templates, ReCycle's schedule), plan mode and the simulator all read costs from here, so a
prediction in one of them means the same as in the others. The numbers come from a ``ModelProfile``: per layer,
times measured on a real device (``runtime.processes.profiler.measure_profile``) or derived from FLOPs for a GPU type
(``profile_from_specs``), and link figures.

Memory has one formula, whatever the source of the times: a layer's bytes come from ``runtime.core.model_spec`` (fp32
weights, 12 more bytes per parameter for the gradient and AdamW's two moments, the activations it keeps per
micro-batch with the model's attention, ``model.attention``, a dropout mask's byte an element in any precision),
and a stage holds its layers' state plus the activations of every micro-batch in flight (``stage_memory``).
``tests/test_model.py`` holds the activation formulas to what autograd keeps.

Mixed precision (``train.precision``, ``ModelProfile.precision``; the design is ``runtime.core.precision``'s):
activations, what they keep for the backward and what crosses a stage boundary are in the compute precision
(``with_precision`` scales a profile's fp32 figures; every op is taken to keep half-precision tensors, as CPU
autocast does: on a GPU norms and softmax keep fp32, so the saved bytes are an estimate, as they are in fp32).
The state stays fp32 master weights, fp32 gradients (what the replicas all-reduce) and AdamW's fp32 moments, so
checkpoints, transfers and snapshots move what they move in fp32; a stage also holds autocast's half-precision copy
of its weights for the iteration (``weight_copy_bytes``). tf32 is fp32 for every byte. An analytic GPU profile
computes at the device's peak in the job's precision (``runtime.core.devices``); a measured profile's times are
measured in fp32 and not scaled.

Activation checkpointing (``train.activation_checkpointing``, ``ModelProfile.activation_checkpointing``) is per
stage, as the runtime does it (``runtime.processes.executor``): a stage keeps only its input for each micro-batch in flight
and recomputes its whole forward in the backward pass. So a stage holds its state, its input for every micro-batch
in flight, and the full activations of the one micro-batch whose backward runs; and every backward (its input
half, for a decoupled one) costs one forward more.

Communication: a point-to-point message of n bytes costs ``latency_s + n / p2p_bytes_per_s``; a ring all-reduce of
n bytes over k ranks ``latency_s + 2 (k - 1) / k * n / allreduce_bytes_per_s`` (bus bandwidth). Which link a
message takes is not known from a plan (it names workers, not hosts), so plan-level predictions charge the
inter-node figures: the slower link, as Oobleck's planner does. On a GPU type the inter-node figure is a GPU's share
of its node's network (``runtime.core.devices.NodeSpec.gpu_network_bytes_per_s``).

Everything here is plain arithmetic: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import accumulate

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.devices import NodeSpec
from ftlab.runtime.core.model_spec import FP32, LayerSpec
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.core.precision import activation_scale, autocasts

OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 gradient + AdamW's exp_avg and exp_avg_sq
GRADIENT_BYTES_PER_PARAM = FP32
ADAMW_BYTES_PER_PARAM = 28
"""Memory traffic of one fused AdamW step: read weight, gradient and both moments, write weight and both moments."""

Durations = Callable[[int, ins.Instruction], float]
"""Seconds an instruction takes on a worker (what ``runtime.core.program_check.simulate`` executes programs with)."""


@dataclass(frozen=True)
class LayerProfile:
    fwd_s: float
    bwd_input_s: float
    bwd_weight_s: float
    """Times per micro-batch; the two backward halves add up to one full backward."""
    param_bytes: int
    optimizer_bytes: int
    output_bytes: int
    """Per micro-batch: what a pipeline send of this layer's output carries (0 for the last layer)."""
    saved_bytes: int
    """Per micro-batch: activations kept from forward until backward."""
    optimizer_s: float = 0.0
    """One optimizer step of the layer's parameters."""

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_input_s + self.bwd_weight_s

    @property
    def state_bytes(self) -> int:
        """Weights, gradient and optimizer state: what a stage holds for the layer whatever the schedule."""
        return self.param_bytes + self.optimizer_bytes

    @property
    def checkpoint_bytes(self) -> int:
        """Weights and AdamW's moments: what a checkpoint, a restore or a layer sent to another worker carries (the
        gradient is rebuilt every step; ``runtime.training.layer_state`` leaves it out)."""
        return self.state_bytes - GRADIENT_BYTES_PER_PARAM * (self.param_bytes // FP32)


@dataclass(frozen=True)
class ModelProfile:
    model: str
    device: str
    micro_batch: int
    seq_len: int
    layers: tuple[LayerProfile, ...]
    device_memory_bytes: int
    p2p_bytes_per_s: float
    intra_node_allreduce_bytes_per_s: float
    inter_node_allreduce_bytes_per_s: float
    """All-reduce bandwidths are bus bandwidths: an all-reduce of n bytes over k ranks takes 2(k-1)/k * n / bw."""
    latency_s: float = 0.0
    """Per message, on top of the bandwidth term."""
    activation_checkpointing: bool = False
    """Stages recompute their forward in the backward pass (module docstring): the job's setting, not measured."""
    precision: str = "fp32"
    """The compute precision its activation bytes are counted in (``with_precision``): the job's setting."""
    node_network_bytes_per_s: float | None = None
    """A node's inter-node network, all its workers together, one direction (an analytic profile's); None for a
    measured profile, whose links are measured between two processes (``CostModel.node_network_bytes_per_s``)."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> ModelProfile:
        return ModelProfile(**{**data, "layers": tuple(LayerProfile(**layer) for layer in data["layers"])})


def layer_bytes(spec: LayerSpec, micro_batch: int, seq_len: int, precision: str = "fp32") -> dict[str, int]:
    """The memory fields of a LayerProfile: the single source of every memory figure."""
    tokens = micro_batch * seq_len
    return {
        "param_bytes": FP32 * spec.params,
        "optimizer_bytes": OPTIMIZER_BYTES_PER_PARAM * spec.params,
        "output_bytes": _activations(spec.output_bytes_per_token * tokens, precision),
        "saved_bytes": (_activations(spec.saved_bytes_per_token * tokens, precision)
                        + spec.saved_mask_bytes_per_token * tokens),
    }


def _activations(fp32_bytes: int, precision: str) -> int:
    return int(fp32_bytes * activation_scale(precision))


def with_precision(profile: ModelProfile, precision: str) -> ModelProfile:
    """``profile`` (whose bytes are fp32's, as measured or derived) with its activations in ``precision`` (a measured
    profile keeps no dropout mask, whose bytes would not scale: ``model.attention``)."""
    if profile.precision != "fp32":
        raise ValueError(f"the profile is in {profile.precision} already")
    layers = tuple(
        replace(layer, output_bytes=_activations(layer.output_bytes, precision),
                saved_bytes=_activations(layer.saved_bytes, precision))
        for layer in profile.layers
    )  # fmt: skip
    return replace(profile, layers=layers, precision=precision)


def weight_copy_bytes(param_bytes: float, precision: str) -> float:
    """Autocast's copy of fp32 weights in the compute precision, held for an iteration (none in fp32 or tf32)."""
    return param_bytes * activation_scale(precision) if autocasts(precision) else 0.0


def profile_from_specs(
    model: str, specs: Sequence[LayerSpec], node: NodeSpec, micro_batch: int, seq_len: int, precision: str = "fp32"
) -> ModelProfile:
    """A profile for a node of a GPU type of ``runtime.core.devices``, in ``precision`` (its math mode's peak, its
    activation bytes): forward is bound by arithmetic or, for layers with little of it (an embedding lookup), by
    writing its activations to memory; backward is twice forward, split evenly between the input gradient and the
    weight gradients; the optimizer step is bound by memory traffic. Messages across nodes get a GPU's share of the
    node's network."""
    gpu = node.gpu
    flops = node.flops(precision)
    tokens = micro_batch * seq_len
    layers = []
    for spec in specs:
        sizes = layer_bytes(spec, micro_batch, seq_len, precision)
        written = sizes["output_bytes"] + sizes["saved_bytes"]
        fwd = max(spec.fwd_flops_per_token * tokens / flops, written / gpu.memory_bytes_per_s)
        layers.append(
            LayerProfile(
                fwd_s=fwd,
                bwd_input_s=fwd,
                bwd_weight_s=fwd,
                optimizer_s=ADAMW_BYTES_PER_PARAM * spec.params / gpu.memory_bytes_per_s,
                **sizes,
            )
        )
    return ModelProfile(
        model=model,
        device=gpu.name,
        micro_batch=micro_batch,
        seq_len=seq_len,
        layers=tuple(layers),
        device_memory_bytes=gpu.memory_bytes,
        p2p_bytes_per_s=node.gpu_network_bytes_per_s,
        intra_node_allreduce_bytes_per_s=node.intra_node_bytes_per_s,
        inter_node_allreduce_bytes_per_s=node.gpu_network_bytes_per_s,
        latency_s=gpu.latency_s,
        precision=precision,
        node_network_bytes_per_s=node.network_bytes_per_s,
    )


def stage_memory(state_bytes: float, activation_bytes: float, in_flight: float, transient_bytes: float = 0.0) -> float:
    """A stage's memory: its layers' state plus the kept activations of ``in_flight`` micro-batches (under 1F1B a
    stage with k stages after it holds k + 1), plus what one backward holds on top (a checkpointed stage's
    recomputed activations). Works on numbers and on numpy arrays alike."""
    return state_bytes + in_flight * activation_bytes + transient_bytes


def stage_footprint(
    layers: Sequence[LayerProfile], start: int, stop: int, in_flight: int, checkpointing: bool, precision: str = "fp32"
) -> float:
    """The memory of a stage of ``layers[start:stop]`` with ``in_flight`` micro-batches, with or without activation
    checkpointing, in ``precision`` (``layers``' bytes counted in it): the one formula ``CostModel.stage_memory``
    and the preflight check share."""
    held = layers[start:stop]
    state = sum(layer.state_bytes for layer in held)
    saved = sum(layer.saved_bytes for layer in held)
    copy = weight_copy_bytes(sum(layer.param_bytes for layer in held), precision)
    if not checkpointing:
        return stage_memory(state, saved, in_flight, transient_bytes=copy)
    return stage_memory(state, stage_input_bytes(layers, start), in_flight, transient_bytes=saved + copy)


def stage_input_bytes(layers: Sequence[LayerProfile], start: int) -> int:
    """What a checkpointed stage keeps per micro-batch: its input (the previous layer's output; token ids, counted
    as nothing, for the first stage)."""
    return layers[start - 1].output_bytes if start > 0 else 0


def _prefix(values: Sequence[float]) -> list[float]:
    return [0.0, *accumulate(values)]


class CostModel:
    """Costs of layer ranges ``[start, stop)`` and of instructions, from one profile."""

    def __init__(self, profile: ModelProfile) -> None:
        self.profile = profile
        layers = profile.layers
        self._fwd = _prefix([x.fwd_s for x in layers])
        self._bwd_input = _prefix([x.bwd_input_s for x in layers])
        self._bwd_weight = _prefix([x.bwd_weight_s for x in layers])
        self._optimizer = _prefix([x.optimizer_s for x in layers])
        self._state = _prefix([x.state_bytes for x in layers])
        self._checkpoint = _prefix([x.checkpoint_bytes for x in layers])
        self._params = _prefix([x.param_bytes for x in layers])
        self._saved = _prefix([x.saved_bytes for x in layers])

    @property
    def num_layers(self) -> int:
        return self.profile.num_layers

    # -- compute -----------------------------------------------------------------------------------------------
    def forward_s(self, start: int, stop: int) -> float:
        return self._fwd[stop] - self._fwd[start]

    def backward_input_s(self, start: int, stop: int) -> float:
        """With activation checkpointing, the recomputed forward comes first."""
        recompute = self.forward_s(start, stop) if self.profile.activation_checkpointing else 0.0
        return recompute + self._bwd_input[stop] - self._bwd_input[start]

    def backward_weight_s(self, start: int, stop: int) -> float:
        return self._bwd_weight[stop] - self._bwd_weight[start]

    def backward_s(self, start: int, stop: int) -> float:
        return self.backward_input_s(start, stop) + self.backward_weight_s(start, stop)

    def optimizer_s(self, start: int, stop: int) -> float:
        return self._optimizer[stop] - self._optimizer[start]

    # -- memory ------------------------------------------------------------------------------------------------
    def state_bytes(self, start: int, stop: int) -> float:
        return self._state[stop] - self._state[start]

    def checkpoint_bytes(self, start: int, stop: int) -> float:
        return self._checkpoint[stop] - self._checkpoint[start]

    def param_bytes(self, start: int, stop: int) -> float:
        return self._params[stop] - self._params[start]

    def activation_bytes(self, start: int, stop: int) -> float:
        """Kept per micro-batch in flight: the layers' saved activations, or a checkpointed stage's input."""
        if self.profile.activation_checkpointing:
            return stage_input_bytes(self.profile.layers, start)
        return self._saved[stop] - self._saved[start]

    def transient_bytes(self, start: int, stop: int) -> float:
        """Held on top during one iteration: autocast's weight copy, and a checkpointed stage's recomputed
        activations during one backward."""
        copy = weight_copy_bytes(self.param_bytes(start, stop), self.profile.precision)
        return copy + (self._saved[stop] - self._saved[start] if self.profile.activation_checkpointing else 0.0)

    def stage_memory(self, start: int, stop: int, in_flight: int) -> float:
        return stage_memory(
            self.state_bytes(start, stop), self.activation_bytes(start, stop), in_flight, self.transient_bytes(start, stop)
        )

    # -- communication -----------------------------------------------------------------------------------------
    def boundary_bytes(self, layer: int) -> int:
        """What crosses the stage boundary before ``layer``: layer - 1's output (forward) or its gradient."""
        return self.profile.layers[layer - 1].output_bytes

    @property
    def node_network_bytes_per_s(self) -> float:
        """A node's inter-node network, all its workers together, one direction: a GPU type's node network, or for a
        measured profile the point-to-point rate it measured."""
        p = self.profile
        return p.p2p_bytes_per_s if p.node_network_bytes_per_s is None else p.node_network_bytes_per_s

    def p2p_s(self, nbytes: float) -> float:
        return self.profile.latency_s + nbytes / self.profile.p2p_bytes_per_s

    def allreduce_s(self, nbytes: float, ranks: int, intra_node: bool = False) -> float:
        if ranks < 2:
            return 0.0
        p = self.profile
        bandwidth = p.intra_node_allreduce_bytes_per_s if intra_node else p.inter_node_allreduce_bytes_per_s
        return p.latency_s + 2 * (ranks - 1) / ranks * nbytes / bandwidth

    def transfer_s(self, layer: int) -> float:
        """Copying one layer with its optimizer state to another worker."""
        return self.p2p_s(self.profile.layers[layer].checkpoint_bytes)

    # -- programs ----------------------------------------------------------------------------------------------
    def reduce_s(self, plan: Plan, group_s: Callable[[float, int], float] | None = None) -> dict[int, float]:
        """Each worker's ``ReduceGrads``: the all-reduce of each of its replica sets (issued together, so their
        costs add up on the worker's link). Workers that share no layer are left out (they reduce nothing).
        ``group_s``: a replica set's all-reduce from its bytes and members (default ``allreduce_s``, the link's)."""
        by_range = plan.workers_by_range()
        return {
            worker: seconds for held, seconds in self.range_reduce_s(plan, group_s).items() for worker in by_range[held]
        }

    def range_reduce_s(
        self, plan: Plan, group_s: Callable[[float, int], float] | None = None
    ) -> dict[tuple[int, int], float]:
        """``reduce_s`` by range of layers (``Plan.workers_by_range``): the workers of a range are in the same
        replica sets, so their ``ReduceGrads`` cost the same."""
        group_s = group_s or self.allreduce_s
        groups = [
            (layers[0], group_s(sum(self.param_bytes(layer, layer + 1) for layer in layers), len(holders)))
            for holders, layers in plan.reduction_groups()
        ]
        reduce_s: dict[tuple[int, int], float] = {}
        for start, stop in plan.workers_by_range():
            # A worker holds all of a group's layers or none (they have the same holders): its first one tells.
            for first, seconds in groups:
                if start <= first < stop:
                    reduce_s[(start, stop)] = reduce_s.get((start, stop), 0.0) + seconds
        return reduce_s

    def durations(self, plan: Plan) -> Durations:
        """What each instruction of ``plan``'s programs costs on its worker: compute of the worker's layers, a send
        at the p2p cost of the activation (or gradient) at its stage boundary, the gradient all-reduce of each of
        its replica sets (issued together, so their costs add up on the worker's link), the optimizer step.
        Receives and loads cost nothing of their own: a receive waits for its send's arrival."""
        ranges = plan.layer_ranges()
        reduce_s = self.reduce_s(plan)

        def duration(worker: int, instruction: ins.Instruction) -> float:
            start, stop = ranges[worker]
            match instruction:
                case ins.ForwardPass():
                    return self.forward_s(start, stop)
                case ins.BackwardPass():
                    return self.backward_s(start, stop)
                case ins.BackwardInput():
                    return self.backward_input_s(start, stop)
                case ins.BackwardWeight():
                    return self.backward_weight_s(start, stop)
                case ins.SendActivation():
                    return self.p2p_s(self.boundary_bytes(stop))
                case ins.SendGrad():
                    return self.p2p_s(self.boundary_bytes(start))
                case ins.SendLayer(layer=layer):
                    return self.transfer_s(layer)
                case ins.ForwardRedundant(start=first, stop=end):
                    return self.forward_s(first, end)
                case ins.SendReduced(start=first, stop=end):
                    return self.p2p_s(self.param_bytes(first, end))  # a gradient the size of the layers' parameters
                case ins.ReduceGrads():
                    return reduce_s.get(worker, 0.0)
                case ins.OptimizerStep():
                    return self.optimizer_s(start, stop)
            return 0.0

        return duration
