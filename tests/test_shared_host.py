"""Programs on workers sharing a host's cores (``runtime.sim.shared_host``): processor sharing, worked by hand."""

from __future__ import annotations

import pytest

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.program_check import ProgramError, timeline
from ftlab.runtime.sim.shared_host import HostCores, Reduction, run_shared, shared_ends, shared_span

END = [ins.ReduceGrads(), ins.OptimizerStep()]


def cost(_worker: int, instr: ins.Instruction) -> float:
    """One second a forward or backward, a quarter of a second on the link, nothing else."""
    if isinstance(instr, (ins.ForwardPass, ins.BackwardPass)):
        return 1.0
    return 0.25 if isinstance(instr, (ins.SendActivation, ins.SendGrad)) else 0.0


def alone(forwards: int) -> ins.Program:
    return [ins.ForwardPass(mb) for mb in range(forwards)] + END


def test_workers_that_fit_the_cores_run_at_their_profiled_speed() -> None:
    run = run_shared({0: alone(2), 1: alone(3)}, cost, cores=HostCores(2))
    assert run.reduce_at == {0: 2.0, 1: 3.0}
    assert run.compute_s == {0: 2.0, 1: 3.0}


def test_more_workers_than_cores_share_them_and_speed_up_when_one_stops() -> None:
    # Three workers on two cores: each at 2/3 speed until worker 0 has done its one second (1.5 s), then the other
    # two alone on a core each: worker 1 finishes its 2nd second at 2.0 s, worker 2 its 3rd at 3.0 s.
    run = run_shared({0: alone(1), 1: alone(2), 2: alone(3)}, cost, cores=HostCores(2))
    assert run.reduce_at == pytest.approx({0: 1.5, 1: 2.5, 2: 3.5})
    assert run.compute_s == pytest.approx({0: 1.5, 1: 2.5, 2: 3.5})


def test_measured_cores_by_load_give_each_number_computing_its_own_worth() -> None:
    # Three workers on a host whose two processes computing get 2 cores' worth and three 1.5 (switching, caches):
    # all three at half speed until worker 0 has done its second (2.0 s), then the other two at full speed: worker 1
    # has its second second done at 3.0 s, worker 2 its 3rd at 4.0 s.
    host = HostCores(2, by_load=(1.0, 2.0, 1.5))
    run = run_shared({0: alone(1), 1: alone(2), 2: alone(3)}, cost, cores=host)
    assert run.reduce_at == pytest.approx({0: 2.0, 1: 3.0, 2: 4.0})
    # Past the measured loads the last holds on a host they filled; given by hand, one alone may get more than a core
    # (faster than the costs charged) or less (other load); by the count, none gets more than a core.
    assert host.worth(5) == 1.5 and host.slowdown(5) == pytest.approx(5 / 1.5)
    assert HostCores(2, by_load=(1.1, 2.0)).slowdown(1) == pytest.approx(1 / 1.1)
    assert HostCores(2, by_load=(0.8, 1.5)).slowdown(1) == pytest.approx(1 / 0.8)
    assert HostCores(2).worth(1) == 1.0 and HostCores(2).worth(3) == 2.0
    # Work the profile did not time is slowed by the others only: three at 1.5 cores' worth, one alone at 0.8.
    assert HostCores(2, by_load=(0.8, 1.6, 1.5)).contention(3) == pytest.approx(3 / 1.5 * 0.8)


def test_past_the_measured_loads_each_process_more_gets_a_core_while_the_host_has_one() -> None:
    # Four processes measured at 3.6 cores' worth (0.9 each): on a 16-core host eight get 7.2 and twenty 14.4 (its
    # sixteen cores at 0.9); on a 2-core host the four already filled the cores, and more get no more.
    big, small = HostCores(16, by_load=(1.0, 1.9, 2.7, 3.6)), HostCores(2, by_load=(1.0, 1.9, 1.8, 1.7))
    assert big.worth(4) == 3.6 and big.worth(8) == pytest.approx(7.2) and big.worth(20) == pytest.approx(14.4)
    assert small.worth(8) == 1.7


def test_snapshot_copies_beside_workers_on_spare_cores_leave_the_computation_alone() -> None:
    # Two workers with a copy each (half a second on a core of their own): on four cores every thread has a core
    # and the forwards end at 2.0 s as without copies; on two cores four threads share them until the copies end.
    programs, copies = {0: alone(2), 1: alone(2)}, {0: 0.5, 1: 0.5}
    spare = run_shared(programs, cost, cores=HostCores(4, by_load=(1.0, 2.0)), copies=copies)
    assert spare.reduce_at == pytest.approx({0: 2.0, 1: 2.0}) and spare.copy_end == pytest.approx({0: 0.5, 1: 0.5})
    full = run_shared(programs, cost, cores=HostCores(2, by_load=(1.0, 2.0)), copies=copies)
    assert full.reduce_at == pytest.approx({0: 2.5, 1: 2.5}) and full.copy_end == pytest.approx({0: 1.0, 1: 1.0})


def test_a_pipeline_waits_for_its_messages_and_frees_the_core_while_it_waits() -> None:
    programs = {
        0: [ins.ForwardPass(0), ins.SendActivation(0, 1), ins.RecvGrad(0, 1), ins.BackwardPass(0), *END],
        1: [ins.RecvActivation(0, 0), ins.ForwardPass(0), ins.BackwardPass(0), ins.SendGrad(0, 0), *END],
        2: alone(4),  # a third worker beside them, on one core with them
    }
    run = run_shared(programs, cost, cores=HostCores(1))
    # 0 forwards beside 2 at half speed (until 2.0; 2 has 3 s left); the activation arrives at 2.25 (2 alone
    # meanwhile: 2.75 left); 1 forwards and backwards beside 2 at half speed (until 6.25; 0.75 left); the gradient
    # arrives at 6.5 (2 alone: 0.5 left); 0's backward and 2 share the core until 2 ends at 7.5; 0 ends at 8.0.
    assert run.reduce_at == pytest.approx({0: 8.0, 1: 6.25, 2: 7.5})
    assert run.phase_at[1]["backward"] == pytest.approx(4.25)  # its BackwardPass, after its forward at half speed


def test_a_message_costs_its_sender_before_it_leaves_and_its_receiver_after_it_arrives() -> None:
    programs = {
        0: [ins.ForwardPass(0), ins.SendActivation(0, 1), ins.RecvGrad(0, 1), ins.BackwardPass(0), *END],
        1: [ins.RecvActivation(0, 0), ins.ForwardPass(0), ins.BackwardPass(0), ins.SendGrad(0, 0), *END],
    }
    run = run_shared(programs, cost, cores=HostCores(2), message_cpu_s=1.0)
    # 0 forwards (1.0), handles the send (1.5); it arrives at 1.75, 1 handles it (2.25), forwards and backwards
    # (4.25), handles its send (4.75); the gradient arrives at 5.0, 0 handles it (5.5) and backwards (6.5).
    assert run.reduce_at == pytest.approx({0: 6.5, 1: 4.75})
    assert run.compute_s == pytest.approx({0: 2.0, 1: 2.0})  # handling a message is no forward or backward


def test_a_messages_cpu_shares_the_cores_with_the_computing_workers() -> None:
    programs = {
        0: [ins.ForwardPass(0), ins.SendActivation(0, 1), *END],
        1: [ins.RecvActivation(0, 0), ins.ForwardPass(0), *END],
        2: alone(3),
    }
    run = run_shared(programs, cost, cores=HostCores(1), message_cpu_s=1.0)
    # One core: 0 forwards beside 2 at half speed (until 2.0; 2 has 2 s left), then its half of the message beside
    # 2 (sent at 3.0, arrives at 3.25; 2 has 1.5 left, then 1.25 alone); 1's half beside 2 until 4.25 (2: 0.75 left);
    # 1's forward beside 2 until 2 ends at 5.75, 1 alone to 6.0.
    assert run.reduce_at == pytest.approx({0: 3.0, 1: 6.0, 2: 5.75})


def test_a_stage_between_two_others_pays_one_share_of_a_message_per_pass() -> None:
    # Timed per instruction, the passes of a stage between two others took no more CPU beyond their charge than an
    # end stage's, with twice the messages: its share per message is halved to one per pass.
    programs = {
        0: [ins.ForwardPass(0), ins.SendActivation(0, 1), *END],
        1: [ins.RecvActivation(0, 0), ins.ForwardPass(0), ins.SendActivation(0, 2), *END],
        2: [ins.RecvActivation(0, 1), ins.ForwardPass(0), *END],
    }
    run = run_shared(programs, cost, cores=HostCores(3), message_cpu_s=1.0)
    # A core each: 0 forwards (1.0) and sends (0.5: 1.5, arrives at 1.75); 1 receives (0.25: 2.0), forwards (3.0)
    # and sends (0.25: 3.25, arrives at 3.5); 2 receives (0.5: 4.0) and forwards (5.0).
    assert run.reduce_at == pytest.approx({0: 1.5, 1: 3.25, 2: 5.0})


def test_processes_started_at_once_share_the_cores_until_the_last_is_done() -> None:
    cores = HostCores(2, by_load=(1.0, 2.0, 1.5))
    assert shared_span([1.0, 1.0, 1.0], cores) == pytest.approx(3 / 1.5)  # three at once get 1.5 cores' worth
    # The two short ones are done at 2.0 (1 s each at half speed); the long one then runs alone: 3 s more.
    assert shared_span([1.0, 1.0, 4.0], cores) == pytest.approx(5.0)
    assert shared_ends([4.0, 1.0, 0.0, 1.0], cores) == pytest.approx([5.0, 2.0, 0.0, 2.0])  # in the order given
    assert shared_span([], cores) == 0.0


def test_with_a_core_each_it_agrees_with_the_checkers_machine() -> None:
    programs = {
        0: [ins.ForwardPass(0), ins.SendActivation(0, 1), ins.ForwardPass(1), ins.SendActivation(1, 1),
            ins.RecvGrad(0, 1), ins.BackwardPass(0), ins.RecvGrad(1, 1), ins.BackwardPass(1), *END],
        1: [ins.RecvActivation(0, 0), ins.ForwardPass(0), ins.BackwardPass(0), ins.SendGrad(0, 0),
            ins.RecvActivation(1, 0), ins.ForwardPass(1), ins.BackwardPass(1), ins.SendGrad(1, 0), *END],
    }  # fmt: skip
    machine = {e.worker: e.start for e in timeline(programs, cost) if isinstance(e.instruction, ins.ReduceGrads)}
    assert run_shared(programs, cost, cores=HostCores(2)).reduce_at == pytest.approx(machine)


def test_replicas_reduce_once_all_have_arrived_and_share_the_cores_with_the_computing_workers() -> None:
    # Workers 0 and 1 replicate layers (a one-second all-reduce each), worker 2 holds its own (four seconds of
    # work). On two cores: all three compute at 2/3 speed until 0 has done its second (1.5 s); 0 waits for 1. Then
    # 1 and 2 run at full speed until 1 arrives (2.5 s; 2 has 2 s left). 0 and 1 reduce beside 2, all three at 2/3
    # speed, until the reductions end (4.0 s; 2 has 1 s left), and 2 finishes alone (5.0 s).
    reductions = {0: Reduction(frozenset({1}), 1.0), 1: Reduction(frozenset({0}), 1.0), 2: Reduction(frozenset(), 0.0)}
    run = run_shared({0: alone(1), 1: alone(2), 2: alone(4)}, cost, cores=HostCores(2), reductions=reductions)
    assert run.reduce_at == pytest.approx({0: 1.5, 1: 2.5, 2: 5.0})
    assert run.reduce_end == pytest.approx({0: 4.0, 1: 4.0, 2: 5.0})
    assert run.compute_s == pytest.approx({0: 1.5, 1: 2.5, 2: 5.0}), "a reduction is not compute"


def test_without_reductions_a_worker_leaves_its_reduce_as_it_arrives() -> None:
    run = run_shared({0: alone(1), 1: alone(2)}, cost, cores=HostCores(2))
    assert run.reduce_end == run.reduce_at == {0: 1.0, 1: 2.0}


def test_a_snapshot_copy_is_one_more_thread_on_the_cores() -> None:
    # Two workers of two seconds and worker 0's copy of one second on two cores: three threads at 2/3 speed until
    # the copy is done (1.5 s, each worker a second in), then each worker alone on a core for its second second.
    run = run_shared({0: alone(2), 1: alone(2)}, cost, cores=HostCores(2), copies={0: 1.0})
    assert run.copy_end == pytest.approx({0: 1.5})
    assert run.reduce_at == pytest.approx({0: 2.5, 1: 2.5})
    # A copy that outlasts the computation runs alone at the end, on a core of its own.
    run = run_shared({0: alone(1)}, cost, cores=HostCores(1), copies={0: 2.0})
    assert run.reduce_at == pytest.approx({0: 2.0}) and run.copy_end == pytest.approx({0: 3.0})


def test_a_receive_without_its_send_is_a_deadlock() -> None:
    programs = {0: [ins.RecvActivation(0, 1), *END], 1: alone(1)}
    with pytest.raises(ProgramError, match="worker 0 waits"):
        run_shared(programs, cost, cores=HostCores(1))
