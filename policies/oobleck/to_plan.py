"""Turn instantiated pipelines into the runtime's Plan.

The runtime runs one worker process per GPU and one worker per stage, so a template whose stages use several GPUs
(tensor parallel) has no runtime plan: build runtime templates with ``tensor_parallel=False``. The GPU with local
index ``i`` of node ``n`` is worker ``workers_of_node[n][i]``. Micro-batch ids are dealt to pipelines in order,
each pipeline taking a contiguous range as long as its count. Layer copies become worker-to-worker transfers the
same way.

Successive plans of one job share most of their pipelines (a failure or a join changes a few nodes of a thousand).
``KeptPipelines`` lets ``to_plan`` hand out the previous plan's ``Pipeline`` objects where a pipeline is built from
the same template, workers and micro-batches, instead of building the same thousand stages again: the plans are
equal either way, and a simulated day keeps hundreds of plans that then share their parts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ftlab.policies.oobleck.instantiate import PipelineInstance
from ftlab.policies.oobleck.reconfigure import LayerCopy
from ftlab.policies.oobleck.templates import PipelineTemplate
from ftlab.runtime.core.contract import LayerTransfer
from ftlab.runtime.core.plan import Pipeline, Plan, PlanError, Stage


_Stages = tuple[PipelineTemplate, tuple[tuple[int, ...], ...]]
"""What a runtime pipeline's stages are built from: the template and the workers of each of its nodes."""


class KeptPipelines:
    """The runtime stages and pipelines of the last plan ``to_plan`` built with it, by what each was built from
    (a pipeline by its stages' key, its first micro-batch id and its micro-batch count)."""

    def __init__(self) -> None:
        self.stages: dict[_Stages, tuple[Stage, ...]] = {}
        self.pipelines: dict[tuple[_Stages, int, int], Pipeline] = {}


def to_plan(
    pipelines: Sequence[PipelineInstance],
    microbatches: Sequence[int],
    workers_of_node: Mapping[int, Sequence[int]],
    global_batch: int,
    micro_batch: int,
    generation: int = 0,
    step: int = 0,
    kept: KeptPipelines | None = None,
) -> Plan:
    if len(microbatches) != len(pipelines):
        raise PlanError(f"{len(microbatches)} micro-batch counts for {len(pipelines)} pipelines")
    if micro_batch <= 0 or sum(microbatches) * micro_batch != global_batch:
        raise PlanError(
            f"micro-batch counts {list(microbatches)} of {micro_batch} samples do not add up to the global batch "
            f"{global_batch}"
        )
    last = kept if kept is not None else KeptPipelines()
    built = KeptPipelines()
    out, first = [], 0
    for p, count in zip(pipelines, microbatches):
        key = (p.template, tuple(tuple(workers_of_node.get(node, ())) for node in p.nodes))
        stages = built.stages[key] = last.stages.get(key) or _stages(p, key[1])
        pipeline = last.pipelines.get((key, first, count)) or Pipeline(stages, tuple(range(first, first + count)))
        built.pipelines[(key, first, count)] = pipeline
        out.append(pipeline)
        first += count
    if kept is not None:
        kept.stages, kept.pipelines = built.stages, built.pipelines
    num_layers = pipelines[0].template.num_layers if pipelines else 0
    plan = Plan(generation, num_layers, global_batch, micro_batch, tuple(out), step=step)
    plan.validate()
    return plan


def _stages(p: PipelineInstance, workers: tuple[tuple[int, ...], ...]) -> tuple[Stage, ...]:
    """The runtime stages of ``p``, whose nodes have ``workers``."""
    stages = []
    for spec in p.template.stages:
        if len(spec.gpus) != 1:
            raise PlanError(
                f"stage {spec.layers} of a {p.template.num_nodes}-node template runs on {len(spec.gpus)} GPUs; "
                f"the runtime runs one worker per stage: plan with tensor_parallel=False"
            )
        on_node = workers[spec.node]
        if spec.gpus[0] >= len(on_node):
            raise PlanError(
                f"node {p.nodes[spec.node]} has workers {list(on_node)}; the template needs its GPU {spec.gpus[0]}: "
                f"plan with gpus_per_node equal to the cluster's workers_per_node"
            )
        stages.append(Stage(on_node[spec.gpus[0]], spec.start, spec.stop))
    return tuple(stages)


def worker_transfers(copies: Sequence[LayerCopy], workers_of_node: Mapping[int, Sequence[int]]) -> list[LayerTransfer]:
    """The worker-to-worker transfer of each layer copy."""
    return [
        LayerTransfer(c.layer, workers_of_node[c.src_node][c.src_gpu], workers_of_node[c.dst_node][c.dst_gpu])
        for c in copies
    ]
