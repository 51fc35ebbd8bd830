"""Bamboo's redundancy over a plan: who keeps a copy of whose layers, the programs that keep the copies current, and
the plan after predecessors take failed stages over.

A copy is a ``Kept``: worker ``holder`` keeps layers ``[start, stop)`` of ``owner``, the next stage of its pipeline.
The plan records its copies in ``plan.notes[NOTE]`` (plans travel as plain data and come back in ``Change.plan``),
so what a failure leaves is read from the plan every worker ran, not from the policy's memory.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.contract import Job, LayerTransfer
from ftlab.runtime.core.plan import Pipeline, Plan, Stage
from ftlab.runtime.core.scheduler import one_f_one_b

NOTE = "bamboo_copies"
"""The plan note listing its copies; a plan without it has none yet (a first plan, a restart's)."""


@dataclasses.dataclass(frozen=True)
class Kept:
    holder: int
    owner: int
    start: int
    stop: int


def copies_of(plan: Plan) -> dict[int, Kept] | None:
    """The copies ``plan`` keeps, by owner; None when it was planned without copies."""
    if NOTE not in plan.notes:
        return None
    return {k.owner: k for k in (Kept(*row) for row in json.loads(plan.notes[NOTE]))}


def with_copies(plan: Plan, copies: Iterable[Kept], generation: int, step: int) -> Plan:
    """``plan``'s pipelines as generation ``generation`` from ``step``, recording ``copies``."""
    rows = [[k.holder, k.owner, k.start, k.stop] for k in sorted(copies, key=lambda k: k.owner)]
    return dataclasses.replace(plan, generation=generation, step=step, notes={**plan.notes, NOTE: json.dumps(rows)})


def successor_copies(plan: Plan, job: Job) -> list[Kept]:
    """Every stage's copy of the next stage of its pipeline, where the two fit the holder's device (the last stage
    has no successor: a first stage lost always means a restart)."""
    return [
        Kept(stage.worker, nxt.worker, nxt.start, nxt.stop)
        for pipeline in plan.pipelines
        for s, (stage, nxt) in enumerate(zip(pipeline.stages, pipeline.stages[1:]))
        if memory_with_copy(job, stage, len(pipeline.stages) - s, nxt) <= job.device_memory_bytes
    ]


def memory_with_copy(job: Job, stage: Stage, in_flight: int, copy: Stage) -> float:
    """A stage's memory (its state and the activations of ``in_flight`` micro-batches, no activation checkpointing)
    with the state of the copy it keeps: parameters, gradients and optimizer state (its forward keeps nothing)."""
    costs = job.costs
    return costs.stage_memory(stage.start, stage.stop, in_flight) + costs.state_bytes(copy.start, copy.stop)


def transfers(copies: Iterable[Kept]) -> tuple[LayerTransfer, ...]:
    """Each copy made from its owner's layers, with their optimizer state, in place."""
    return tuple(LayerTransfer(layer, k.owner, k.holder) for k in copies for layer in range(k.start, k.stop))


def programs(plan: Plan, copies: Iterable[Kept]) -> dict[int, ins.Program]:
    """1F1B programs with the redundant work: a holder runs the owner's forward of every micro-batch it sends the
    owner (eager forward redundant computation), at its next wait (a receive, or its ReduceGrads: a bubble of the
    pipeline where there is one); after ReduceGrads each owner sends its reduced gradients to its holder, who steps
    the copy with them at the commit."""
    base = one_f_one_b(plan)
    by_holder = {k.holder: k for k in copies}
    by_owner = {k.owner: k for k in by_holder.values()}
    out: dict[int, ins.Program] = {}
    for worker in base:
        kept, owned = by_holder.get(worker), by_owner.get(worker)
        program: ins.Program = []
        pending: list[ins.Instruction] = []
        for instruction in base[worker]:
            if isinstance(instruction, (ins.RecvActivation, ins.RecvGrad, ins.ReduceGrads)):
                program += pending
                pending = []
            if isinstance(instruction, ins.OptimizerStep):
                if owned is not None:
                    program.append(ins.SendReduced(owned.holder, owned.start, owned.stop))
                if kept is not None:
                    program.append(ins.RecvReduced(kept.owner, kept.start, kept.stop))
            program.append(instruction)
            if kept is not None and isinstance(instruction, ins.SendActivation) and instruction.peer == kept.owner:
                pending.append(ins.ForwardRedundant(instruction.microbatch, kept.start, kept.stop))
        out[worker] = program
    return out


def taken_over(plan: Plan, lost: set[int], copies: Mapping[int, Kept], generation: int, step: int) -> Plan | None:
    """The plan after each lost worker's holder runs its stage too (its own layers and the copy, contiguous), or
    None when a lost worker has no live holder (a first stage, or two adjacent stages lost). The copies that still
    match their owner's layers, both ends alive and neither stage grown, are kept."""
    if any(w not in copies or copies[w].holder in lost for w in lost):
        return None
    pipelines = []
    for pipeline in plan.pipelines:
        stages: list[Stage] = []
        for stage in pipeline.stages:
            if stage.worker in lost:
                stages[-1] = Stage(stages[-1].worker, stages[-1].start, stage.stop)  # the holder is the stage before
            else:
                stages.append(stage)
        pipelines.append(Pipeline(tuple(stages), pipeline.microbatches))
    grown = {copies[w].holder for w in lost}
    still = [k for k in copies.values() if not {k.holder, k.owner} & (lost | grown)]
    return with_copies(dataclasses.replace(plan, pipelines=tuple(pipelines)), still, generation, step)
