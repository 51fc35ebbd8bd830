"""The default scheduler: 1F1B programs for every pipeline of a Plan, from DeepSpeed's ``TrainSchedule``.

DeepSpeed's schedule speaks of buffer slots and of "the previous/next stage"; the runtime needs global micro-batch
ids and explicit peer workers. We replay DeepSpeed's own step-to-micro-batch mapping for each step, so the order of
instructions is DeepSpeed's, and translate each instruction.

One change of order: every send moves up to just after the pass that computes what it sends. DeepSpeed sends one
schedule step late (with the next receive) because its sends block until the peer receives; the runtime's sends
return at once (``runtime.comm``), so sending at once lets the peer start sooner and never blocks anyone. Without
it the last stage waits a whole round trip (its gradient out, the next activation back) before each forward.
"""

from __future__ import annotations

from deepspeed.runtime.pipe import schedule as ds

from runtime import instructions as ins
from runtime.plan import Pipeline, Plan

# DeepSpeed instructions that refer to the micro-batch of the *previous* schedule step (sent one step late).
_USES_PREVIOUS = (ds.SendGrad, ds.SendActivation)


def one_f_one_b(plan: Plan) -> dict[int, ins.Program]:
    programs: dict[int, ins.Program] = {}
    for pipeline in plan.pipelines:
        for stage_id in range(len(pipeline.stages)):
            programs[pipeline.stages[stage_id].worker] = _stage_program(pipeline, stage_id)
    return programs


def _stage_program(pipeline: Pipeline, stage_id: int) -> ins.Program:
    stages = len(pipeline.stages)
    schedule = ds.TrainSchedule(micro_batches=len(pipeline.microbatches), stages=stages, stage_id=stage_id)
    prev_peer = pipeline.stages[stage_id - 1].worker if stage_id > 0 else None
    next_peer = pipeline.stages[stage_id + 1].worker if stage_id + 1 < stages else None
    program: ins.Program = []
    previous_local = -1
    for step_id, commands in enumerate(schedule.steps()):
        local, _ = schedule._step_to_micro_batch(step_id)
        for command in commands:
            index = previous_local if isinstance(command, _USES_PREVIOUS) else local
            translated = _translate(command, pipeline, index, prev_peer, next_peer)
            if translated is not None:
                program.append(translated)
        previous_local = local
    return _send_eagerly(program)


def _send_eagerly(program: ins.Program) -> ins.Program:
    sends = {(type(i), i.microbatch): i for i in program if isinstance(i, (ins.SendActivation, ins.SendGrad))}
    produces = {ins.ForwardPass: ins.SendActivation, ins.BackwardPass: ins.SendGrad}
    eager: ins.Program = []
    for instruction in program:
        if isinstance(instruction, (ins.SendActivation, ins.SendGrad)):
            continue
        eager.append(instruction)
        send_type = produces.get(type(instruction))
        if send_type is not None and (send_type, instruction.microbatch) in sends:
            eager.append(sends.pop((send_type, instruction.microbatch)))
    assert not sends, f"sends with no pass computing what they send: {sends}"
    return eager


def _translate(
    command: ds.PipeInstruction, pipeline: Pipeline, local: int, prev_peer: int | None, next_peer: int | None
) -> ds.PipeInstruction | None:
    if isinstance(command, ds.ReduceTiedGrads):
        return None  # embeddings are untied (runtime.model), so there is nothing to reduce across stages
    if isinstance(command, ds.ReduceGrads):
        return ins.ReduceGrads()
    if isinstance(command, ds.OptimizerStep):
        return ins.OptimizerStep()
    mb = pipeline.microbatches[local]
    simple = {ds.LoadMicroBatch: ins.LoadMicroBatch, ds.ForwardPass: ins.ForwardPass, ds.BackwardPass: ins.BackwardPass}
    for ds_type, ours in simple.items():
        if isinstance(command, ds_type):
            return ours(mb)
    towards_next = {ds.SendActivation: ins.SendActivation, ds.RecvGrad: ins.RecvGrad}
    towards_prev = {ds.RecvActivation: ins.RecvActivation, ds.SendGrad: ins.SendGrad}
    for ds_type, ours in towards_next.items():
        if isinstance(command, ds_type):
            assert next_peer is not None, command
            return ours(mb, next_peer)
    for ds_type, ours in towards_prev.items():
        if isinstance(command, ds_type):
            assert prev_peer is not None, command
            return ours(mb, prev_peer)
    raise TypeError(f"no translation for DeepSpeed instruction {command!r}")
