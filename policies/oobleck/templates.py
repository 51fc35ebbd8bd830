"""Pipeline templates (Oobleck, SOSP'23, Section 4.1): which node counts, and the best pipeline for each.

Node specification (4.1.1): ``n0`` is the fewest nodes one pipeline fits in (memory), and there is a template for
every node count from ``n0`` to ``N - f * n0``: consecutive sizes, so any ``N'`` with ``(f + 1) n0 <= N' <= N``
is a sum of at least ``f + 1`` template sizes (Theorem A.1). We go on to at least ``2 n0 - 1`` (the paper's
condition ``p > n0 - 1``) even when ``N - f n0`` is smaller, so that a cluster that grows past N by joins is still
covered. A template needs a layer or more per node, so where the range exceeds what the model can spread over it
stops at the largest feasible size; ``generate_templates`` then checks that the cover of ``[(f + 1) n0, N]``
still holds and says which node counts it loses if not.

GPU-to-stage mapping (4.1.2) is ``mapping.StageMapper``. The paper picks the number of stages S minimising
``T(S)`` with ``Nb = 4 S``; compared across S that would favour fewer stages merely for counting fewer
micro-batches, so we pick the S with the least time per micro-batch, ``T(S) / (4 S)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ftlab.policies.oobleck.costs import StageCosts, stage_costs
from ftlab.policies.oobleck.mapping import StageMapper
from ftlab.runtime.core.costs import ModelProfile

PLANNING_MICROBATCHES_PER_STAGE = 4  # the paper's Nb = 4 S (bubbles negligible beyond it, GPipe)


@dataclass(frozen=True)
class StageSpec:
    start: int
    stop: int
    """Layers [start, stop)."""
    node: int
    """Position of the stage's node in the pipeline (0 = the first node)."""
    gpus: tuple[int, ...]
    """Local indices of the node's GPUs running the stage (tensor parallel when several)."""
    time_s: float
    """Forward + backward of one micro-batch."""
    memory_bytes: int
    """Per GPU under 1F1B: weights, optimizer state and the activations of every micro-batch in flight."""

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


@dataclass(frozen=True)
class PipelineTemplate:
    num_nodes: int
    gpus_per_node: int
    num_layers: int
    stages: tuple[StageSpec, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        """Hashed once: templates key the planner's memos, hundreds of lookups per plan at a thousand GPUs."""
        return hash((self.num_nodes, self.gpus_per_node, self.num_layers, self.stages))

    @cached_property
    def _terms(self) -> tuple[float, float, int, float]:
        """(T1, slowest stage time, k*, T3) of the paper's Eq. 1-4; k* is the last slowest stage."""
        times = [s.time_s for s in self.stages]
        slowest = max(times)
        k = max(i for i, t in enumerate(times) if t == slowest)
        return sum(times), slowest, k, sum(times[k:])

    def iteration_time(self, microbatches: int) -> float:
        """T1 + T2 + T3 for ``microbatches`` micro-batches: affine in them, ``fixed_s + n * per_microbatch_s``."""
        return self.fixed_s + microbatches * self.per_microbatch_s

    @property
    def per_microbatch_s(self) -> float:
        return self._terms[1]

    @property
    def fixed_s(self) -> float:
        t1, slowest, k, t3 = self._terms
        return t1 + (k - self.num_stages - 1) * slowest + t3

    @property
    def planning_microbatches(self) -> int:
        return PLANNING_MICROBATCHES_PER_STAGE * self.num_stages

    @property
    def rate(self) -> float:
        """Micro-batches per second at the planning batch (the throughput the template was chosen for)."""
        return self.planning_microbatches / self.iteration_time(self.planning_microbatches)

    def node_stages(self, position: int) -> tuple[StageSpec, ...]:
        return tuple(s for s in self.stages if s.node == position)

    def node_layers(self, position: int) -> range:
        stages = self.node_stages(position)
        return range(stages[0].start, stages[-1].stop)

    @cached_property
    def slots(self) -> tuple[tuple[int, int, range], ...]:
        """(node position, local GPU, layers it holds) for every GPU of the pipeline: kept, since every pipeline
        instantiated from the template (hundreds per reconfiguration at a thousand GPUs) reads it."""
        return tuple((stage.node, gpu, stage.layers) for stage in self.stages for gpu in stage.gpus)


@dataclass(frozen=True)
class TemplateSet:
    """The templates of one job: one per node count, consecutive from ``min_nodes``."""

    fault_threshold: int
    templates: tuple[PipelineTemplate, ...]
    layer_bytes: tuple[int, ...]
    """Weights and optimizer state of each layer: what copying it moves."""

    @property
    def min_nodes(self) -> int:
        return self.templates[0].num_nodes

    @property
    def max_nodes(self) -> int:
        return self.templates[-1].num_nodes

    @property
    def sizes(self) -> range:
        return range(self.min_nodes, self.max_nodes + 1)

    def for_nodes(self, nodes: int) -> PipelineTemplate | None:
        return self.templates[nodes - self.min_nodes] if nodes in self.sizes else None


def node_specification(num_nodes: int, fault_threshold: int, min_nodes: int) -> range:
    """Template sizes n0..max(N - f n0, 2 n0 - 1) (Section 4.1.1): the smallest n0 and the largest p."""
    if (fault_threshold + 1) * min_nodes > num_nodes:
        raise ValueError(
            f"{num_nodes} nodes cannot hold f + 1 = {fault_threshold + 1} pipelines of {min_nodes} nodes (the "
            f"fewest a pipeline fits in): use at least {(fault_threshold + 1) * min_nodes} nodes or a lower "
            f"fault threshold"
        )
    return range(min_nodes, max(num_nodes - fault_threshold * min_nodes, 2 * min_nodes - 1) + 1)


def uncovered_node_counts(sizes: range, num_nodes: int, fault_threshold: int) -> list[int]:
    """Node counts in [(f + 1) n0, N] that no sum of at least f + 1 sizes from the consecutive ``sizes`` makes.

    With sizes a..b, exactly k pipelines use any count in [k a, k b]; the most pipelines a count m allows is
    floor(m / a), so m is covered iff that is at least f + 1 and floor(m / a) * b >= m.
    """
    a, b = sizes.start, sizes.stop - 1
    lost = []
    for m in range((fault_threshold + 1) * a, num_nodes + 1):
        most = m // a
        if most < fault_threshold + 1 or most * b < m:
            lost.append(m)
    return lost


def _degrees(gpus_per_node: int, tensor_parallel: bool) -> tuple[int, ...]:
    if not tensor_parallel:
        return (1,)
    return tuple(g for g in range(1, gpus_per_node + 1) if gpus_per_node % g == 0)


def _template(costs: StageCosts, mapper: StageMapper, nodes: int) -> PipelineTemplate | None:
    placements = mapper.best(nodes)
    if placements is None:
        return None
    total = len(placements)
    stages = tuple(
        StageSpec(
            start=p.start,
            stop=p.stop,
            node=p.node,
            gpus=tuple(range(p.gpu, p.gpu + p.degree)),
            time_s=float(costs.time[p.degree][p.start, p.stop]),
            memory_bytes=int(costs.memory(p.start, p.stop, p.degree, in_flight=total - i)),
        )
        for i, p in enumerate(placements)
    )
    return PipelineTemplate(nodes, mapper.gpus_per_node, costs.num_layers, stages)


class TemplatePlanner:
    """Templates for any node count from one profile and node shape, sharing the search's memo."""

    def __init__(self, profile: ModelProfile, gpus_per_node: int, tensor_parallel: bool = True) -> None:
        self.profile = profile
        degrees = _degrees(gpus_per_node, tensor_parallel)
        self.costs = stage_costs(profile, degrees)
        self.mapper = StageMapper(self.costs, gpus_per_node, degrees)

    def template(self, nodes: int) -> PipelineTemplate | None:
        """The fastest pipeline on ``nodes`` nodes, or None when the model does not fit or spread that far."""
        if nodes > self.profile.num_layers:
            return None  # every node runs a layer or more
        return _template(self.costs, self.mapper, nodes)

    def min_nodes(self, limit: int) -> int | None:
        """n0: the fewest nodes (up to ``limit``) a pipeline fits in."""
        return next((n for n in range(1, min(limit, self.profile.num_layers) + 1) if self.mapper.feasible(n)), None)


def generate_templates(
    profile: ModelProfile, num_nodes: int, fault_threshold: int, gpus_per_node: int, tensor_parallel: bool = True,
    min_nodes: int = 1,
) -> TemplateSet:  # fmt: skip
    """Every template a job of ``num_nodes`` nodes tolerating ``fault_threshold`` failures needs, none of fewer than
    ``min_nodes`` nodes."""
    planner = TemplatePlanner(profile, gpus_per_node, tensor_parallel)
    fits = planner.min_nodes(num_nodes // (fault_threshold + 1))
    n0 = None if fits is None else max(fits, min_nodes)
    if n0 is None:
        raise ValueError(
            f"model {profile.model} does not fit f + 1 = {fault_threshold + 1} times in {num_nodes} nodes of "
            f"{gpus_per_node} x {profile.device_memory_bytes / 2**30:.2f} GiB: add nodes (cluster.nodes) or memory "
            f"(cluster.device_memory_gb), or lower policy.fault_threshold or train.micro_batch"
        )
    templates: list[PipelineTemplate] = []
    for nodes in node_specification(num_nodes, fault_threshold, n0):
        template = planner.template(nodes)
        if template is None:
            break
        templates.append(template)
    sizes = range(n0, n0 + len(templates))
    lost = uncovered_node_counts(sizes, num_nodes, fault_threshold)
    if lost:
        raise ValueError(
            f"templates of {sizes.start}..{sizes.stop - 1} nodes (model {profile.model} spreads over at most "
            f"{sizes.stop - 1}) cannot use exactly {lost[:5]} nodes with f + 1 = {fault_threshold + 1} pipelines"
        )
    layer_bytes = tuple(layer.checkpoint_bytes for layer in profile.layers)
    return TemplateSet(fault_threshold, tuple(templates), layer_bytes)
