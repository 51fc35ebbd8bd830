"""Turn instantiated pipelines into the runtime's Plan.

The runtime runs one worker process per GPU and one worker per stage, so a template whose stages use several GPUs
(tensor parallel) has no runtime plan: build runtime templates with ``tensor_parallel=False``. The GPU with local
index ``i`` of node ``n`` is worker ``workers_of_node[n][i]``. Micro-batch ids are dealt to pipelines in order,
each pipeline taking a contiguous range as long as its count. Layer copies become worker-to-worker transfers the
same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ftlab.policies.oobleck.instantiate import PipelineInstance
from ftlab.policies.oobleck.reconfigure import LayerCopy
from ftlab.runtime.contract import LayerTransfer
from ftlab.runtime.plan import Pipeline, Plan, PlanError, Stage


def to_plan(
    pipelines: Sequence[PipelineInstance],
    microbatches: Sequence[int],
    workers_of_node: Mapping[int, Sequence[int]],
    global_batch: int,
    micro_batch: int,
    generation: int = 0,
    step: int = 0,
) -> Plan:
    if len(microbatches) != len(pipelines):
        raise PlanError(f"{len(microbatches)} micro-batch counts for {len(pipelines)} pipelines")
    if micro_batch <= 0 or sum(microbatches) * micro_batch != global_batch:
        raise PlanError(
            f"micro-batch counts {list(microbatches)} of {micro_batch} samples do not add up to the global batch "
            f"{global_batch}"
        )
    out, first = [], 0
    for p, count in zip(pipelines, microbatches):
        stages = []
        for spec in p.template.stages:
            if len(spec.gpus) != 1:
                raise PlanError(
                    f"stage {spec.layers} of a {p.template.num_nodes}-node template runs on {len(spec.gpus)} GPUs; "
                    f"the runtime runs one worker per stage: plan with tensor_parallel=False"
                )
            node = p.nodes[spec.node]
            workers = workers_of_node.get(node, ())
            if spec.gpus[0] >= len(workers):
                raise PlanError(
                    f"node {node} has workers {list(workers)}; the template needs its GPU {spec.gpus[0]}: plan with "
                    f"gpus_per_node equal to the cluster's workers_per_node"
                )
            stages.append(Stage(workers[spec.gpus[0]], spec.start, spec.stop))
        out.append(Pipeline(tuple(stages), tuple(range(first, first + count))))
        first += count
    num_layers = pipelines[0].template.num_layers if pipelines else 0
    plan = Plan(generation, num_layers, global_batch, micro_batch, tuple(out), step=step)
    plan.validate()
    return plan


def worker_transfers(copies: Sequence[LayerCopy], workers_of_node: Mapping[int, Sequence[int]]) -> list[LayerTransfer]:
    """The worker-to-worker transfer of each layer copy."""
    return [
        LayerTransfer(c.layer, workers_of_node[c.src_node][c.src_gpu], workers_of_node[c.dst_node][c.dst_gpu])
        for c in copies
    ]
