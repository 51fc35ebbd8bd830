"""The default scheduler: DeepSpeed's 1F1B order for every pipeline of a Plan, and the programs of layer transfers.

DeepSpeed's ``TrainSchedule`` runs, on stage s of S with M micro-batches, min(S - s - 1, M) forward passes to fill
the pipeline, then alternates one forward and one backward, then drains the remaining backward passes; each receive
sits just before the pass that needs it, the first and last stages load a micro-batch just before its forward, and
the iteration ends with ReduceGrads and OptimizerStep. We generate that order directly (importing DeepSpeed would
import torch, see ``runtime.core.instructions``); ``tests/test_scheduler.py`` translates DeepSpeed's own schedule for
many shapes and holds ours equal to it.

One change of order: every send moves up to just after the pass that computes what it sends. DeepSpeed sends one
schedule step late (with the next receive) because its sends block until the peer receives; the runtime's sends
return at once (``runtime.processes.comm``), so sending at once lets the peer start sooner and never blocks anyone. Without
it the last stage waits a whole round trip (its gradient out, the next activation back) before each forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.plan import Pipeline, Plan


class OneFOneB(Mapping[int, ins.Program]):
    """Every worker's 1F1B program for one plan, each built when first read.

    A worker's program is a pure function of its pipeline and its stage in it (``stage_program``), so a reader who
    needs only some of them (the simulator executes one pipeline of each shape, ``runtime.sim.timing``) does not pay
    for building a thousand workers' programs per plan. Reading every program gives exactly the dict the scheduler
    always gave; a worker named in several pipelines gets the program of the last.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._built: dict[int, ins.Program] = {}

    @cached_property
    def stage_of(self) -> dict[int, tuple[Pipeline, int]]:
        """Each worker's pipeline and stage: built when a program is first read (the simulator reads none of a
        pipeline of a known shape, ``disjoint`` asks the plan)."""
        return {
            stage.worker: (pipeline, stage_id)
            for pipeline in self.plan.pipelines
            for stage_id, stage in enumerate(pipeline.stages)
        }

    def __getitem__(self, worker: int) -> ins.Program:
        program = self._built.get(worker)
        if program is None:
            program = self._built[worker] = stage_program(*self.stage_of[worker])
        return program

    def __iter__(self) -> Iterator[int]:
        return iter(self.stage_of)

    def __len__(self) -> int:
        return len(self.stage_of)

    @property
    def disjoint(self) -> bool:
        """No worker serves two pipelines: each pipeline's programs talk only among themselves."""
        return len(self.plan.workers) == sum(len(p.stages) for p in self.plan.pipelines)


def one_f_one_b(plan: Plan) -> OneFOneB:
    return OneFOneB(plan)


def passes(stages: int, stage_id: int, microbatches: int) -> Iterator[tuple[bool, int]]:
    """(is_forward, local micro-batch index) of every pass of one stage, in 1F1B order."""
    warmup = min(stages - stage_id - 1, microbatches)
    for m in range(warmup):
        yield True, m
    for m in range(microbatches - warmup):
        yield True, warmup + m
        yield False, m
    for m in range(microbatches - warmup, microbatches):
        yield False, m


def stage_program(pipeline: Pipeline, stage_id: int) -> ins.Program:
    stages = len(pipeline.stages)
    first, last = stage_id == 0, stage_id == stages - 1
    prev_peer = None if first else pipeline.stages[stage_id - 1].worker
    next_peer = None if last else pipeline.stages[stage_id + 1].worker
    program: ins.Program = []
    for forward, local in passes(stages, stage_id, len(pipeline.microbatches)):
        mb = pipeline.microbatches[local]
        if forward:
            if prev_peer is not None:
                program.append(ins.RecvActivation(mb, prev_peer))
            if first or last:
                program.append(ins.LoadMicroBatch(mb))
            program.append(ins.ForwardPass(mb))
            if next_peer is not None:
                program.append(ins.SendActivation(mb, next_peer))
        else:
            if next_peer is not None:
                program.append(ins.RecvGrad(mb, next_peer))
            program.append(ins.BackwardPass(mb))
            if prev_peer is not None:
                program.append(ins.SendGrad(mb, prev_peer))
    return [*program, ins.ReduceGrads(), ins.OptimizerStep()]


def transfer_programs(transfers: Sequence[object]) -> dict[int, ins.Program]:
    """Each worker's part of a list of layer transfers (``contract.LayerTransfer``): its sends first, then its
    receives, each in list order. Sends never block, so no worker can wait on one that waits on it."""
    sends: dict[int, ins.Program] = {}
    receives: dict[int, ins.Program] = {}
    for t in transfers:
        sends.setdefault(t.source, []).append(ins.SendLayer(t.layer, t.destination))  # type: ignore[attr-defined]
        receives.setdefault(t.destination, []).append(ins.RecvLayer(t.layer, t.source))  # type: ignore[attr-defined]
    return {w: sends.get(w, []) + receives.get(w, []) for w in sorted(sends.keys() | receives.keys())}


def storage_read_chains(restoring: Mapping[int, Sequence[int]]) -> dict[int, tuple[int, ...]]:
    """Who reads each layer of a checkpoint in storage, and who passes it on: ``restoring`` maps each worker to the
    layers it loads; the answer maps each layer to its chain, the first worker (in worker order) that loads it, which
    reads it, then the others in worker order, each receiving it from the one before. A stage is read from storage
    once, not once per data-parallel replica, and a layer crosses each node's link about once (a node's workers are
    numbered together). The runtime's workers follow the chains; the simulator charges them."""
    chains: dict[int, list[int]] = {}
    for worker in sorted(restoring):
        for layer in restoring[worker]:
            chains.setdefault(layer, []).append(worker)
    return {layer: tuple(chain) for layer, chain in sorted(chains.items())}
