"""The default scheduler is DeepSpeed's 1F1B, instruction for instruction, with sends moved up to their pass.

DeepSpeed's ``TrainSchedule`` is the reference: for many pipeline shapes its instruction stream is translated to
ours (buffer slots to micro-batch ids, previous/next stage to peer workers) and must equal what
``runtime.core.scheduler`` generates without importing DeepSpeed.
"""

from __future__ import annotations

import pytest

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.contract import LayerTransfer
from ftlab.runtime.core.plan import Pipeline, Stage
from ftlab.runtime.core.program_check import check_programs
from ftlab.runtime.core.scheduler import one_f_one_b, stage_program, transfer_programs

ds = pytest.importorskip("deepspeed.runtime.pipe.schedule")

# DeepSpeed instructions that refer to the micro-batch of the *previous* schedule step (its sends go one step late).
_USES_PREVIOUS = (ds.SendGrad, ds.SendActivation)


def deepspeed_program(pipeline: Pipeline, stage_id: int) -> ins.Program:
    """DeepSpeed's TrainSchedule for this stage, in our instructions, each send just after the pass it sends."""
    stages = len(pipeline.stages)
    schedule = ds.TrainSchedule(micro_batches=len(pipeline.microbatches), stages=stages, stage_id=stage_id)
    prev_peer = pipeline.stages[stage_id - 1].worker if stage_id > 0 else None
    next_peer = pipeline.stages[stage_id + 1].worker if stage_id + 1 < stages else None
    translated: ins.Program = []
    previous = -1
    for step_id, commands in enumerate(schedule.steps()):
        local, _ = schedule._step_to_micro_batch(step_id)
        for command in commands:
            if isinstance(command, ds.ReduceTiedGrads):
                continue
            if isinstance(command, ds.ReduceGrads):
                translated.append(ins.ReduceGrads())
                continue
            if isinstance(command, ds.OptimizerStep):
                translated.append(ins.OptimizerStep())
                continue
            mb = pipeline.microbatches[previous if isinstance(command, _USES_PREVIOUS) else local]
            kinds = {
                ds.LoadMicroBatch: lambda: ins.LoadMicroBatch(mb),
                ds.ForwardPass: lambda: ins.ForwardPass(mb),
                ds.BackwardPass: lambda: ins.BackwardPass(mb),
                ds.SendActivation: lambda: ins.SendActivation(mb, next_peer),
                ds.RecvGrad: lambda: ins.RecvGrad(mb, next_peer),
                ds.RecvActivation: lambda: ins.RecvActivation(mb, prev_peer),
                ds.SendGrad: lambda: ins.SendGrad(mb, prev_peer),
            }
            translated.append(kinds[type(command)]())
        previous = local
    # Sends move up to just after the pass that computes them.
    sends = {(type(i), i.microbatch): i for i in translated if isinstance(i, (ins.SendActivation, ins.SendGrad))}
    produces = {ins.ForwardPass: ins.SendActivation, ins.BackwardPass: ins.SendGrad}
    eager: ins.Program = []
    for instruction in translated:
        if isinstance(instruction, (ins.SendActivation, ins.SendGrad)):
            continue
        eager.append(instruction)
        send = sends.pop((produces.get(type(instruction)), getattr(instruction, "microbatch", None)), None)
        if send is not None:
            eager.append(send)
    assert not sends
    return eager


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8, 13])
def test_every_stage_program_is_deepspeeds_1f1b(stages: int, microbatches: int) -> None:
    workers = [10 + 3 * s for s in range(stages)]  # worker ids unlike stage ids, so a mix-up shows
    pipeline = Pipeline(tuple(Stage(w, s, s + 1) for s, w in enumerate(workers)), tuple(range(7, 7 + microbatches)))
    for stage_id in range(stages):
        assert stage_program(pipeline, stage_id) == deepspeed_program(pipeline, stage_id), (stages, microbatches, stage_id)


def test_layer_transfers_send_first_and_never_deadlock() -> None:
    transfers = [LayerTransfer(1, 0, 2), LayerTransfer(2, 2, 0), LayerTransfer(3, 0, 2)]
    programs = transfer_programs(transfers)
    assert programs == {
        0: [ins.SendLayer(1, 2), ins.SendLayer(3, 2), ins.RecvLayer(2, 2)],
        2: [ins.SendLayer(2, 0), ins.RecvLayer(1, 0), ins.RecvLayer(3, 0)],
    }


def test_one_f_one_b_programs_pass_the_checker_on_a_grid() -> None:
    from ftlab.runtime.core.plan import grid_plan

    plan = grid_plan(list(range(6)), stages=3, num_layers=8, global_batch=16, micro_batch=2)
    check_programs(plan, one_f_one_b(plan))
