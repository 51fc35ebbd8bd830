"""The simulator against the real runtime on the same jobs, and its speed at a thousand GPUs.

    .venv/bin/python -m experiments.bench_simulator            # the validation jobs, then the scale run
    .venv/bin/python -m experiments.bench_simulator --smoke    # shorter jobs (what CI and a busy machine can afford)
    .venv/bin/python -m experiments.bench_simulator --no-real  # the scale run only
    .venv/bin/python -m experiments.bench_simulator --rounds 3 # each real job three times: medians compared
    .venv/bin/python -m experiments.bench_simulator --constants-as-measured  # conf/sim/measured.yaml's constants
    .venv/bin/python -m experiments.bench_simulator --jobs oobleck recycle_reft  # some of the validation jobs
    .venv/bin/python -m experiments.bench_simulator --jobs depth-4x1 depth-1x4 --rounds 2  # pipeline depth alone

Validation. Each job runs on the real runtime here (``run_job``: real agents, workers and SIGKILLs), then the same
composed config is simulated (``mode=simulate``) from the profile measured on this machine for that round (the one
the real run's policy planned with; each round measures it afresh, ``round_cache``) and the constants of the
machinery measured for that round, before its jobs (``round_constants``: one run of
``experiments.measure_sim_constants``, some two and a half minutes, another where the machine's drift spoiled it).
The constants move with the machine's load from hour to hour (the runtime's cost per layer, a message's CPU and a
step's own work most), and with them the simulated iterations: constants measured in a quiet hour would be charged
to jobs run in a busy one. ``--constants-as-measured`` keeps ``conf/sim/measured.yaml``'s.
The jobs:

- ``fault-free``: no policy, a 2 x 2 grid on ``local-4``;
- ``oobleck``: ``local-6`` with 40 MB devices (two-node pipelines), f = 1, node 3 killed in step 22's reduction
  (``KILL_AT``, of ``STEPS`` = 50);
- ``checkpoint_restart``: ``local-4`` with checkpoints every 5 steps, node 1 killed in step 22's reduction;
- ``recycle_reft``: ReCycle on a 2 x 2 grid on ``local-4`` with REFT's snapshot after every step, node 1 killed in
  step 22's reduction (its stage's peer takes its micro-batches).

``--jobs`` also takes two diagnosis jobs, not run by default: ``depth-4x1`` and ``depth-1x4``, fault-free, the same
four workers and micro-batches as four one-stage replicas (no stage boundary, the whole model all-reduced) and as
one pipeline of four stages (48 messages an iteration, nothing to all-reduce): what the simulation charges a
message (``sim.message_cpu_s``) and an all-reduce (``sim.allreduce_cpu_bytes_per_s``) shows in their errors.

This machine is shared: other engineers' jobs take some of its cores, and which share changes by the minute. Each
round measures its profile twice, tens of seconds apart, and keeps each layer's fastest (``measure_profile``'s
``again``): a profile taken while other load held the cores is slow for as long as it lasted. Before and after
each real job the bench measures the cores its workers can have (``runtime.processes.profiler.cores_by_load``, three sweeps,
each number's median: one process per worker of the job's first plan, each computing that worker's layers, one to
all of them side by side; the plan of the profile kept, which for Oobleck may have other stages than the first
profile's) and gives the simulation of that job the mean of the two (``measured_host``): the cores'
worth so many workers computing at once get, what their working sets and switching between more processes than
cores cost included (``sim.host_cores_by_load``, and ``sim.host_cores`` = this machine's cores), and how fast each
layer is computed alone against its charge, the machine's speed against the profile's included
(``sim.host_layer_speed``): the environment the real run met, measured beside it, not fitted to its result.
``--cores-as-measured`` keeps ``conf/sim/measured.yaml``'s.

With ``--rounds N`` each job runs N times, a round being every job once after the round's constants, each simulated
on the cores measured beside it, and the medians of the real and of the simulated rounds are compared: on a shared
machine two runs of one job can differ in their iteration time by more than the targets.

Per job and measure the relative error |sim - real| / real of the iteration time (``summary/median_iter_s``: the
median iteration of the first plan; ``iter_after_s``: of the last plan, after the recovery), the recovery time (the
sum of ``ft/recover_s`` over the job's faults: kill to the next committed step) and the goodput
(``summary/goodput_ratio``). Targets: iteration (both plans') and goodput within 5%, recovery within 15%. The
machine is shared: the real runs are as noisy as it is loaded, and so are the constants the simulator was given:
take final figures on a quiet machine.

Scale. ``scale_run_s``: wall seconds to simulate 12 hours of ``llama2-6.7b`` on 125 nodes of 8 A100s (1,000 GPUs,
activation checkpointing, a global batch of 1,024 sequences of 4,096 tokens in micro-batches of 2) under Oobleck,
with the EC2 P3 spot trace replayed in real time, four copies side by side (``faults.trace_copies=4``: the trace's
preemption rate per node on 125 nodes): some 650 preemptions and as many joins. Timed in this process around
``simulate`` (checks, planning, the simulated day), with no MLflow record; ``scale_record_s`` adds the record.

The last line printed is one JSON object: ``max_error_iter`` (over both plans' iterations), ``max_error_recover``,
``max_error_goodput``, ``scale_run_s``, per job its real and simulated figures, and each round's constants.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

if TYPE_CHECKING:
    from ftlab.runtime.processes.profiler import HostLoad

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO / ".ftlab" / "cache"
HOST_SWEEPS = 3
"""Sweeps of ``cores_by_load`` before and after each real job, each number's median kept: one sweep varies from the
next by several percent on a shared machine."""
STEPS, KILL_AT = 50, 22
"""A job's steps, and the step in whose reduction a job with a fault loses its node: 22 iterations of the first
plan (20 after the warm-up) and some 28 of the last. The median of a plan's iterations is what a round compares, and
a shared machine's load moves within seconds, so a plan needs enough iterations that its median does not fall on
one slow stretch; longer jobs do not make the rounds agree, since the load moves from minute to minute as well
(hence ``--rounds``)."""
SMOKE_STEPS, SMOKE_KILL_AT = 14, 8


def kill(node: int, at_step: int) -> str:
    """A job's fault schedule as an override: ``node`` killed in step ``at_step``'s reduction."""
    return f"faults.events=[{{kind: node, node: {node}, at_step: {at_step}, phase: reduce}}]"


def jobs(kill_at: int) -> dict[str, list[str]]:
    """The validation jobs, a fault (where the job has one) in step ``kill_at``'s reduction."""
    return {
        "fault-free": ["policy=none", "cluster=local-4", "train.stages=2"],
        "oobleck": ["policy=oobleck", "policy.fault_threshold=1", "cluster=local-6", "cluster.device_memory_gb=0.04",
                    "faults=explicit", kill(3, kill_at)],
        "checkpoint_restart": ["policy=checkpoint_restart", "protection=storage", "protection.every=5",
                               "cluster=local-4", "faults=explicit", kill(1, kill_at)],
        "recycle_reft": ["policy=recycle", "protection=reft", "cluster=local-4", "train.stages=2", "faults=explicit",
                         kill(1, kill_at)],
    }  # fmt: skip


DIAGNOSIS: dict[str, list[str]] = {
    "depth-4x1": ["policy=none", "cluster=local-4", "train.stages=1"],
    "depth-1x4": ["policy=none", "cluster=local-4", "train.stages=4"],
}
"""Jobs ``--jobs`` runs only when named (module docstring)."""

SCALE = [
    "model=llama2-6.7b", "cluster=a100-125x8", "policy=oobleck", "train.activation_checkpointing=true",
    "train.global_batch=1024", "train.micro_batch=2", "train.steps=100000000", "sim.horizon_s=43200",
    "faults=trace", "faults.trace=p3", "faults.trace_copies=4", "faults.trace_s_per_step=null", "faults.time_compression=1",
]  # fmt: skip


def figures(result: Any) -> dict[str, float | None]:  # noqa: ANN401 - a JobResult
    s = result.summary
    recovered = [f.recover_s for f in result.faults if f.recover_s is not None]
    last = result.plans[-1].generation
    after = [step.iter_s for step in result.steps if step.generation == last] if len(result.plans) > 1 else []
    return {
        "iter_s": s["summary/median_iter_s"],
        "iter_after_s": statistics.median(after) if after else None,
        "recover_s": sum(recovered) if recovered else None,
        "goodput": s["summary/goodput_ratio"],
    }


def error(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return abs(sim - real) / abs(real)


def first_plan(overrides: list[str]) -> tuple[Any, Any]:
    """The simulated job's config and first plan: the real run's first plan too (the same policy code plans it)."""
    from ftlab.experiments.job import compose_config
    from ftlab.experiments.simulate import simulate

    cfg = OmegaConf.to_object(compose_config([*overrides, "mode=simulate"]))
    return cfg, simulate(cfg).result.plans[0]


def workers_share(cfg: Any, plan: Any) -> HostLoad:  # noqa: ANN401
    """What the workers of ``plan`` (of the job ``cfg``) get computing side by side now, one to all of them at once
    (``runtime.processes.profiler.cores_by_load``, ``HOST_SWEEPS`` sweeps)."""
    from ftlab.runtime.processes.profiler import cores_by_load

    ranges = list(plan.layer_ranges().values())
    m = cfg.model
    return cores_by_load(m, ranges, cfg.train.micro_batch, m.seq_len, cfg.cluster.threads_per_worker,
                         sweeps=HOST_SWEEPS)  # fmt: skip


def charged_rates(cfg: Any, plan: Any) -> tuple[float, ...]:  # noqa: ANN401
    """Micro-batches a second the simulation charges each worker of ``plan`` for a forward and a backward pass over
    its layers on a core of its own: the job's profile and the runtime's own cost per layer of each
    (``sim.layer_overhead_s``)."""
    from ftlab.experiments.job import job_profile
    from ftlab.runtime.core.costs import CostModel
    from ftlab.runtime.sim.timing import compute_charge_s

    costs, overhead = CostModel(job_profile(cfg)[0]), cfg.sim.layer_overhead_s
    return tuple(1 / compute_charge_s(costs, overhead, start, stop) for start, stop in plan.layer_ranges().values())


@dataclass(frozen=True)
class MeasuredHost:
    """What a job's workers get of this host, measured beside it, as its simulation takes it."""

    by_load: tuple[float, ...]
    """``sim.host_cores_by_load``: the cores' worth by number computing at once, against each process alone."""
    layer_speed: tuple[float, ...]
    """``sim.host_layer_speed``: how fast each layer is computed against its charge."""


def measured_host(cfg: Any, plan: Any, *loads: HostLoad) -> MeasuredHost:  # noqa: ANN401
    """The host for the simulation of ``cfg`` from ``loads`` (``workers_share`` of ``plan``'s workers), their mean:

    - the cores' worth by number at once, each process counted against its own rate alone (``HostLoad.worth``):
      what computing side by side costs;
    - each layer's speed: the rate alone of the processes computing it over the rate the simulation charges their
      layers (``charged_rates``): the machine's speed now against the profile's, whatever load the profile met,
      and what computing a stage costs beyond its layers timed one by one.

    The two are kept apart because the stages of one plan compute at different speeds against their charges (the
    first stage of a 2 x 2 grid, with the embedding, faster than the second, with the output head): one speed for
    the whole host would misprice a plan whose slowest worker runs one stage alone (ReCycle's after a kill), and
    would run copies, messages and all-reduces, whose costs are measured constants of their own, at one stage's
    speed."""
    charged = charged_rates(cfg, plan)
    speeds = [statistics.fmean(load.alone[i] / charged[i] for load in loads) for i in range(len(charged))]
    ranges = list(plan.layer_ranges().values())
    layer_speed = tuple(
        statistics.fmean(speed for speed, (start, stop) in zip(speeds, ranges, strict=True) if start <= layer < stop)
        for layer in range(plan.num_layers)
    )  # fmt: skip
    by_load = tuple(statistics.fmean(column) for column in zip(*(load.worth for load in loads), strict=True))
    return MeasuredHost(by_load, layer_speed)


def host_overrides(host: MeasuredHost) -> list[str]:
    """The simulator's host as measured by ``workers_share``: the cores this process may run on, the cores' worth
    per number computing at once (past the workers' number, the copies beside them on a host with spare cores:
    ``shared_host.HostCores.worth``) and each layer's speed."""
    cores = len(os.sched_getaffinity(0))

    def listed(values: tuple[float, ...]) -> str:
        return f"[{','.join(f'{v:.3f}' for v in values)}]"

    return [f"sim.host_cores={cores}", f"sim.host_cores_by_load={listed(host.by_load)}",
            f"sim.host_layer_speed={listed(host.layer_speed)}"]  # fmt: skip


Paired = tuple[dict[str, float | None], dict[str, float | None], MeasuredHost | None]
"""A round of a job: its real figures, its simulated figures, and the host simulated."""


def validate(
    steps: int, kill_at: int, scratch: Path, measure_cores: bool, measure_constants: bool, rounds: int,
    names: list[str],
) -> tuple[dict[str, Any], list[list[str]]]:
    """Each job of ``names`` ``rounds`` times for real, each round simulated on the constants measured before it and
    the cores measured beside each job; per job and measure, the median of the real rounds against the median of
    the simulated ones; and each round's constants."""
    catalogue = {**jobs(kill_at), **DIAGNOSIS}
    rounds_of: dict[str, list[Paired]] = {name: [] for name in names}
    constants = []
    for _ in range(rounds):
        constants.append(round_constants(scratch) if measure_constants else [])
        for name in names:
            rounds_of[name].append(pair(name, catalogue[name], steps, scratch, measure_cores, constants[-1]))
    out: dict[str, Any] = {}
    for name, paired in rounds_of.items():
        real = {m: _median([r[m] for r, _, _ in paired]) for m in paired[0][0]}
        sim = {m: _median([s[m] for _, s, _ in paired]) for m in paired[0][1]}
        errors = {measure: error(sim[measure], real[measure]) for measure in real}
        out[name] = {"real": real, "sim": sim, "error": errors, "host": [c and asdict(c) for _, _, c in paired],
                     "rounds": [{"real": r, "sim": s} for r, s, _ in paired]}  # fmt: skip
        print(f"[{name}] " + "  ".join(
            f"{m}: real {_fmt(real[m])} sim {_fmt(sim[m])} error {_pct(errors[m])}" for m in real
        ), flush=True)  # fmt: skip
    return out, constants


def round_constants(scratch: Path) -> list[str]:
    """The constants of the machinery measured now (``measure_sim_constants.measure_unspoiled``: one run, another
    where the machine's drift spoiled one), as the overrides of a round's simulations; but ``host_cores``, which
    the cores measured beside each job give."""
    from ftlab.experiments.measure_sim_constants import measure_unspoiled

    print("[constants] measuring ...", flush=True)
    values = measure_unspoiled(round_cache(Path(tempfile.mkdtemp(prefix="constants-", dir=scratch))))
    overrides = [f"sim.{name}={value:.6g}" for name, value in values.items() if name != "host_cores"]
    print(f"[constants] {' '.join(overrides)}", flush=True)
    return overrides


def pair(
    name: str, overrides: list[str], steps: int, scratch: Path, measure_cores: bool, constants: list[str]
) -> Paired:
    """One real run of a job and its simulation on ``constants`` (overrides of ``sim``) and the cores measured beside
    it."""
    from ftlab.experiments.job import compose_config, job_profile, run_job
    from ftlab.experiments.simulate import simulate

    d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=scratch))
    common = [
        "experiment=plain", f"train.steps={steps}", f"train.cache_dir={round_cache(d)}", "progress=false",
        f"tracking.uri=sqlite:///{d}/mlflow.db", f"train.checkpoint_dir={d}/checkpoints",
    ]  # fmt: skip
    sim_cfg, first = first_plan([*common, *overrides, *constants])  # the round's profile is measured here
    before = workers_share(sim_cfg, first) if measure_cores else None
    job_profile(sim_cfg, again=True)  # the fastest of two profiles, the cores' worth measured between them
    # The profile kept may plan other stages (Oobleck's pipelines of two stages or three): the real run's.
    sim_cfg, kept = first_plan([*common, *overrides, *constants])
    if kept.layer_ranges() != first.layer_ranges():
        first, before = kept, (workers_share(sim_cfg, kept) if measure_cores else None)
    print(f"[{name}] real ...", flush=True)
    real = figures(run_job(compose_config([*common, *overrides])))
    # The machine's load drifts over the job: the mean of what its workers could have before and after it.
    cores = None if before is None else measured_host(sim_cfg, first, before, workers_share(sim_cfg, first))
    given = [] if cores is None else host_overrides(cores)
    print(f"[{name}] simulated ({' '.join(given) or 'cores as measured'}) ...", flush=True)
    simulated = compose_config([*common, *overrides, "mode=simulate", *constants, *given])
    sim = figures(simulate(OmegaConf.to_object(simulated)).result)
    print(f"[{name}]   round: " + "  ".join(f"{m} real {_fmt(real[m])} sim {_fmt(sim[m])}" for m in real), flush=True)
    return real, sim, cores


def round_cache(d: Path) -> Path:
    """A cache for one round under ``d``: the tokens of ``CACHE_DIR`` and no profile, so that the round measures its
    layers afresh (its simulation first, the real run then reads the same): profiles taken hours apart can differ by
    more than the targets."""
    cache = d / "cache"
    cache.mkdir()
    for tokens in CACHE_DIR.glob("tokens-*"):
        shutil.copy(tokens, cache)
    return cache


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def scale(record: bool, scratch: Path) -> dict[str, float]:
    from ftlab.experiments.job import compose_config
    from ftlab.experiments.simulate import simulate, simulate_job

    overrides = ["experiment=plain", "mode=simulate", "progress=false", *SCALE]
    cfg = OmegaConf.to_object(compose_config(overrides))
    started = time.perf_counter()
    simulated = simulate(cfg)
    seconds = time.perf_counter() - started
    result = simulated.result
    print(
        f"[scale] 12 h of llama2-6.7b on 1,000 A100s under Oobleck and the P3 trace x4: simulated in {seconds:.2f} s; "
        f"{len({s.step for s in result.steps})} steps, {len(result.plans)} plans, "
        f"{sum(f.noticed_at is not None for f in result.faults)} failures, "
        f"goodput {result.summary['summary/goodput_ratio']:.3f}, {simulated.components} distinct pipelines run",
        flush=True,
    )
    out = {"scale_run_s": seconds, "scale_steps": float(len(result.steps)), "scale_plans": float(len(result.plans))}
    if record:
        started = time.perf_counter()
        simulate_job(compose_config([*overrides, f"tracking.uri=sqlite:///{scratch}/scale.db"]))
        out["scale_record_s"] = time.perf_counter() - started
        print(f"[scale] with its MLflow record: {out['scale_record_s']:.2f} s", flush=True)
    return out


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_STEPS} steps a job instead of {STEPS}, a kill in step {SMOKE_KILL_AT}")
    parser.add_argument("--no-real", action="store_true", help="skip the validation jobs")
    parser.add_argument("--no-record", action="store_true", help="time the scale run without its MLflow record")
    parser.add_argument("--cores-as-measured", action="store_true", help="use conf/sim/measured.yaml's host_cores")
    parser.add_argument("--constants-as-measured", action="store_true",
                        help="use conf/sim/measured.yaml's constants instead of measuring them each round")
    parser.add_argument("--rounds", type=int, default=1, help="run each real job this many times: medians compared")
    validation = list(jobs(KILL_AT))
    parser.add_argument("--jobs", nargs="+", choices=[*validation, *DIAGNOSIS], default=validation,
                        help="the jobs to run: validation jobs, or the diagnosis jobs (module docstring)")
    parser.add_argument("--write-docs", action="store_true", help="write the tables into docs/results.md")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    scratch = Path(tempfile.mkdtemp(prefix="ftlab-bench-sim-"))
    steps, kill_at = (SMOKE_STEPS, SMOKE_KILL_AT) if args.smoke else (STEPS, KILL_AT)
    validated, constants = ({}, []) if args.no_real else validate(
        steps, kill_at, scratch, not args.cores_as_measured, not args.constants_as_measured, args.rounds, args.jobs
    )
    speed = scale(not args.no_record, scratch)

    def worst(*measures: str) -> float | None:
        found = [j["error"][m] for j in validated.values() for m in measures if j["error"][m] is not None]
        return max(found) if found else None

    summary = {
        "max_error_iter": worst("iter_s", "iter_after_s"),
        "max_error_recover": worst("recover_s"),
        "max_error_goodput": worst("goodput"),
        **speed,
        "jobs": validated,
        "constants": constants,
    }
    print(json.dumps(summary))
    sys.stdout.flush()
    if args.write_docs:
        from ftlab.experiments import results_doc

        if validated:
            results_doc.write_section("bench_simulator", "The simulator against the real runtime", {
                f"Median of {args.rounds} real round(s) against the median of their simulations, {steps} steps a job "
                f"(iteration of the first plan and of the last, recovery, goodput ratio)": {
                    job: {f"{m} {k}": j[k][m] for m in j["real"] for k in ("real", "sim", "error")}
                    for job, j in validated.items()},
                "": {k: v for k, v in summary.items() if k.startswith("max_error")},
            })  # fmt: skip
        results_doc.write_section("bench_simulator_scale", "Simulating 12 hours of 1,000 GPUs", {
            "12 h of llama2-6.7b on 125 nodes of 8 A100s under Oobleck, the P3 trace x4: wall seconds to simulate it "
            "(with its MLflow record: scale_record_s), steps and plans simulated": speed,
        }, module="bench_simulator")  # fmt: skip


if __name__ == "__main__":
    main()
