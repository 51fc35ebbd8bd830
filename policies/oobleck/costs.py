"""What one pipeline stage costs: time per micro-batch and memory per GPU, for every layer range at once.

A stage holds the contiguous layers ``[u, v)`` on ``g`` GPUs of one node. The tables are dense ``(L+1, L+1)``
numpy arrays indexed ``[u, v]`` so the template search (``mapping.py``) works on whole arrays.

Time of a stage for one micro-batch, forward plus backward (the F + B of the paper's Figure 5):
- compute: the layers' profiled F + B divided by ``g`` (tensor parallelism inside the node, Megatron style);
- tensor-parallel all-reduces when ``g > 1``: two per layer in forward and two in backward (attention and MLP
  outputs), each of the layer's output activation, over the intra-node link;
- pipeline sends when the stage is not the last: its output activation forward and the gradient of it backward,
  at the profile's p2p bandwidth (a stage boundary inside a node is charged like one across nodes: we take the
  slower link so a template never counts on a placement it does not control).

Memory per GPU: ``CostModel.stage_memory`` (the figure the preflight check holds a plan to), divided by ``g``: what
a stage holds with no micro-batch in flight (its state, autocast's copy of its weights, a checkpointed stage's
recomputed activations) and what each micro-batch in flight adds. Under 1F1B a stage with ``k`` stages after it holds
``k + 1`` micro-batches. With activation checkpointing (the profile says so) a stage's time gains one forward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ftlab.runtime.core.costs import CostModel, ModelProfile, stage_memory

TP_ALLREDUCES_PER_LAYER = 4


@dataclass(frozen=True)
class StageCosts:
    num_layers: int
    capacity: int
    """Bytes of one GPU."""
    time: dict[int, np.ndarray]
    """Tensor-parallel degree -> seconds per micro-batch, ``inf`` where ``v <= u``."""
    static: dict[int, np.ndarray]
    """Degree -> bytes per GPU held whatever the schedule: weights, gradients, optimizer state."""
    activation: dict[int, np.ndarray]
    """Degree -> bytes per GPU per micro-batch in flight."""

    def max_in_flight(self, degree: int) -> np.ndarray:
        """How many micro-batches a stage can hold in flight: -1 where not even its weights fit, at most L + 1
        (no pipeline has more stages than layers, so more is never asked)."""
        room = self.capacity - self.static[degree]
        act = self.activation[degree]
        cap = self.num_layers + 1
        with np.errstate(divide="ignore", invalid="ignore"):
            fits = np.where(act > 0, np.floor(room / np.where(act > 0, act, 1.0)), cap)
        fits = np.where(room < 0, -1, np.minimum(fits, cap))
        upper = np.triu(np.ones_like(fits, dtype=bool), k=1)
        return np.where(upper, fits, -1).astype(np.int64)

    def memory(self, start: int, stop: int, degree: int, in_flight: int) -> float:
        return float(stage_memory(self.static[degree][start, stop], self.activation[degree][start, stop], in_flight))


def _ranges(per_layer: np.ndarray) -> np.ndarray:
    """[u, v] -> sum of per_layer[u:v] for v > u (0 elsewhere)."""
    prefix = np.concatenate(([0.0], np.cumsum(per_layer, dtype=np.float64)))
    return np.triu(prefix[None, :] - prefix[:, None], k=1)


def _memory_tables(model: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """[u, v] -> what a stage of layers [u, v) holds with no micro-batch in flight, and what each one in flight adds:
    ``CostModel``'s own figures, so a template fits exactly when the preflight check says it does."""
    n = model.num_layers
    held, per_microbatch = np.zeros((n + 1, n + 1)), np.zeros((n + 1, n + 1))
    for start, stop in itertools.combinations(range(n + 1), 2):
        held[start, stop] = model.stage_memory(start, stop, 0)
        per_microbatch[start, stop] = model.activation_bytes(start, stop)
    return held, per_microbatch


def stage_costs(profile: ModelProfile, degrees: tuple[int, ...]) -> StageCosts:
    layers = profile.layers
    n = len(layers)
    checkpointing = profile.activation_checkpointing
    recompute = np.array([layer.fwd_s if checkpointing else 0.0 for layer in layers])
    compute = _ranges(np.array([layer.time_s for layer in layers]) + recompute)
    outputs = np.array([layer.output_bytes for layer in layers], dtype=np.float64)
    output_ranges = _ranges(outputs)
    static, saved = _memory_tables(CostModel(profile))
    # The stage ending at v sends layer v-1's output forward and receives its gradient back; the last sends none.
    send = np.zeros(n + 1)
    send[1:n] = 2 * (profile.latency_s + outputs[: n - 1] / profile.p2p_bytes_per_s)
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    time, static_per_gpu, act_per_gpu = {}, {}, {}
    for g in degrees:
        ring = 2 * (g - 1) / g  # a ring all-reduce moves 2(g-1)/g of the buffer per GPU
        tp = TP_ALLREDUCES_PER_LAYER * ring * output_ranges / profile.intra_node_allreduce_bytes_per_s
        time[g] = np.where(upper, compute / g + tp + send[None, :], np.inf)
        static_per_gpu[g] = static / g
        act_per_gpu[g] = saved / g
    return StageCosts(n, profile.device_memory_bytes, time, static_per_gpu, act_per_gpu)
