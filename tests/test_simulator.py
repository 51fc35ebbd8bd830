"""The simulator: the real coordinator, policies and programs on a simulated cluster.

- The same config gives the same simulated run, event for event; another fault seed another one.
- For a failure sequence, the simulated recovery decisions (plans, transfers, restarts) equal the ones the real
  runtime took for it.
- A plan's simulated iteration equals the program checker's timeline of all its programs (the component split is
  exact); programs the checker rejects are rejected by the simulator.
- Faults fire in simulated time: trace replay at the trace's times, a hang found after the heartbeat timeout, a
  phase fault inside its step.
- A simulated job is an MLflow run like a real one (tag backend=sim), and bad input is refused with a message.
- REFT's snapshots run beside training and a restart restores from memory, from a peer or from parity, as on the
  runtime; a node's memory is lost with it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from ftlab.experiments import job as job_module
from ftlab.experiments.config import JobConfig
from ftlab.experiments.job import JobResult, components, compose_config, everyone, job_factory
from ftlab.experiments.simulate import simulate, simulate_job
from ftlab.faults.schedules import ClusterShape, FaultConfigError, FaultsConfig, build_schedule
from ftlab.policies.none.policy import NoRecovery
from ftlab.runtime.control import events as ev
from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.config import ClusterConfig, SimConfig
from ftlab.runtime.core.contract import ConfigError, Decision, Job, MemorySource, Protection, TakeSnapshot
from ftlab.runtime.control.coordinator import first_holders
from ftlab.runtime.core.costs import CostModel, ModelProfile
from ftlab.runtime.core.plan import Pipeline, Plan, Stage, grid_plan
from ftlab.runtime.processes.profiler import analytic_profile
from ftlab.runtime.core.program_check import ProgramError, timeline
from ftlab.runtime.core.scheduler import one_f_one_b
from ftlab.runtime.sim.shared_host import HostCores
from ftlab.runtime.sim.backend import SimBackend
from ftlab.runtime.sim.machines import DeviceMachine, SharedHostMachine
from ftlab.runtime.sim.timing import IterationTimer
from ftlab.runtime.core.snapshot_layout import groups_of
from tests.support import a100_profile, snapshot_history

STEPS = 10


def analytic(cfg: JobConfig) -> tuple[ModelProfile, dict]:
    """Real and simulated jobs plan from the same fixed profile (a measured one differs run to run here)."""
    return a100_profile(cfg)


@pytest.fixture(autouse=True)
def fixed_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every job here plans (and is simulated) with it: no test waits for this machine to be measured."""
    monkeypatch.setattr(job_module, "job_profile", analytic)


def sim_cfg(job_overrides: list[str], *overrides: str) -> JobConfig:
    return OmegaConf.to_object(compose_config([*job_overrides, "mode=simulate", *overrides]))


OOBLECK = ["policy=oobleck", "cluster.nodes=6", "cluster.device_memory_gb=0.04", f"train.steps={STEPS}"]
RESTART = ["policy=checkpoint_restart", "protection=storage", "protection.every=3", f"train.steps={STEPS}"]
REFT = ["policy=checkpoint_restart", "protection=reft", "protection.interval=1", f"protection.flush_every={STEPS}",
        f"train.steps={STEPS}"]  # fmt: skip


def kills(*events: str) -> list[str]:
    return ["faults=explicit", f"faults.events=[{', '.join(events)}]"]


def logged(result: JobResult) -> list[tuple]:
    return [(type(e).__name__, e.at, tuple(sorted(e.fields().items(), key=str))) for e in result.events]


# -- determinism -----------------------------------------------------------------------------------------------
def test_the_same_config_simulates_the_same_run_and_another_seed_another(job_overrides: list[str]) -> None:
    faults = ["faults=exponential", "faults.mtbf_steps=null", "faults.mtbf_s=2", "faults.max_failures=3", "faults.seed=1"]
    base = [*OOBLECK, "train.steps=100000", "sim.horizon_s=30", "cluster.nodes=8", "policy.fault_threshold=2", *faults]
    first = simulate(sim_cfg(job_overrides, *base)).result
    again = simulate(sim_cfg(job_overrides, *base)).result
    other = simulate(sim_cfg(job_overrides, *base[:-1], "faults.seed=2")).result
    assert [(s.step, s.at, s.iter_s) for s in first.steps] == [(s.step, s.at, s.iter_s) for s in again.steps]
    assert logged(first) == logged(again) and first.plans == again.plans
    assert len([e for e in first.events if isinstance(e, ev.FaultInjected)]) == 3
    assert logged(first) != logged(other)


# -- the same decisions as the real runtime --------------------------------------------------------------------
SCENARIOS = {
    "oobleck": [*OOBLECK, *kills("{kind: node, node: 2, at_step: 3, phase: backward}", "{kind: node, node: 4, at_step: 6}")],
    "checkpoint_restart": [*RESTART, *kills("{kind: node, node: 1, at_step: 5, phase: reduce}")],
    "reft": [*REFT, *kills("{kind: node, node: 1, at_step: 5, phase: backward}")],
}


def decisions(result: JobResult) -> list[tuple]:
    return [
        (e.outcome, e.committed_step, e.resume_step, e.generation, e.transfers, e.restore)
        for e in result.events if isinstance(e, ev.Decided)
    ]  # fmt: skip


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_simulated_recovery_decisions_equal_the_real_runtimes(
    scenario: str, run, job_overrides: list[str]  # noqa: ANN001
) -> None:
    real = run(*SCENARIOS[scenario])
    simulated = simulate(sim_cfg(job_overrides, *SCENARIOS[scenario])).result
    assert len(real.plans) > 1 and simulated.plans == real.plans
    assert decisions(simulated) == decisions(real)
    assert [s.step for s in simulated.steps] == [s.step for s in real.steps]
    assert [(f.kind, f.lost_steps) for f in simulated.faults] == [(f.kind, f.lost_steps) for f in real.faults]


# -- programs ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["oobleck-7", "heterogeneous-3+2"])
def test_the_component_split_times_a_plan_as_the_whole_timeline_does(job_overrides: list[str], layout: str) -> None:
    shape = {
        "oobleck-7": ["policy=oobleck", "cluster.nodes=7", "cluster.device_memory_gb=0.04"],
        "heterogeneous-3+2": ["cluster.nodes=5", "policy._target_=tests.support.HeterogeneousLayout"],
    }[layout]
    cfg = OmegaConf.to_object(compose_config([*job_overrides, *shape, "cluster.device=A100-40GB"]))
    job = job_factory(cfg, None)(everyone(cfg))
    policy, protection = components(cfg)
    made = policy.plan(job, protection)
    assert len({(len(p.stages), len(p.microbatches)) for p in made.plan.pipelines}) > 1, "want unequal pipelines"
    whole = timeline(made.programs, job.costs.durations(made.plan), made.plan)
    ready = max(e.end for e in whole if isinstance(e.instruction, ins.ReduceGrads))
    by_shape = IterationTimer(job.costs).time(made.plan, made.programs)  # one pipeline of each shape is read
    read_in_full = IterationTimer(job.costs).time(made.plan, dict(made.programs))
    assert by_shape.ready_s == pytest.approx(ready, rel=1e-12)
    assert read_in_full.ready_s == pytest.approx(ready, rel=1e-12)


class DropsAMicroBatch(NoRecovery):
    """A policy whose programs leave out the last micro-batch's backward on the last stage."""

    def plan(self, job: Job, protection: Protection) -> Decision:
        made = super().plan(job, protection)
        programs = {w: list(p) for w, p in made.programs.items()}
        last = made.plan.pipelines[0].stages[-1].worker
        programs[last] = [i for i in programs[last] if not (isinstance(i, ins.BackwardPass) and i.microbatch == 0)]
        return Decision(made.plan, programs, reason="broken")


def test_programs_the_checker_rejects_are_rejected(job_overrides: list[str]) -> None:
    cfg = sim_cfg(job_overrides, f"policy._target_={__name__}.DropsAMicroBatch")
    with pytest.raises(ProgramError):
        simulate(cfg)


# -- faults in simulated time ------------------------------------------------------------------------------------
def injected(result: JobResult) -> list[ev.FaultInjected]:
    return [e for e in result.events if isinstance(e, ev.FaultInjected)]


def test_a_trace_replays_at_its_own_times(job_overrides: list[str]) -> None:
    faults = ["faults=trace", "faults.trace=p3", "faults.trace_s_per_step=null", "faults.time_compression=120", "faults.max_failures=4"]
    cfg = sim_cfg(job_overrides, *RESTART, "cluster.nodes=8", "train.steps=100000", "sim.horizon_s=400", *faults)
    simulated = simulate(cfg)
    result = simulated.result
    schedule = build_schedule(cfg.faults, ClusterShape(8, 1))
    started = next(e.at for e in result.events if isinstance(e, ev.PlanConfigured))
    fired = [(e.fault_kind, e.fault["node"], e.at) for e in injected(result)]
    expected = [(f.kind, f.node, pytest.approx(started + f.at_time_s)) for f in schedule if f.at_time_s < 400]
    assert fired == expected[: len(fired)] and len(fired) >= 4
    assert simulated.horizon_reached and result.steps[-1].at <= 400 + started


def test_a_hang_is_found_after_the_heartbeat_timeout(job_overrides: list[str]) -> None:
    cfg = sim_cfg(job_overrides, *RESTART, "cluster.heartbeat_timeout_s=7", *kills("{kind: hang, node: 2, worker: 0, at_step: 4}"))
    result = simulate(cfg).result
    (fault,) = result.faults
    assert fault.detect_s == pytest.approx(7.0)
    assert any(isinstance(e, ev.HangDetected) and e.worker == 2 for e in result.events)
    assert sorted({s.step for s in result.steps}) == list(range(STEPS))


def test_a_stall_shorter_than_the_heartbeat_timeout_costs_its_length_and_fences_no_one(job_overrides: list[str]) -> None:
    overrides = [*job_overrides, *RESTART, "cluster.heartbeat_timeout_s=7"]
    plain = simulate(sim_cfg(overrides)).result
    stalled = simulate(sim_cfg(overrides, *kills("{kind: hang, node: 2, worker: 0, at_step: 4, for_s: 5}"))).result
    assert not stalled.faults[0].lost_steps and not any(isinstance(e, ev.HangDetected) for e in stalled.events)
    assert [s.step for s in stalled.steps] == [s.step for s in plain.steps] == list(range(STEPS))
    assert stalled.steps[4].iter_s == pytest.approx(plain.steps[4].iter_s + 5.0, rel=0.05)


def test_oobleck_that_cannot_recover_in_place_before_its_first_checkpoint_restarts_from_scratch(job_overrides: list[str]) -> None:
    # Four two-node pipelines lose every second stage at step 2 (f = 1): no replica of those layers survives, and the
    # first checkpoint (step 3) is not written yet. A protection that keeps state restarts the four survivors from
    # step 0; protection=none stops.
    job = [*OOBLECK, "cluster.nodes=8", *kills(*(f"{{kind: node, node: {n}, at_step: 2}}" for n in (1, 3, 5, 7)))]
    result = simulate(sim_cfg(job_overrides, *job, "protection=storage", "protection.every=3")).result
    (restarted,) = [e for e in result.events if isinstance(e, ev.Decided)]
    assert restarted.outcome == "restart" and restarted.resume_step == 0 and "scratch (nothing saved" in restarted.reason
    assert [p.workers for p in result.plans[-1].pipelines] == [(0, 2), (4, 6)]
    assert sorted({s.step for s in result.steps}) == list(range(STEPS))
    stopped = simulate(sim_cfg(job_overrides, *job, "protection=none")).result.stopped
    assert stopped is not None and "keeps no saved state" in stopped


def test_a_phase_fault_strikes_inside_its_step(job_overrides: list[str]) -> None:
    at = {}
    for phase in ("forward", "backward", "reduce"):
        cfg = sim_cfg(job_overrides, *OOBLECK, *kills(f"{{kind: node, node: 2, at_step: 4, phase: {phase}}}"))
        result = simulate(cfg).result
        begins = [s for s in result.steps if s.step == 3][0].at  # step 4 begins as step 3 commits
        (fault,) = injected(result)
        assert begins <= fault.at < begins + result.steps[0].iter_s, phase
        at[phase] = fault.at
    assert at["forward"] < at["backward"] < at["reduce"]


def test_a_phase_fault_on_a_worker_that_never_enters_the_phase_says_why(job_overrides: list[str]) -> None:
    # A 2 x 2 grid: each layer's checkpoint is written by its first holder, the first pipeline's workers.
    fired = {}
    for node in (0, 3):
        fault = f"{{kind: node, node: {node}, at_step: 6, phase: checkpoint}}"
        cfg = sim_cfg(job_overrides, *RESTART, "train.stages=2", *kills(fault))
        result = simulate(cfg).result
        fired[node] = (injected(result), [e.reason for e in result.events if isinstance(e, ev.FaultUnfired)])
    assert 3 not in first_holders(result.plans[0]) and 0 in first_holders(result.plans[0])
    assert fired[0][0] and not fired[0][1]
    (reason,) = fired[3][1]
    assert not fired[3][0]
    assert "ran step 6, but node 3 never entered its checkpoint phase" in reason and "first holder" in reason


# -- the record ------------------------------------------------------------------------------------------------
def test_a_simulated_job_is_an_mlflow_run_like_a_real_one(job_overrides: list[str], tmp_path: Path) -> None:
    result = simulate_job(compose_config([*job_overrides, "mode=simulate", *OOBLECK, *kills("{kind: node, node: 2, at_step: 4}")]))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    record = client.get_run(result.run_id)
    assert record.info.status == "FINISHED" and record.data.tags["backend"] == "sim"
    for name in ("perf/iter_s", "perf/samples_per_s", "cluster/alive_nodes", "ft/recover_s", "summary/goodput_ratio"):
        assert name in record.data.metrics, name
    assert "train/loss" not in record.data.metrics and not math.isnan(result.summary["summary/samples_per_s"])
    steps = [m.step for m in client.get_metric_history(result.run_id, "perf/iter_s")]
    assert steps[0] == 0 and steps[-1] == STEPS - 1 and len(steps) < STEPS  # equal steps logged as first and last
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"config.yaml", "events.jsonl", "plans", "timeline.png"} <= artifacts
    assert len(client.list_artifacts(result.run_id, "plans")) == len(result.plans) == 2


BAD_INPUTS = [
    (["cluster.device=B200"], ConfigError, "cluster.device='B200' has no profile"),
    (["protection=reft", "protection.mode=aor", "train.zero=1"], ConfigError, "use protection.mode=arc, aec or arc\\+aec"),
    (["cluster.nodes=40", "train.global_batch=80", "faults=trace", "faults.trace=p3"], FaultConfigError,
     "faults.trace_copies=2"),
    (["sim.horizon_s=-1"], ConfigError, "sim.horizon_s=-1"),
    (["model.attention=eager_dropout"], ConfigError, "model.attention=eager_dropout is for a GPU type"),
    (["model.attention=flash"], ConfigError, "model.attention='flash': use one of fused, eager, eager_dropout"),
]


@pytest.mark.parametrize(("overrides", "error", "advice"), BAD_INPUTS, ids=[" ".join(o) for o, _, _ in BAD_INPUTS])
def test_bad_input_is_refused_with_a_message(
    job_overrides: list[str], tmp_path: Path, overrides: list[str], error: type, advice: str
) -> None:
    with pytest.raises(error, match=advice.replace("(", r"\(")):
        simulate_job(compose_config([*job_overrides, "mode=simulate", *overrides]))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (record,) = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
    assert record.info.status == "FAILED" and record.data.tags["backend"] == "sim"


def test_a_larger_cluster_replays_copies_of_a_trace() -> None:
    one = build_schedule(FaultsConfig(schedule="trace", trace="p3"), ClusterShape(32, 8))
    four = build_schedule(FaultsConfig(schedule="trace", trace="p3", trace_copies=4), ClusterShape(125, 8))
    removes = sum(e.kind == "node" for e in one)
    assert 3 * removes < sum(e.kind == "node" for e in four) <= 4 * removes
    instants = {e.at_time_s for e in one if e.kind == "node"}
    assert len({e.at_time_s for e in four if e.kind == "node"}) >= 3 * len(instants), "the copies interleave"


# -- REFT ----------------------------------------------------------------------------------------------------------
def restored(result: JobResult) -> list[tuple[int, str]]:
    return [(e.step, e.source) for e in result.events if isinstance(e, ev.StateRestored)]


def test_reft_snapshots_beside_training_and_a_restart_restores_from_memory(job_overrides: list[str]) -> None:
    # Copies far faster than an iteration (the measured rate would make it a matter of the machine's constants).
    quick = [*REFT, "sim.snapshot_bytes_per_s=1e13", *kills("{kind: node, node: 1, at_step: 5, phase: backward}")]
    cfg = sim_cfg(job_overrides, *quick)
    result = simulate(cfg).result
    assert restored(result) == [(5, "memory")]  # the step the failure found committed: no step is lost
    (fault,) = result.faults
    assert fault.lost_steps == 0 and sorted({s.step for s in result.steps}) == list(range(STEPS))
    # A snapshot after every commit: on the critical path, its launch (the copies end within the next iteration).
    taken = [s.snapshot_s for s in result.steps if s.step not in (0, 5)]
    assert taken == [pytest.approx(cfg.sim.snapshot_launch_s)] * len(taken)
    again = simulate(sim_cfg(job_overrides, *quick)).result
    assert logged(again) == logged(result) and again.plans == result.plans


def test_a_copy_slower_than_an_iteration_holds_the_next_step(job_overrides: list[str]) -> None:
    # On devices (a copy engine beside the computation): the step is held by the wait for the copy alone.
    gpu = [*REFT, "cluster.device=A100-40GB"]
    fast = simulate(sim_cfg(job_overrides, *gpu, "sim.snapshot_bytes_per_s=1e13")).result
    slow = simulate(sim_cfg(job_overrides, *gpu, "sim.snapshot_bytes_per_s=1e6")).result
    assert slow.steps[0].snapshot_s is None and slow.steps[0].iter_s == fast.steps[0].iter_s
    assert slow.steps[2].snapshot_s > 10 * fast.steps[2].snapshot_s
    held = slow.steps[2].snapshot_s - fast.steps[2].snapshot_s
    assert slow.steps[2].iter_s == pytest.approx(fast.steps[2].iter_s + held)


def test_on_a_shared_host_a_copy_takes_cores_from_the_iteration_it_overlaps(job_overrides: list[str]) -> None:
    # The local cluster's processes share this host's cores, and so do their copy threads: copies quicker than the
    # iteration hold no step (the wait is the launch alone), yet the iteration they overlap takes the longer the
    # more core time they take.
    def iterations(*overrides: str) -> list[ev.StepCommitted]:
        return simulate(sim_cfg(job_overrides, *overrides, "sim.host_cores=1")).result.steps

    plain = iterations("policy=none", *REFT[-1:])
    launch = SimConfig().snapshot_launch_s
    copied = {rate: iterations(*REFT, f"sim.snapshot_bytes_per_s={rate}") for rate in (1e11, 1e10)}
    for steps in copied.values():
        assert steps[0].iter_s == pytest.approx(plain[0].iter_s)  # no snapshot before the first step
        assert all(s.snapshot_s == pytest.approx(launch) for s in steps[1:])
    assert plain[1].iter_s + launch < copied[1e11][1].iter_s < copied[1e10][1].iter_s


def test_on_a_shared_host_a_flush_shares_the_cores_with_its_steps_copies(job_overrides: list[str]) -> None:
    # After the commit of step 3, REFT snapshots step 4's state and flushes it to storage; the workers write the
    # checkpoint while their copy threads run (as on the runtime), so the flush takes longer than the same checkpoint
    # without copies, and the copies are done when step 4 begins: it runs as an iteration with none beside it.
    def steps(*overrides: str) -> list[ev.StepCommitted]:
        return simulate(sim_cfg(job_overrides, *overrides, "sim.host_cores=1")).result.steps

    def flush_s(committed: list[ev.StepCommitted]) -> float:  # from step 3's commit to step 4's start
        return committed[4].at - committed[4].iter_s - committed[3].at

    reft = steps(*[o for o in REFT if not o.startswith("protection.flush_every")], "protection.flush_every=4")
    storage = steps(*[o for o in RESTART if not o.startswith("protection.every")], "protection.every=4")
    plain = steps("policy=none", *REFT[-1:])
    launch = SimConfig().snapshot_launch_s
    assert flush_s(reft) > flush_s(storage) > 0
    assert reft[4].iter_s == pytest.approx(plain[4].iter_s + launch)
    assert reft[3].iter_s > plain[3].iter_s + launch and reft[5].iter_s == pytest.approx(reft[3].iter_s)


def test_a_snapshots_copy_cpu_is_its_bytes_at_the_copy_rate_however_long_the_copies_waited(
    job_overrides: list[str], tmp_path: Path
) -> None:
    # Copies on one shared core beside the iterations take longer than their CPU: the record's CPU is the rate's.
    rate = 1e9
    result = simulate_job(compose_config([*job_overrides, "mode=simulate", *REFT, f"sim.snapshot_bytes_per_s={rate}",
                                          "sim.host_cores=1"]))  # fmt: skip
    history = snapshot_history(f"sqlite:///{tmp_path}/mlflow.db", result.run_id)
    writers = len(result.plans[0].workers)
    assert len(history["cpu_s"]) == STEPS - 1  # the last step's snapshot is still copying when the job ends
    for step, cpu_s in history["cpu_s"].items():
        assert cpu_s == pytest.approx(history["bytes"][step] / rate)
        assert history["copy_s"][step] > cpu_s / writers


def test_on_a_shared_host_each_worker_computes_at_its_layers_speed(job_overrides: list[str]) -> None:
    # How fast each layer is computed against its charge (measured beside a job): each speed lengthens or shortens
    # the computation of exactly the workers holding the layer, by its factor; every layer at 1 is the charge itself.
    cfg = sim_cfg(job_overrides, "train.stages=2")
    costs = CostModel(analytic(cfg)[0])
    plan = grid_plan([0, 1, 2, 3], 2, costs.num_layers, cfg.train.global_batch, cfg.train.micro_batch)
    programs = one_f_one_b(plan)
    second = max(start for start, _ in plan.layer_ranges().values())  # the second stage's first layer

    def compute(*speeds: float) -> float:
        """Every worker's forward and backward seconds on a host with a core for each."""
        timer = IterationTimer(costs, cores=HostCores(8), layer_overhead_s=1e-4, layer_speed=speeds)
        return timer.time(plan, programs).total_compute_s

    layers = costs.num_layers
    charged = compute()
    assert compute(*[1.0] * layers) == pytest.approx(charged, rel=1e-12)
    assert compute(*[2.0] * layers) == pytest.approx(charged / 2)
    halved = [0.5 if layer >= second else 1.0 for layer in range(layers)]
    doubled = [2.0 if layer >= second else 1.0 for layer in range(layers)]
    second_stage = compute(*halved) - charged  # the second stage's workers' compute, once more
    assert second_stage > 0
    assert compute(*doubled) == pytest.approx(charged - second_stage / 2)


def test_on_a_shared_host_the_cores_give_what_so_many_computing_at_once_got(job_overrides: list[str]) -> None:
    # Measured cores' worth by load: as many cores as workers up to two computing at once leaves the iteration as two
    # plain cores do; fewer for three and four lengthens it.
    def iteration(*overrides: str) -> float:
        return simulate(sim_cfg(job_overrides, "policy=none", "sim.host_cores=2", "sim.step_cpu_s=0",
                                *overrides)).result.steps[1].iter_s  # fmt: skip

    plain = iteration()
    assert iteration("sim.host_cores_by_load=[1,2,2,2]") == pytest.approx(plain)
    assert iteration("sim.host_cores_by_load=[1,2,1.5,1.5]") > plain * 1.05
    # A worker's own work of a step: the four workers do it at once, after the commit, on the two cores.
    assert iteration("sim.step_cpu_s=0.01") == pytest.approx(plain + 4 / 2 * 0.01)
    gpu = ["cluster.device=A100-40GB"]  # a device per worker, host cores of its own: not charged
    assert iteration(*gpu, "sim.step_cpu_s=0.01") == pytest.approx(iteration(*gpu))


def test_on_a_shared_host_messages_and_all_reduces_cost_the_cores_what_was_measured(job_overrides: list[str]) -> None:
    # A stage boundary's messages take CPU on both sides; replicas' all-reduces take the CPU measured for them
    # rather than the link's time. Neither where nothing crosses a boundary or no layer is replicated, nor on GPUs.
    def iteration(*overrides: str) -> float:
        return simulate(sim_cfg(job_overrides, "policy=none", "cluster=local-4", "sim.host_cores=2",
                                *overrides)).result.steps[1].iter_s  # fmt: skip

    pipeline, replicas = ["train.stages=4"], ["train.stages=1"]
    assert iteration(*pipeline, "sim.message_cpu_s=0.01") > iteration(*pipeline) + 0.01
    assert iteration(*replicas, "sim.message_cpu_s=0.01") == pytest.approx(iteration(*replicas))
    cheap, dear = (iteration(*replicas, f"sim.allreduce_cpu_bytes_per_s={rate}") for rate in (1e12, 1e8))
    assert cheap < iteration(*replicas) < dear
    assert iteration(*pipeline, "sim.allreduce_cpu_bytes_per_s=1e8") == pytest.approx(iteration(*pipeline))
    gpu = ["cluster.device=A100-40GB", *pipeline]
    assert iteration(*gpu, "sim.message_cpu_s=0.01") == pytest.approx(iteration(*gpu))


def test_where_the_workers_fit_the_cores_a_message_costs_what_was_measured_on_a_core_each(
    job_overrides: list[str],
) -> None:  # fmt: skip
    # Two workers on two cores keep a core each while they wait: their messages cost the own-core figure. Four on
    # two cores find theirs used by the others: the one-core figure, whatever the own-core one.
    def iteration(nodes: int, *overrides: str) -> float:
        cfg = sim_cfg(job_overrides, "policy=none", f"cluster.nodes={nodes}", f"train.stages={nodes}",
                      "sim.host_cores=2", "sim.message_cpu_s=0.01", *overrides)  # fmt: skip
        return simulate(cfg).result.steps[1].iter_s

    for nodes, fits in ((2, True), (4, False)):
        one_core = iteration(nodes, "sim.message_cpu_own_core_s=null")  # no own-core figure: the one-core one
        assert iteration(nodes, "sim.message_cpu_own_core_s=0.01") == pytest.approx(one_core)
        free = iteration(nodes, "sim.message_cpu_own_core_s=0")
        if fits:
            no_cost = iteration(nodes, "sim.message_cpu_s=0", "sim.message_cpu_own_core_s=null")
            assert free < one_core and free == pytest.approx(no_cost)
        else:
            assert free == pytest.approx(one_core)


def test_an_all_reduce_costs_each_member_its_buffer_whatever_the_members(job_overrides: list[str]) -> None:
    # One-stage replicas on two cores reduce all at once, after identical programs: what a dear rate adds is every
    # member's whole buffer over the rate, shared by the cores. Four members add twice what two add (the ring's
    # 2(k - 1)/k share each would make it three times).
    def added(nodes: int) -> float:
        def iteration(rate: float) -> float:
            cfg = sim_cfg(job_overrides, "policy=none", f"cluster.nodes={nodes}", "train.stages=1", "sim.host_cores=2",
                          f"sim.allreduce_cpu_bytes_per_s={rate}")  # fmt: skip
            return simulate(cfg).result.steps[1].iter_s

        return iteration(1e8) - iteration(1e12)

    assert added(2) > 0
    assert added(4) == pytest.approx(2 * added(2), rel=1e-6)


def test_a_configuration_costs_the_slowest_worker_its_share_and_its_reduce_groups_on_the_cores_shared(
    job_overrides: list[str],
) -> None:
    costs = CostModel(analytic(sim_cfg(job_overrides))[0])
    sim = SimConfig(configure_s=0.005, configure_group_s=0.008)
    devices = DeviceMachine(costs, sim, workers_per_node=1)
    stages = grid_plan([0, 1], 2, 8, 4, 2)  # nothing is all-reduced
    replicas = grid_plan([0, 1], 1, 8, 4, 2)  # one reduce group
    grid = grid_plan([0, 1, 2, 3], 2, 8, 8, 2)  # one group each, four workers
    # Worker 2 alone holds every layer, so it all-reduces the first half with worker 0 and the second with worker 1.
    halves = Pipeline((Stage(0, 0, 4), Stage(1, 4, 8)), (0, 1))
    mixed = Plan(0, 8, 8, 2, (halves, Pipeline((Stage(2, 0, 8),), (2, 3))))
    assert devices.configuration_s(stages) == pytest.approx(0.005)
    assert devices.configuration_s(replicas) == devices.configuration_s(grid) == pytest.approx(0.013)
    assert devices.configuration_s(mixed) == pytest.approx(0.021)
    # On a shared host every worker configures at once: two on two cores as fast as one, four at half the speed.
    two_cores = SharedHostMachine(costs, SimConfig(configure_s=0.005, configure_group_s=0.008, host_cores=2))
    assert two_cores.configuration_s(replicas) == pytest.approx(0.013)
    assert two_cores.configuration_s(grid) == pytest.approx(2 * 0.013)


def test_a_lost_shard_is_decoded_from_parity(job_overrides: list[str]) -> None:
    """Three replicas per stage, AEC: node 1 dies copying its records; its shard is rebuilt from the others'."""
    aec = [*REFT, "protection.mode=aec", "cluster.nodes=6", "train.stages=2"]
    result = simulate(sim_cfg(job_overrides, *aec, *kills("{kind: node, node: 1, at_step: 4, phase: snapshot}"))).result
    (fault,) = injected(result)
    assert fault.at > [s for s in result.steps if s.step == 3][0].at  # inside the copy of the snapshot of step 4
    assert restored(result) == [(4, "parity")] and result.faults[0].lost_steps == 0


def test_a_nodes_memory_is_lost_with_it(job_overrides: list[str]) -> None:
    """Both holders of a stage's state die: no snapshot in memory can be rebuilt, the flush to storage is used."""
    flushes = [*REFT[:-2], "protection.flush_every=3", f"train.steps={STEPS}"]
    both = kills("{kind: node, node: 1, at_step: 5}", "{kind: node, node: 3, at_step: 5}")
    result = simulate(sim_cfg(job_overrides, *flushes, *both)).result
    (decided,) = [e for e in result.events if isinstance(e, ev.Decided)]
    assert "lost" in decided.restore_reason and restored(result) == [(3, "storage")]
    assert result.faults[0].lost_steps == 2


def test_a_killed_nodes_records_are_gone_from_memory(job_overrides: list[str]) -> None:
    """The backend's own memory, which ``verify`` reads: a source is narrowed to what survives, or refused."""
    cfg = sim_cfg(job_overrides, *REFT, "cluster.device=A100-40GB")
    job = job_factory(cfg, None)(everyone(cfg))
    policy, protection = components(cfg)
    plan = policy.plan(job, protection).plan
    c = cfg.cluster
    backend = SimBackend(c.nodes, c.workers_per_node, job.machine(), 1.0, ev.EventBus())
    assert backend.save(1, TakeSnapshot(plan, "arc", c.workers_per_node, -1), {}, plan.num_layers).pending
    assert backend.completed_saves() == []  # still copying
    backend.time.now = 10.0
    done = backend.completed_saves()
    reported = [w for p in done for w in p.workers]  # writers whose copies end together report together
    assert sorted(reported) == sorted(plan.workers) and len(done) < len(reported)
    assert done[-1].complete and not any(p.complete for p in done[:-1])
    source = MemorySource(1, plan=plan, workers_per_node=c.workers_per_node, records=tuple(r for p in done for r in p.records))
    assert backend.verify(source) == source
    backend.cluster.kill_node(1)
    narrowed = backend.verify(source)
    assert isinstance(narrowed, MemorySource) and 1 not in {r.node for r in narrowed.records}
    (partner,) = [w for g in groups_of(plan) if 1 in g.holders for w in g.holders if w != 1]
    backend.cluster.kill_node(backend.cluster.node_of(partner))  # the other holder of node 1's layers: their state is gone
    assert "cannot rebuild" in backend.verify(source)


def test_oobleck_with_reft_runs_on_a_gpu_cluster(job_overrides: list[str]) -> None:
    base = [*OOBLECK, "protection=reft", "cluster.device=A100-40GB", *SCENARIOS["oobleck"][-2:]]
    result = simulate(sim_cfg(job_overrides, *base)).result
    assert sorted({s.step for s in result.steps}) == list(range(STEPS)) and len(result.faults) == 2
    assert all(s.snapshot_s is not None for s in result.steps[1:3])


def test_a_train_stages_the_policy_does_not_use_is_warned_of(
    job_overrides: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Oobleck chooses its pipelines' depth from its templates: a train.stages given to it is said to be unused."""
    with caplog.at_level(logging.WARNING, logger=job_module.__name__):
        simulate(sim_cfg(job_overrides, *OOBLECK, "train.stages=3"))
        simulate(sim_cfg(job_overrides, *RESTART, "train.stages=3"))
    unused = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert len(unused) == 1 and unused[0].startswith("train.stages=3 is not used: policy=oobleck chooses")


# -- activation checkpointing in the cost and memory model --------------------------------------------------------
def test_activation_checkpointing_trades_activation_memory_for_a_forward() -> None:
    from dataclasses import replace

    from ftlab.runtime.core.costs import stage_footprint
    from ftlab.runtime.core.devices import node_spec
    from ftlab.runtime.core.model_spec import load_model_config

    profile = analytic_profile(load_model_config("llama2-6.7b"), node_spec(ClusterConfig(device="A100-80GB")), 1, 4096)
    plain, checkpointed = CostModel(profile), CostModel(replace(profile, activation_checkpointing=True))
    start, stop, in_flight = 1, 9, 8
    assert checkpointed.backward_s(start, stop) == pytest.approx(plain.backward_s(start, stop) + plain.forward_s(start, stop))
    assert checkpointed.forward_s(start, stop) == plain.forward_s(start, stop)
    # Eight blocks, eight micro-batches in flight: 8 x 8 blocks' activations, or 8 inputs and one stage's worth.
    saved, state = plain.activation_bytes(start, stop), plain.state_bytes(start, stop)
    boundary = profile.layers[start - 1].output_bytes
    assert plain.stage_memory(start, stop, in_flight) == state + in_flight * saved
    assert checkpointed.stage_memory(start, stop, in_flight) == state + in_flight * boundary + saved
    assert checkpointed.stage_memory(start, stop, in_flight) - state < (plain.stage_memory(start, stop, in_flight) - state) / 4
    for model in (plain, checkpointed):
        flag = model.profile.activation_checkpointing
        assert stage_footprint(profile.layers, start, stop, in_flight, flag) == model.stage_memory(start, stop, in_flight)


def test_activation_checkpointing_lets_a_paper_scale_plan_fit(job_overrides: list[str]) -> None:
    """llama2-6.7b, micro-batches of 2 x 4,096 tokens, on one node of 8 A100s: the stages do not fit without it."""
    base = [*job_overrides, "model=llama2-6.7b", "cluster=a100-16x8", "cluster.nodes=1", "train.stages=8",
            "train.global_batch=16", "train.micro_batch=2", "mode=simulate"]  # fmt: skip
    with pytest.raises(ConfigError, match="train.activation_checkpointing=true"):
        simulate(OmegaConf.to_object(compose_config(base)))
    result = simulate(OmegaConf.to_object(compose_config([*base, "train.steps=3", "train.activation_checkpointing=true"])))
    assert len(result.result.steps) == 3
