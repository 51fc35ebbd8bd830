"""The program checker on hand-written programs: one correct schedule and one broken in each way it must catch."""

from __future__ import annotations

import pytest

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.plan import grid_plan
from ftlab.runtime.core.program_check import ProgramError, check_programs, simulate, timeline
from ftlab.runtime.core.scheduler import one_f_one_b

END = [ins.ReduceGrads(), ins.OptimizerStep()]
PLAN = grid_plan([0, 1], stages=2, num_layers=4, global_batch=4, micro_batch=1)  # workers 0 -> 1, 4 micro-batches


def first_stage(order: str, peer: int = 1) -> ins.Program:
    """Stage-0 program from a compact order, e.g. "F0 F1 B0": F loads and forwards, B receives and backwards."""
    program: ins.Program = []
    for token in order.split():
        mb = int(token[1:])
        if token[0] == "F":
            program += [ins.LoadMicroBatch(mb), ins.ForwardPass(mb), ins.SendActivation(mb, peer)]
        else:
            program += [ins.RecvGrad(mb, peer), ins.BackwardPass(mb)]
    return program + END


def last_stage(mbs: list[int], peer: int = 0) -> ins.Program:
    program: ins.Program = []
    for mb in mbs:
        program += [ins.LoadMicroBatch(mb), ins.RecvActivation(mb, peer), ins.ForwardPass(mb),
                    ins.BackwardPass(mb), ins.SendGrad(mb, peer)]
    return program + END


def one_f_one_b_by_hand() -> dict[int, ins.Program]:
    return {0: first_stage("F0 F1 B0 F2 B1 F3 B2 B3"), 1: last_stage([0, 1, 2, 3])}


def durations(_worker: int, instr: object) -> float:
    return {ins.ForwardPass: 1.0, ins.BackwardPass: 2.0}.get(type(instr), 0.0)


def test_correct_two_stage_1f1b_passes_and_takes_the_textbook_time() -> None:
    programs = one_f_one_b_by_hand()
    check_programs(PLAN, programs)
    # (micro-batches + stages - 1) x (forward + backward) = 5 x 3.
    assert simulate(programs, durations, PLAN) == 15.0


def test_timeline_respects_every_dependency() -> None:
    events = {(e.worker, e.index): e for e in timeline(one_f_one_b_by_hand(), durations, PLAN)}
    forward_last = events[(1, 2)]  # worker 1's ForwardPass(0) starts after worker 0's ForwardPass(0) ends
    assert forward_last.start == events[(0, 1)].end == 1.0
    backward_first = events[(0, 7)]  # worker 0's BackwardPass(0) waits for worker 1's gradient
    assert isinstance(backward_first.instruction, ins.BackwardPass)
    assert backward_first.start == events[(1, 3)].end == 4.0


def test_transfer_time_delays_the_receiver() -> None:
    def with_link(worker: int, instr: object) -> float:
        return 0.5 if isinstance(instr, (ins.SendActivation, ins.SendGrad)) else durations(worker, instr)

    # Worked out by hand for F = 1, B = 2 and 0.5 per transfer (15 without transfer time).
    assert simulate(one_f_one_b_by_hand(), with_link, PLAN) == 17.0


def test_decoupled_backward_passes() -> None:
    programs = one_f_one_b_by_hand()
    programs[1] = []
    for mb in range(4):
        programs[1] += [ins.LoadMicroBatch(mb), ins.RecvActivation(mb, 0), ins.ForwardPass(mb),
                        ins.BackwardInput(mb), ins.SendGrad(mb, 0)]
    programs[1] += [ins.BackwardWeight(mb) for mb in range(4)] + END
    check_programs(PLAN, programs)


def test_both_stages_receiving_first_deadlocks() -> None:
    programs = {0: [ins.RecvGrad(0, 1), *first_stage("F0 F1 F2 F3 B1 B2 B3")], 1: last_stage([0, 1, 2, 3])}
    programs[1].insert(0, ins.RecvGrad(0, 0))
    with pytest.raises(ProgramError, match="deadlock") as error:
        check_programs(PLAN, programs)
    assert "worker 0 blocks at instruction 0 RecvGrad(mb=0, peer=1)" in str(error.value)
    assert "worker 1 blocks at instruction 0 RecvGrad(mb=0, peer=0)" in str(error.value)


def test_micro_batch_processed_twice() -> None:
    programs = one_f_one_b_by_hand()
    programs[1] = last_stage([0, 1, 2, 3])
    programs[1][-2:-2] = [ins.ForwardPass(3)]
    with pytest.raises(ProgramError, match=r"runs forward of micro-batch 3 a second time"):
        check_programs(PLAN, programs)


def test_micro_batch_sent_twice() -> None:
    programs = {0: first_stage("F0 F1 B0 F2 B1 F3 B2 B3"), 1: last_stage([0, 1, 2, 3])}
    programs[0][2:2] = [ins.SendActivation(0, 1)]
    with pytest.raises(ProgramError, match="sends the same activation to worker 1 twice"):
        check_programs(PLAN, programs)


def test_micro_batch_on_another_pipelines_worker() -> None:
    plan = grid_plan([0, 1, 2, 3], stages=2, num_layers=4, global_batch=4, micro_batch=1)  # 0 -> 1: mbs 0 and 2
    programs = {0: first_stage("F0 F2 F3 B0 B2 B3"), 1: last_stage([0, 2, 3]), 2: first_stage("F1 B1", peer=3),
                3: last_stage([1], peer=2)}
    with pytest.raises(ProgramError, match=r"micro-batch 3 belongs to the pipeline of workers \(2, 3\)"):
        check_programs(plan, programs)


def test_missing_backward() -> None:
    programs = {0: first_stage("F0 F1 B0 F2 B1 F3 B2"), 1: last_stage([0, 1, 2, 3])}
    with pytest.raises(ProgramError, match=r"reduces gradients before the weight gradients of micro-batches \[3\]"):
        check_programs(PLAN, programs)


def test_micro_batch_nobody_processes() -> None:
    programs = {0: first_stage("F0 F1 B0 F2 B1 B2"), 1: last_stage([0, 1, 2])}
    with pytest.raises(ProgramError) as error:
        check_programs(PLAN, programs)
    message = str(error.value)
    for what in ("forward", "backward", "weight-gradient"):
        assert f"micro-batch 3 never runs {what} through layers [0, 1, 2, 3]" in message


def test_unmatched_send() -> None:
    programs = one_f_one_b_by_hand()
    programs[0].insert(0, ins.SendLayer(1, 1))
    with pytest.raises(ProgramError, match="worker 0 sends a layer for layer 1 to worker 1, which never receives it"):
        check_programs(PLAN, programs)
    programs[1].insert(3, ins.RecvLayer(1, 0))
    check_programs(PLAN, programs)


def test_forward_before_its_activation_arrives() -> None:
    programs = one_f_one_b_by_hand()
    programs[1][1], programs[1][2] = programs[1][2], programs[1][1]  # ForwardPass(0) before RecvActivation(0)
    with pytest.raises(ProgramError, match="runs before its input activation was received"):
        check_programs(PLAN, programs)


def test_weight_gradient_needs_its_input_gradient() -> None:
    programs = one_f_one_b_by_hand()
    programs[1][3] = ins.BackwardWeight(0)
    with pytest.raises(ProgramError, match="needs exactly one BackwardInput"):
        check_programs(PLAN, programs)


def test_programs_must_end_with_reduce_and_step() -> None:
    programs = one_f_one_b_by_hand()
    programs[0] = programs[0][:-1]
    with pytest.raises(ProgramError, match="must end with ReduceGrads\\(\\), OptimizerStep\\(\\)"):
        check_programs(PLAN, programs)


def test_reduce_grads_waits_for_the_replicas_of_its_layers_only() -> None:
    plan = grid_plan([0, 1, 2, 3], stages=2, num_layers=4, global_batch=4, micro_batch=1)

    def worker_0_slow(worker: int, instr: object) -> float:
        slow = worker == 0 and isinstance(instr, ins.BackwardPass)
        return 5.0 if slow else durations(worker, instr)

    events = timeline(one_f_one_b(plan), worker_0_slow, plan)
    reduce = {e.worker: e for e in events if isinstance(e.instruction, ins.ReduceGrads)}
    arrived = {w: max(e.end for e in events if e.worker == w and e.index < reduce[w].index) for w in reduce}
    # Stage-0 replicas (0 and 2) reduce together once the slow worker 0 arrives; worker 2 waits for it.
    assert reduce[0].start == reduce[2].start == arrived[0] > arrived[2]
    # Stage-1 replicas (1 and 3) reduce earlier: there is no barrier across stages (staggered optimizer steps).
    assert reduce[1].start == reduce[3].start == max(arrived[1], arrived[3]) < reduce[0].start


@pytest.mark.parametrize(("stages", "replicas", "micro"), [(2, 1, 4), (3, 2, 6), (4, 2, 8), (4, 1, 2)])
def test_default_1f1b_scheduler_passes(stages: int, replicas: int, micro: int) -> None:
    plan = grid_plan(list(range(stages * replicas)), stages, 2 * stages, micro, 1)
    check_programs(plan, one_f_one_b(plan))


def test_default_scheduler_sends_as_soon_as_the_pass_is_done() -> None:
    programs = one_f_one_b(PLAN)
    for program in programs.values():
        for before, send in zip(program, program[1:]):
            if isinstance(send, ins.SendActivation):
                assert isinstance(before, ins.ForwardPass) and before.microbatch == send.microbatch
            if isinstance(send, ins.SendGrad):
                assert isinstance(before, ins.BackwardPass) and before.microbatch == send.microbatch

    def with_link(worker: int, instr: object) -> float:
        return 0.5 if isinstance(instr, (ins.SendActivation, ins.SendGrad)) else durations(worker, instr)

    # As the textbook program above: DeepSpeed's own order, sending one step late, takes 19 (a round trip per
    # micro-batch on the last stage).
    assert simulate(programs, with_link, PLAN) == 17.0
