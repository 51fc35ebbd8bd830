"""Bamboo's redundancy over a plan: who keeps a copy of whose layers, the programs that keep the copies current, and
the plan after predecessors take failed stages over.

A copy is a ``Kept``: worker ``holder`` keeps layers ``[start, stop)`` of ``owner``, the next stage of its pipeline,
or, in a pipeline of two stages, the first stage's copy kept by the second (Bamboo's ring wraps around: its last node
keeps the first stage; here a worker runs one contiguous range of layers, so the wrap-around copy is kept only where
taking it over leaves the range contiguous).
The plan records its copies in ``plan.notes[NOTE]`` (plans travel as plain data and come back in ``Change.plan``),
so what a failure leaves is read from the plan every worker ran, not from the policy's memory.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.contract import Job, LayerTransfer
from ftlab.runtime.core.costs import weight_copy_bytes
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


def ring_copies(plan: Plan) -> list[tuple[Kept, int]]:
    """Every copy a plan's pipelines keep, each with its holder's micro-batches in flight (1F1B keeps ``S - s`` at
    stage ``s``): each stage keeps the next one; in a two-stage pipeline the second keeps the first too."""
    copies = []
    for pipeline in plan.pipelines:
        stages = pipeline.stages
        for s, (stage, nxt) in enumerate(zip(stages, stages[1:])):
            copies.append((Kept(stage.worker, nxt.worker, nxt.start, nxt.stop), len(stages) - s))
        if len(stages) == 2:
            first, last = stages
            copies.append((Kept(last.worker, first.worker, first.start, first.stop), 1))
    return copies


def fitting_copies(plan: Plan, job: Job) -> list[Kept]:
    """The ring's copies whose holder's stage and copy fit its device."""
    ranges = plan.layer_ranges()
    return [k for k, in_flight in ring_copies(plan)
            if memory_with_copy(job, ranges[k.holder], in_flight, k) <= job.device_memory_bytes]  # fmt: skip


def memory_with_copy(job: Job, stage: tuple[int, int], in_flight: int, copy: Kept | None) -> float:
    """A stage's memory (its state and the activations of ``in_flight`` micro-batches, no activation checkpointing)
    with the copy it keeps, if any: the copy's parameters, gradients and optimizer state, and under autocast its
    weights' half-precision cast, which the iteration's autocast region caches once the redundant forward has used
    them (as it caches the stage's own). The redundant forward keeps no activations (it runs without autograd)."""
    costs = job.costs
    need = costs.stage_memory(*stage, in_flight)
    if copy is None:
        return need
    cast = weight_copy_bytes(costs.param_bytes(copy.start, copy.stop), costs.profile.precision)
    return need + costs.state_bytes(copy.start, copy.stop) + cast


def transfers(copies: Iterable[Kept]) -> tuple[LayerTransfer, ...]:
    """Each copy made from its owner's layers, with their optimizer state, in place."""
    return tuple(LayerTransfer(layer, k.owner, k.holder) for k in copies for layer in range(k.start, k.stop))


def programs(plan: Plan, copies: Iterable[Kept]) -> dict[int, ins.Program]:
    """1F1B programs with the redundant work: a holder runs the owner's forward of every micro-batch it sends the
    owner (eager forward redundant computation), at its next wait (a receive, or its ReduceGrads: a bubble of the
    pipeline where there is one); the holder of a first stage's copy has no input tokens and runs none. After
    ReduceGrads each owner sends its reduced gradients to its holder, who steps the copy with them at the commit."""
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
    """The plan after each lost worker's holder runs its stage too (its own layers and the copy, contiguous: the
    holder is the stage before, or for a first stage the one after), or None when a lost worker has no live holder
    (two adjacent stages lost, or a stage that kept no copy). The copies that still match their owner's layers, both
    ends alive and neither stage grown, are kept."""
    if any(w not in copies or copies[w].holder in lost for w in lost):
        return None
    pipelines = []
    for pipeline in plan.pipelines:
        stages: list[Stage] = []
        carried: int | None = None  # a lost first stage's start, which the stage after it takes
        for stage in pipeline.stages:
            if stage.worker not in lost:
                stages.append(Stage(stage.worker, stage.start if carried is None else carried, stage.stop))
                carried = None
            elif stages:
                stages[-1] = Stage(stages[-1].worker, stages[-1].start, stage.stop)
            else:
                carried = stage.start
        pipelines.append(Pipeline(tuple(stages), pipeline.microbatches))
    grown = {copies[w].holder for w in lost}
    still = [k for k in copies.values() if not {k.holder, k.owner} & (lost | grown)]
    return with_copies(dataclasses.replace(plan, pipelines=tuple(pipelines)), still, generation, step)
