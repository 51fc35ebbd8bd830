"""Measure the simulator's constants on this machine and store them in ``conf/sim/measured.yaml``.

    .venv/bin/python -m experiments.measure_sim_constants            # measure and rewrite conf/sim/measured.yaml
    .venv/bin/python -m experiments.measure_sim_constants --print    # measure and print only
    .venv/bin/python -m experiments.measure_sim_constants --runs 5   # five whole runs, each constant's median

What a model profile has no figure for is measured here, on the local runtime itself (``runtime.processes.local_backend`` with
real agents and workers running gpt2-tiny on two nodes of one worker), each the best of a few repeats (the shortest
time, the highest rate: other processes on a shared machine only ever slow a repeat down). ``host_cores`` is this
machine's core count: the constants are an idle host's, and the simulator slows what a busy one would. The storage
rates are the median of their repeats instead: the disk is shared with other machines' jobs too, checkpoints fsync
every file, and the simulator has no load for the disk to slow, so the best write would be faster than a job's.

- ``process_start_s``: ``restart_workers`` of two workers, as on an idle host: divided by the slowdown the
  simulator would charge two processes starting on the share of the machine they had (``profiler.host_share``,
  measured around it); ``node_start_s``: starting the cluster (alike) less that: the agents.
- ``configure_s``: configuring a plan of two stages on workers that hold its layers and ran a step of the plan
  before, as a recovery configures (a configuration right after another, with no step between, is cheaper than
  one after steps, and a recovery's always follows steps); ``configure_group_s``: configuring two replicas of the whole model, one gradient reduce group,
  takes longer by that (both, as ``process_start_s``, an idle host's); ``build_bytes_per_s``: a fresh worker's
  configuration takes longer by building its layers' weights and optimizer state.
- ``layer_overhead_s``: the runtime's cost per layer of a forward or backward instruction beyond the profiled
  layers', from the CPU time of one worker's steps of one micro-batch and of eight (each micro-batch more costs its
  profiled compute and two instructions of every layer), against the layers profiled just before each repeat (not
  read from the cache). CPU time, as the profile's layers are timed: the wall clock also counts what other
  processes took of the core, and a correction by the share of a core that spinners got misses what their working
  sets cost this one, so on a loaded host it overstates the cost; what working sets side by side cost is the
  host's (``sim.host_cores_by_load``). The median of five repeats: the machine's speed drifts within minutes, and
  the CPU clock ticks at 10 ms;
  ``step_cpu_s``: the one-micro-batch step's CPU time beyond its compute, instructions and optimizer step;
  ``control_s``: the fastest such step's wall time beyond its CPU time (the worker's other threads receive the
  next step while it works: about nothing).
- ``message_cpu_s``: what a stage boundary costs per message, from the CPU time of steps of one micro-batch and
  of eight, of one worker holding every layer and of two stages (each micro-batch more crosses the boundary twice);
  ``allreduce_cpu_bytes_per_s``: the gradient bytes over the CPU time two replicas' steps of one micro-batch each
  take beyond the one worker's (their all-reduce). Both workers on one core meanwhile: what computing side by side
  costs them is the host's (``sim.host_cores_by_load``), and counted here it would be charged twice (measured
  unpinned on two cores, a message would carry the contention of the moment; gloo's own copying of an activation is
  a small part of it). The median of five repeats. ``message_cpu_own_core_s``: a message measured the same way with each worker
  pinned to a core of its own, which it keeps while it waits (what a plan whose processes fit the cores is
  charged); five repeats more.
- ``codec_bytes_per_s``: encoding and decoding layer state (``runtime.training.layer_state``), timed in this process;
  ``snapshot_bytes_per_s``: a REFT snapshot's copy on the runtime itself: the one-micro-batch steps of one worker
  again, each followed by a snapshot of its whole state (a group of one member writes one shard record: weights and
  both moments into its node's /dev/shm, with its checksum), the snapshots' bytes over the CPU time of the copy
  thread, as the worker reports it (``ft/snapshot_cpu_s``; the median of five repeats). The copy runs on a thread
  beside the next step and the simulator runs it as one more thread on the host's cores, so what it costs is that
  thread's CPU time. (Not the CPU time the snapshots add to the worker's steps: that is a difference of two sets
  of steps, each on a clock that ticks at 10 ms, and moves with the machine's drift between them.)
  ``snapshot_launch_s`` stays ``SimConfig``'s estimate: starting the copy thread is not
  separable from the step around it;
  ``storage_write_bytes_per_s``: a checkpoint's bytes over its time less the encoding; ``storage_read_bytes_per_s``:
  restoring a checkpoint on fresh workers, less configuring, building and decoding.
- ``detect_s``: a node killed in the middle of a step to the coordinator noticing; ``abort_s``: aborting the
  survivors; ``failure_window_s``: the local backend's own constant.
- ``host_cores``: this machine's cores.

The machine is shared and noisy: the file records the load average it was measured under, and a run whose
``DRIFT_SPOILS`` came out 0 is measured again (``measure_unspoiled``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import psutil
from omegaconf import OmegaConf

from ftlab.runtime.core.config import SimConfig

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "conf" / "sim" / "measured.yaml"
REPEATS = 3
CPU_REPEATS = 5
"""For the constants read off the CPU clock, which ticks at 10 ms: their median."""


def measure(cache_dir: Path) -> dict[str, float]:
    from ftlab.experiments.job import compose_config, job_profile, preflight, worker_setup
    from ftlab.runtime.control import events as ev
    from ftlab.runtime.processes import local_backend
    from ftlab.runtime.control.backend import Failure
    from ftlab.runtime.processes.cluster import LocalCluster
    from ftlab.runtime.core.contract import SaveCheckpoint, StorageSource
    from ftlab.runtime.core.costs import CostModel
    from ftlab.runtime.processes.local_backend import LocalBackend
    from ftlab.runtime.core.plan import grid_plan
    from ftlab.runtime.processes.profiler import host_share
    from ftlab.runtime.core.scheduler import one_f_one_b

    scratch = Path(tempfile.mkdtemp(prefix="ftlab-constants-"))
    overrides = [
        "experiment=plain", "cluster.nodes=2", "train.stages=2", "train.global_batch=4", "train.micro_batch=2",
        f"train.cache_dir={cache_dir}", f"train.checkpoint_dir={scratch}", f"tracking.uri=sqlite:///{scratch}/m.db",
    ]  # fmt: skip
    cfg = OmegaConf.to_object(compose_config(overrides))
    checked = preflight(cfg)

    def profiled_now(repeat: int) -> CostModel:
        """The layers' costs measured now, not read from the cache: the runtime's own cost is what its steps take
        beyond them at the same moment, and a profile taken minutes or hours earlier met another load."""
        fresh = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, cache_dir=str(scratch / f"{repeat}")))
        return CostModel(job_profile(fresh)[0])

    costs = profiled_now(0)
    c = cfg.cluster
    setup = worker_setup(cfg, checked)
    layers = costs.num_layers
    two = grid_plan([0, 1], 2, layers, 4, 2)
    one = grid_plan([0], 1, layers, 2, 2)
    generation = 0

    def next_plan(plan):  # noqa: ANN001, ANN202
        nonlocal generation
        generation += 1
        return dataclasses.replace(plan, generation=generation)

    def timed(action) -> float:  # noqa: ANN001
        started = time.monotonic()
        result = action()
        assert not isinstance(result, Failure), result
        return time.monotonic() - started

    bus = ev.EventBus()
    cluster = LocalCluster(2, 1, c.heartbeat_s, c.threads_per_worker)
    setup["memory_root"] = str(cluster.memory_root)
    found: dict[str, list[float]] = {}
    try:
        started = time.monotonic()
        cluster.start(c.start_timeout_s)
        cluster_start = time.monotonic() - started
        backend = LocalBackend(cluster, bus, setup, c.heartbeat_timeout_s)
        state = sum(costs.checkpoint_bytes(a, b) for a, b in two.layer_ranges().values())
        slowest_state = max(costs.checkpoint_bytes(a, b) for a, b in two.layer_ranges().values())
        # Two workers start at once; the simulator charges process_start_s x max(1, 2 / host cores): inverted here
        # with the share of the machine two processes had around the measurement, the constant is an idle host's.
        starting = host_share(2)

        def configured(plan, source=None) -> float:  # noqa: ANN001 - a Plan and a restore source
            """Configuring ``plan``, restoring ``source`` if one is given."""
            return timed(lambda: backend.configure(plan, one_f_one_b(plan), {}, source))

        def reconfigured(shape) -> float:  # noqa: ANN001 - a Plan
            """A new generation of ``shape`` configured on workers holding its layers, then a step of it."""
            plan = next_plan(shape)
            seconds = configured(plan)
            _run_step(backend, plan, plan.step)
            return seconds

        pair = grid_plan([0, 1], 1, layers, 4, 2)  # two replicas: one gradient reduce group
        held: list[float] = []  # configuring workers that hold the layers, right after the fresh configuration
        for _ in range(REPEATS):
            found.setdefault("process_start_s", []).append(timed(backend.restart_workers))
            plan = next_plan(two)
            fresh = configured(plan)
            plan = next_plan(two)
            held.append(configured(plan))
            found.setdefault("build_bytes_per_s", []).append(slowest_state / max(fresh - held[-1], 1e-3))
            # As a recovery configures: after steps of the generation before (its buffers and groups retired then).
            _run_step(backend, plan, plan.step)
            found.setdefault("configure_s", []).append(reconfigured(two))
            backend.restart_workers()  # every layer built afresh: all at the same optimizer step
            reconfigured(pair)
            found.setdefault("configure_pair_s", []).append(reconfigured(pair))
        starting = (starting + host_share(2)) / 2
        # Both workers configure at once: what the simulator charges is an idle host's, slowed as for two at once.
        for name in ("process_start_s", "configure_s", "configure_pair_s"):
            found[name] = [t / max(1.0, 2 / starting) for t in found[name]]
        found["cluster_start_s"] = [cluster_start / max(1.0, 2 / starting)]  # two agents, then their workers
        # One worker alone, steps of one micro-batch and of eight: its CPU time per step grows by the profiled compute
        # and two instructions' runtime cost per micro-batch more (of the whole model's layers: the cost grows with
        # them, see SimConfig.layer_overhead_s). The one-micro-batch step's CPU time beyond its compute, instructions
        # and optimizer step is the worker's own work of a step; its fastest wall time beyond its CPU time, the
        # round trip. Each repeat against the layers profiled just before it.
        step = 0
        worker = psutil.Process(cluster.workers[0].pid)
        for repeat in range(CPU_REPEATS):
            costs = profiled_now(repeat)
            per_microbatch = costs.forward_s(0, layers) + costs.backward_s(0, layers)
            plan = next_plan(one)
            backend.configure(plan, one_f_one_b(plan), {}, None)
            one_step, [one_cpu], step = _steps(backend, plan, step, 20, worker)
            eight = next_plan(grid_plan([0], 1, layers, 16, 2))
            backend.configure(eight, one_f_one_b(eight), {}, None)
            _, [eight_cpu], step = _steps(backend, eight, step, 20, worker)
            instruction = max(((eight_cpu - one_cpu) / 7 - per_microbatch) / 2, 0.0)
            found.setdefault("instruction_s", []).append(instruction)
            work = one_cpu - per_microbatch - 2 * instruction - costs.optimizer_s(0, layers)
            found.setdefault("step_cpu_s", []).append(max(work, 0.0))
            found.setdefault("control_s", []).append(max(one_step - one_cpu, 0.0))
            # The same steps, each followed by a snapshot of the worker's whole state, copied beside the next step.
            plan = next_plan(one)
            backend.configure(plan, one_f_one_b(plan), {}, None)
            rate, step = _snapshot_rate(backend, plan, step, 20)
            found.setdefault("snapshot_bytes_per_s", []).append(rate)
        # The CPU clock ticks at 10 ms: the median of the repeats, not the least, which is as far off as the most.
        found["layer_overhead_s"] = [statistics.median(found.pop("instruction_s")) / layers]
        # Stage boundaries and all-reduces, both workers on one core (module docstring).
        procs = [worker, psutil.Process(cluster.workers[1].pid)]

        def message_cpu(step: int) -> tuple[float, float, int]:
            """A message's CPU, from two stages' and one worker's CPU a step, of one micro-batch and of eight; the
            one worker's CPU a step of one micro-batch; the next step."""
            per_step = {}  # micro-batches -> (one worker's CPU a step, the two stages' together)
            for microbatches in (1, 8):
                plan = next_plan(grid_plan([0], 1, layers, 2 * microbatches, 2))
                one_stage, step = _cpu_per_step(backend, plan, step, procs[:1])
                plan = next_plan(grid_plan([0, 1], 2, layers, 2 * microbatches, 2))
                two_stages, step = _cpu_per_step(backend, plan, step, procs)
                per_step[microbatches] = one_stage[0], sum(two_stages)
            # Each micro-batch more crosses the boundary twice (its activation, its gradient).
            more = [(per_step[8][i] - per_step[1][i]) / 7 for i in range(2)]
            return max((more[1] - more[0]) / 2, 0.0), per_step[1][0], step

        with _pinned(procs, one_core=True):
            for _ in range(CPU_REPEATS):
                message, alone, step = message_cpu(step)
                found.setdefault("message_cpu_s", []).append(message)
                plan = next_plan(grid_plan([0, 1], 1, layers, 4, 2))  # two replicas of one micro-batch each
                replicas, step = _cpu_per_step(backend, plan, step, procs)
                reduced = max(statistics.mean(replicas) - alone, 1e-4)  # a member's CPU: its whole buffer's
                found.setdefault("allreduce_cpu_bytes_per_s", []).append(costs.param_bytes(0, layers) / reduced)
        # A core each, where the host has two: what a message costs workers that keep their cores while they wait.
        with _pinned(procs, one_core=False):
            for _ in range(CPU_REPEATS):
                message, _, step = message_cpu(step)
                found.setdefault("message_cpu_own_core_s", []).append(message)
        found["message_cpu_own_core_s"] = [statistics.median(found["message_cpu_own_core_s"])]
        found["message_cpu_s"] = [statistics.median(found["message_cpu_s"])]
        found["allreduce_cpu_bytes_per_s"] = [statistics.median(found["allreduce_cpu_bytes_per_s"])]
        found["snapshot_bytes_per_s"] = [statistics.median(found["snapshot_bytes_per_s"])]
        found["step_cpu_s"] = [statistics.median(found["step_cpu_s"])]
        control = min(found["control_s"])
        # Checkpoints: written by both workers of the two-stage plan, then restored on fresh workers.
        codec = _codec_bytes_per_s(cfg)
        plan = dataclasses.replace(next_plan(two), step=step)
        backend.configure(plan, one_f_one_b(plan), {}, None)
        writers = {w: tuple(range(a, b)) for w, (a, b) in plan.layer_ranges().items()}
        for _ in range(REPEATS):  # as a job saves: after a step, into a new directory, the one before it pruned
            _, _, step = _steps(backend, plan, step, 1, worker)
            save = timed(lambda: backend.save(step, SaveCheckpoint(str(scratch / "ckpt"), keep=1), writers, layers))
            writing = save - control - slowest_state / codec
            found.setdefault("storage_write_bytes_per_s", []).append(state / max(writing, 1e-3))
        source = StorageSource(step, str(scratch / "ckpt" / f"step-{step:06d}"))
        configure = min(held)
        build = max(found["build_bytes_per_s"])
        for _ in range(REPEATS):
            backend.restart_workers()
            plan = dataclasses.replace(next_plan(two), step=step)
            restore = configured(plan, source)
            reading = restore - configure - slowest_state / build - slowest_state / codec
            found.setdefault("storage_read_bytes_per_s", []).append(state / max(reading, 1e-3))
        # A node killed mid-step: noticed, then the survivor aborts.
        plan = dataclasses.replace(next_plan(two), step=step)
        backend.configure(plan, one_f_one_b(plan), {}, source)
        backend.begin_step(plan, step)
        killed = time.monotonic()
        cluster.kill_node(1)
        failure = backend.finish_step(plan, step)
        assert isinstance(failure, Failure), failure
        found["detect_s"] = [failure.noticed_at - killed]
        found["abort_s"] = [timed(lambda: backend.abort(plan, failure, step) and None)]
    finally:
        cluster.shutdown()
    best = {name: (max if name.endswith("_bytes_per_s") else min)(values) for name, values in found.items()}
    for name in ("storage_write_bytes_per_s", "storage_read_bytes_per_s"):
        best[name] = statistics.median(found[name])
    best["node_start_s"] = max(best.pop("cluster_start_s") - best["process_start_s"], 0.0)
    best["configure_group_s"] = max(best.pop("configure_pair_s") - best["configure_s"], 0.0)
    best["codec_bytes_per_s"] = codec
    best["snapshot_launch_s"] = SimConfig.snapshot_launch_s
    best["failure_window_s"] = local_backend._FAILURE_WINDOW_S
    best["host_cores"] = os.cpu_count() or 1
    return best


DRIFT_SPOILS = ("layer_overhead_s", "step_cpu_s", "message_cpu_s", "message_cpu_own_core_s")
"""Costs the runtime always has, each the difference of CPU times taken at different moments, held at zero where it
comes out negative: a zero says the machine's speed moved between them by more than the cost, and simulations
charged with it come out short of their real twins, so such a run is measured again."""


def measure_unspoiled(cache_dir: Path, tries: int = 3) -> dict[str, float]:
    """``measure`` again while a constant of ``DRIFT_SPOILS`` comes out 0, ``tries`` runs at most (the last kept, and
    said to be spoiled): one run takes some two and a half minutes, and a drift that spoils one need not last
    into the next."""
    for attempt in range(1, tries + 1):
        values = measure(cache_dir)
        spoiled = [name for name in DRIFT_SPOILS if values[name] <= 0]
        if not spoiled:
            break
        outcome = "measuring again" if attempt < tries else f"kept: {tries} runs, none unspoiled"
        print(f"[constants] {', '.join(spoiled)} came out 0 (the machine's speed moved between the CPU times "
              f"subtracted): {outcome}", flush=True)
    return values


def _steps(  # noqa: ANN001 - a LocalBackend and a Plan
    backend, plan, step: int, steps: int, *workers: psutil.Process
) -> tuple[float, list[float], int]:
    """``steps`` steps of ``plan`` from ``step``: the fastest one's wall seconds, each of ``workers``' mean CPU
    seconds a step (every thread of it), and the next step."""
    walls = []
    cpu = [sum(worker.cpu_times()[:2]) for worker in workers]
    for _ in range(steps):
        started = time.monotonic()
        _run_step(backend, plan, step)
        walls.append(time.monotonic() - started)
        step += 1
    spent = [(sum(worker.cpu_times()[:2]) - before) / steps for worker, before in zip(workers, cpu, strict=True)]
    return min(walls), spent, step


def _cpu_per_step(  # noqa: ANN001 - a LocalBackend and a Plan
    backend, plan, step: int, procs: list[psutil.Process], steps: int = 10
) -> tuple[list[float], int]:
    """``plan`` configured, then ``steps`` of its steps from ``step`` after one to warm up: each of ``procs``' mean
    CPU seconds a step (every thread of it), and the next step."""
    from ftlab.runtime.core.scheduler import one_f_one_b

    backend.configure(plan, one_f_one_b(plan), {}, None)
    _run_step(backend, plan, step)
    _, spent, step = _steps(backend, plan, step + 1, steps, *procs)
    return spent, step


@contextlib.contextmanager
def _pinned(procs: list[psutil.Process], one_core: bool) -> Iterator[None]:
    """Every thread of ``procs`` on one core, or each process on a core of its own where this process may run on as
    many (else on one core too), then back where they were. On one core: their CPU without what computing side by
    side on several cores costs each (their working sets in the shared caches: the host's, measured beside each
    job, ``sim.host_cores_by_load``), each waiting process's core used by the other meanwhile."""
    allowed = sorted(os.sched_getaffinity(0))
    spread = not one_core and len(allowed) >= len(procs)
    threads = [
        (thread.id, allowed[i] if spread else allowed[0], os.sched_getaffinity(thread.id))
        for i, proc in enumerate(procs)
        for thread in proc.threads()
    ]  # fmt: skip
    for tid, core, _ in threads:
        os.sched_setaffinity(tid, {core})
    try:
        yield
    finally:
        for tid, _, cores in threads:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cores)


def _run_step(backend, plan, step: int) -> None:  # noqa: ANN001
    """One step of ``plan``, committed."""
    from ftlab.runtime.control.backend import Failure

    backend.begin_step(plan, step)
    assert not isinstance(backend.finish_step(plan, step), Failure)
    backend.commit(plan, step)


def _codec_bytes_per_s(cfg) -> float:  # noqa: ANN001
    """Encoding and decoding every layer's state, as copies and checkpoints do."""
    from ftlab.runtime.training.layer_state import decode, encode, layer_state
    from ftlab.runtime.training.model import build_layer
    from ftlab.runtime.core.model_spec import num_layers
    from ftlab.runtime.training.optim import OptimSettings, layer_optimizer

    settings = OptimSettings(1e-3, 1e-4, 1, 10, 0.01, 0.9, 0.95)
    total, seconds = 0, []
    for index in range(num_layers(cfg.model)):
        layer = build_layer(cfg.model, index, seed=0)
        optimizer = layer_optimizer(layer, settings)
        for p in layer.parameters():
            p.grad = p.detach().clone()
        optimizer.step()  # the moments exist, as in a trained layer
        samples = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            data = encode(layer_state(layer, optimizer))
            decode(data)
            samples.append(time.perf_counter() - started)
        total += len(data)
        seconds.append(min(samples))
    return total / sum(seconds)


def _snapshot_rate(backend, plan, step: int, steps: int) -> tuple[float, int]:  # noqa: ANN001
    """``steps`` steps of ``plan`` from ``step``, each followed by a REFT snapshot of the state it committed (the
    runtime's copy beside the next step), and one more step for the last copy to complete: the snapshots' bytes
    over their copy threads' CPU time (as the workers report it), and the next step."""
    from ftlab.runtime.control.backend import Failure
    from ftlab.runtime.core.contract import TakeSnapshot

    writers = {w: tuple(range(a, b)) for w, (a, b) in plan.layer_ranges().items()}
    keep, done = -1, []
    for _ in range(steps):
        _run_step(backend, plan, step)
        report = backend.save(step, TakeSnapshot(plan, "arc", 1, keep), writers, plan.num_layers)
        assert not isinstance(report, Failure), report
        done += [p for p in backend.completed_saves() if p.complete]
        keep = max([keep, *(p.step for p in done)])
        step += 1
    _run_step(backend, plan, step)  # the last snapshot completes before this step's Ready
    done += [p for p in backend.completed_saves() if p.complete]
    assert len(done) == steps, f"{len(done)} of {steps} snapshots completed"
    return sum(p.nbytes for p in done) / sum(p.cpu_s for p in done), step + 1


def median_of_runs(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each constant's median over whole runs of ``measure``: on a shared machine whole runs minutes apart differ
    far more than one run's own repeats (a node's start, detection, and the cost per layer with the step's own CPU,
    fitted from the same steps, moving the other way)."""
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}


def render(values: dict[str, float], runs: int) -> str:
    load = os.getloadavg()[0]
    lines = [
        "# Constants of the machinery around training, measured on this machine by",
        f"#   .venv/bin/python -m experiments.measure_sim_constants --runs {runs}",
        f"# on {date.today().isoformat()}, load average {load:.1f} on {os.cpu_count()} cores (a shared machine: rerun",
        "# it on a quiet one for final figures); each constant the median of the runs. The simulator",
        "# (conf/sim -> runtime.core.config.SimConfig) reads them.",
    ]
    order = ["detect_s", "failure_window_s", "control_s", "step_cpu_s", "layer_overhead_s", "message_cpu_s",
             "message_cpu_own_core_s", "allreduce_cpu_bytes_per_s", "abort_s", "configure_s", "configure_group_s",
             "process_start_s", "node_start_s", "build_bytes_per_s", "codec_bytes_per_s", "storage_write_bytes_per_s",
             "storage_read_bytes_per_s", "host_cores", "snapshot_bytes_per_s", "snapshot_launch_s"]  # fmt: skip
    for name in order:
        value = values[name]
        lines.append(f"{name}: {int(value) if name == 'host_cores' else f'{value:.6g}'}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the constants; leave conf/sim/measured.yaml")
    parser.add_argument("--cache-dir", default=str(REPO / ".ftlab" / "cache"))
    parser.add_argument("--runs", type=int, default=3, help="measure everything this many times: medians kept")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: give at least 1")
    text = render(median_of_runs([measure_unspoiled(Path(args.cache_dir)) for _ in range(args.runs)]), args.runs)
    print(text, end="")
    if not args.print:
        OUTPUT.write_text(text)
        print(f"written to {OUTPUT}")


if __name__ == "__main__":
    main()
