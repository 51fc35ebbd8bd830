"""In-place recovery (Oobleck, ReCycle) against checkpoint-restart, side by side on the same job and the same faults.

    .venv/bin/python -m ftlab.experiments.bench_recovery                     # all three parts
    .venv/bin/python -m ftlab.experiments.bench_recovery --no-table2 --no-sweep   # part 1 only
    .venv/bin/python -m ftlab.experiments.bench_recovery --kills 1@8,4@14 --steps 20 --table2-every-steps 33,16,8
    .venv/bin/python -m ftlab.experiments.bench_recovery --steps 12 --kills 1@4,4@8 --no-table2 --sweep-steps 10  # smoke

Part 1, recovery comparison. One job (gpt2-tiny on ``cluster=local-6`` with ``cluster.device_memory_gb=0.04``, so
Oobleck's pipelines span two nodes and an in-place recovery must copy layers between nodes) runs four times:
- ``policy=none faults=none``: the fault-free reference (its losses are the oracle; policy=none would stop at the
  first failure, so it only runs without faults);
- ``policy=checkpoint_restart protection=storage protection.every=5``, ``policy=oobleck policy.fault_threshold=1``
  and ``policy=recycle`` (2 stages x 3 pipelines; the default kills hit stage 1 and then stage 0) under the same
  explicit node kills (``--kills NODE@STEP,...``, each in ``--kill-phase`` of that step).
With 6 nodes, f = 1 and two-node minimum pipelines, Oobleck recovers in place as long as (f + 1) * n0 = 4 nodes
survive: two kills. A third kill leaves a single pipeline and the policy stops (reported, not hidden).
Printed per policy: detection and recovery times (median, max), committed steps lost, goodput and the fault-scaled
throughput (below); then checks that Oobleck and ReCycle lost no committed step and that the per-step losses (the
last record of each step) equal the fault-free run's within rel 1e-5 (checkpoint-restart's too), and each in-place
policy's recovery speed-up over checkpoint-restart (target >= 10).
The policies are found by their roles (``Roles``), in every part: the restart baseline is every policy that recovers
by restarting from saved state alone (``restarts()``, run with ``protection=storage protection.every=5``), the
in-place ones every policy that recovers in place (``in_place()``); ``SETTINGS`` holds what a policy runs with beyond
its defaults. A new policy package joins the bench with no edit here: ``varuna`` runs beside checkpoint-restart as a
restart baseline, ``bamboo`` and ``elastic`` beside Oobleck and ReCycle as in-place policies (Bamboo with
``DEVICE_MEMORY_GB`` for each stage's state it holds: ``Roles.state_copies``).

Fault-scaled throughput (ReCycle's measure): for every plan that ran after a failure, its samples/s (global batch
over its median commit-to-commit interval, so the recovery itself is left out) over the fault-free samples/s scaled
by the surviving workers: ``measured / (fault-free x surviving / all)``, the fault-free rate being the same job's
before its first failure (same run, same machine load). 1.0 means the survivors train as fast as their share of the
fault-free cluster. A policy's figure is the median over its plans after failures. On a host with fewer cores than
workers (this one: 2 cores, 6-8 workers) a failure also frees CPU for the survivors, so figures above 1 are expected
there; on one device per worker they are not. For ReCycle
the bench also sets the planner's predicted iteration time (``predicted_iter_s`` of each decision, from the job's
cost model) beside the measured one: the absolute error (the cost model is profiled on an idle machine, the job runs
six workers on two cores) and the error of the predicted slowdown over the fault-free plan.

The first faulted step's kills fire in the ``reduce`` phase by default, where every survivor has finished its
point-to-point work with the victim, so the figures compare the policies rather than where in the pipeline a kill
lands. ``--kill-phase backward`` kills mid-pipeline, where survivors also see the victim's closed connections in their
sends and receives; the runtime recovers from that as well (``tests/test_recovery.py`` kills a node in every phase).
A later kill fires as its step starts (``explicit_kills``): after a recovery, a policy's plan may give its victim no
work in that phase. Every planned fault must fire: one that did not fails the bench (exit status 1, each named).

Part 2 (``--table2``, on by default), the shape of Oobleck's Table 2 at this machine's scale: average throughput
(``summary/samples_per_s``: committed samples over the whole training time) of the fault-free job, checkpoint-restart,
Oobleck and ReCycle at three failure rates, time-compressed to a node kill every K training steps (K in
``--table2-every-steps``; the table also shows K in seconds of fault-free training), victims drawn with a seed, the
same kills for every policy, at most ``--table2-max-failures`` (2: Oobleck keeps f + 1 pipelines on 6 nodes).
Step-clocked faults are kinder to checkpoint-restart than wall-clock ones: a slow restart does not expose it to more
faults. ``--table2-schedule fixed|exponential`` uses the wall-clock schedules instead (``faults.interval_s`` /
``faults.mtbf_s`` from ``--table2-every-s``); a cell whose job stops shows "stopped" with the reason in the JSON.
The table and a bar plot are saved under ``.ftlab/bench/`` and logged to an MLflow run in the experiment
``ftlab-bench`` (``--bench-tracking-uri``, default the SQLite store ``.ftlab/bench/mlflow.db``).

Part 3 (``--sweep``, on by default), the shape of ReCycle's comparison: throughput with 1, 2 and 4 failed workers
(``--sweep-failures``) for recycle and oobleck on ``cluster=local-8``, the workers killed together; a table and a plot
(samples/s and fault-scaled throughput against failed workers) saved under ``.ftlab/bench/`` and logged to MLflow,
with ReCycle's predicted against measured iteration time per cell (``failed_workers_sweep``).

Each job runs in this process with ``experiments.job.run_job`` and a temporary MLflow store; the token cache and the
profiles live in ``.ftlab/cache`` and are reused between runs. The last line printed is one JSON object keyed by
policy name (``none``, ``checkpoint_restart``, ``oobleck``, ``recycle``: ``recover_s_median``, ``lost_steps``,
``fault_scaled_throughput``, ...), plus ``recovery_speedup`` (checkpoint-restart's median recovery time over
Oobleck's; each in-place policy has its own too), with part 2 ``table2`` and with part 3 ``failed_workers``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftlab.policies import catalog

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / ".ftlab" / "bench"
CACHE_DIR = REPO / ".ftlab" / "cache"
LOSS_RTOL = 1e-5

DEVICE_MEMORY_GB = 0.04
"""A device's memory for one stage's state; a policy gets it for each stage's state it holds (``overrides_of``)."""
JOB = [
    "experiment=plain",  # not the default quick-start preset, whose faults.events would leak into faults=none
    "model=gpt2-tiny",
    "cluster=local-6",
    "train.global_batch=16",
    "train.micro_batch=2",
]
JOB_WORKERS, JOB_BATCH = 6, 16
SWEEP_JOB = [*JOB[:2], "cluster=local-8", *JOB[3:]]
SWEEP_WORKERS, SWEEP_BATCH = 8, 16
RESTART_PROTECTION = ["protection=storage", "protection.every=5"]
"""What the restart baseline restarts from."""
SETTINGS = {"oobleck": ["policy.fault_threshold=1"]}
"""Settings a policy runs with here beyond its defaults (which policies run is what their roles say)."""
LATER_PARTS = ("table2", "failed_workers")
"""The report's keys of parts 2 and 3, whose entries are lists of cells beside part 1's policies."""


def restarts() -> tuple[str, ...]:
    """The baseline: every policy found that recovers by restarting from saved state alone (checkpoint-restart)."""
    return catalog.policies_with(lambda roles: roles.restarts_only)


def in_place() -> tuple[str, ...]:
    """Every policy found that recovers without a restart (Oobleck, ReCycle): they must lose no committed step."""
    return catalog.policies_with(lambda roles: roles.in_place and not roles.chooses)


def compared() -> tuple[str, ...]:
    """Every policy the bench runs under faults, the baseline first."""
    return (*restarts(), *in_place())


def overrides_of(policy: str) -> list[str]:
    """``policy=NAME`` with what it runs with here: the baseline checkpoints to storage, a device holds each stage's
    state the policy keeps, ``SETTINGS`` the rest."""
    saved = RESTART_PROTECTION if policy in restarts() else []
    return [f"policy={policy}", *saved, catalog.device_memory(policy, DEVICE_MEMORY_GB), *SETTINGS.get(policy, [])]


@dataclass
class Outcome:
    """One job: its result, or why it did not finish."""

    policy: str
    label: str
    wall_s: float
    result: Any = None  # experiments.job.JobResult
    error: str | None = None
    faults: list[dict[str, Any]] = field(default_factory=list)
    store: Path | None = None
    """The job's MLflow store directory (its events.jsonl is read for the planner's predictions)."""

    @property
    def ok(self) -> bool:
        return self.result is not None

    @property
    def unfired(self) -> list[str]:
        """The planned faults the job did not fire, with the reasons: each fails the bench."""
        return self.result.unfired if self.ok else []


def run_one(policy: str, label: str, overrides: list[str], scratch: Path, job: list[str] = JOB) -> Outcome:
    """Run one job in this process; a job that stops (JobStopped) or crashes is reported, not raised."""
    from ftlab.experiments.job import compose_config, run_job

    d = Path(tempfile.mkdtemp(prefix=f"{policy}-", dir=scratch))
    common = [
        f"tracking.uri=sqlite:///{d}/mlflow.db",
        f"train.cache_dir={CACHE_DIR}",
        f"train.checkpoint_dir={d}/checkpoints",
        "progress=false",
    ]
    print(f"  [{label}] {policy}: {' '.join(overrides)}", flush=True)
    started = time.monotonic()
    try:
        result = run_job(compose_config([*common, *job, *overrides_of(policy), *overrides]))
    except Exception as exc:  # noqa: BLE001 - JobStopped, ClusterError, a runtime bug: all are findings to report
        wall = time.monotonic() - started
        reason = f"{type(exc).__name__}: {exc}"
        print(f"  [{label}] {policy}: did not finish after {wall:.1f} s: {reason.splitlines()[0]}", flush=True)
        if type(exc).__name__ != "JobStopped":
            traceback.print_exc()
        return Outcome(policy, label, wall, error=reason, store=d)
    wall = time.monotonic() - started
    faults = [
        {
            "kind": f.kind,
            "workers": sorted(f.workers),
            "detect_s": f.detect_s,
            "recover_s": f.recover_s,
            "lost_steps": f.lost_steps,
            "transfer_bytes": f.transfer_bytes,
        }
        for f in result.faults
    ]
    s = result.summary
    print(
        f"  [{label}] {policy}: {wall:.1f} s, {len(faults)} faults, {s['summary/samples_per_s']:.2f} samples/s, "
        f"goodput {s['summary/goodput_ratio']:.3f}",
        flush=True,
    )
    if result.unfired:
        print(f"  [{label}] {policy}: planned faults that never fired: {'; '.join(result.unfired)}", flush=True)
    return Outcome(policy, label, wall, result, None, faults, store=d)


def losses_by_step(result: Any) -> dict[int, float]:
    """The loss of each step as finally committed: a step re-run after a restart counts once, the last time."""
    by_step: dict[int, float] = {}
    for record in result.steps:
        by_step[record.step] = record.loss
    return by_step


def plan_intervals(result: Any) -> dict[int, list[float]]:
    """Per plan generation, the commit-to-commit intervals of its steps. A plan's first step also carries the
    recovery that configured it, so it only opens the first interval."""
    steps: dict[int, list[Any]] = {}
    for record in result.steps:
        steps.setdefault(record.generation, []).append(record)
    return {g: [b.at - a.at for a, b in zip(rs, rs[1:])] for g, rs in steps.items() if len(rs) > 1}


def fault_free_rate(result: Any) -> float | None:
    """Samples/s of the job's first plan: global batch / its median commit-to-commit interval."""
    first = result.plans[0]
    intervals = plan_intervals(result).get(first.generation)
    return first.global_batch / statistics.median(intervals) if intervals else None


def fault_scaled(outcome: Outcome, free_rate: float | None, all_workers: int) -> list[dict[str, Any]]:
    """For every plan that ran after a failure: its samples/s, the workers failed by then, and its fault-scaled
    throughput = samples/s / (fault-free samples/s x surviving workers / all workers) (ReCycle's measure).

    The fault-free rate is the job's own before its first failure when it ran long enough to measure one (the same
    run, so the same machine load), else ``free_rate`` (the fault-free reference job's)."""
    if not outcome.ok:
        return []
    result = outcome.result
    free_rate = fault_free_rate(result) or free_rate
    if not free_rate:
        return []
    fired = sorted(
        ((f.fired_at if f.fired_at is not None else f.noticed_at, f.workers) for f in result.faults if f.noticed_at),
        key=lambda x: x[0],
    )
    first_at = {}
    for record in result.steps:
        first_at.setdefault(record.generation, record.at - record.iter_s)
    windows = []
    for generation, intervals in plan_intervals(result).items():
        if generation == result.plans[0].generation:
            continue
        failed = set().union(*(workers for at, workers in fired if at <= first_at[generation]))
        rate = result.plans[0].global_batch / statistics.median(intervals)
        surviving = all_workers - len(failed)
        windows.append({
            "generation": generation, "failed_workers": len(failed), "steps": len(intervals) + 1,
            "samples_per_s": rate, "fault_scaled_throughput": rate / (free_rate * surviving / all_workers),
        })  # fmt: skip
    return windows


def predictions(outcome: Outcome, free_iter_s: float | None) -> list[dict[str, Any]]:
    """The planner's predicted iteration time of every plan a decision after a failure made (``predicted_iter_s``
    in the decision's details, from the job's cost model) against the measured median commit-to-commit interval;
    also the predicted and measured slowdown over the fault-free plan (less sensitive to a profile measured on an
    idle machine than the absolute times)."""
    if not outcome.ok or outcome.store is None:
        return []
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{outcome.store}/mlflow.db")
    path = Path(client.download_artifacts(outcome.result.run_id, "events.jsonl", str(outcome.store)))
    decided = [json.loads(line) for line in path.read_text().splitlines()]
    measured = plan_intervals(outcome.result)
    out = []
    for event in decided:
        details = event.get("details") or {}
        generation = event.get("generation")
        if event["kind"] != "recovery_decision" or "predicted_iter_s" not in details or generation not in measured:
            continue
        predicted, iter_s = details["predicted_iter_s"], statistics.median(measured[generation])
        row = {"generation": generation, "failed": details.get("failed"), "method": details.get("method"),
               "predicted_iter_s": predicted, "measured_iter_s": iter_s, "error": iter_s / predicted - 1}  # fmt: skip
        if free_iter_s and details.get("fault_free_iter_s"):
            row["predicted_slowdown"] = predicted / details["fault_free_iter_s"]
            row["measured_slowdown"] = iter_s / free_iter_s
            row["slowdown_error"] = row["measured_slowdown"] / row["predicted_slowdown"] - 1
        out.append(row)
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _max(values: list[float]) -> float | None:
    return max(values) if values else None


def figures(outcome: Outcome) -> dict[str, Any]:
    """The JSON entry of one policy in part 1."""
    if not outcome.ok:
        return {"error": outcome.error, "wall_s": outcome.wall_s}
    detect = [f["detect_s"] for f in outcome.faults if f["detect_s"] is not None]
    recover = [f["recover_s"] for f in outcome.faults if f["recover_s"] is not None]
    lost = [f["lost_steps"] for f in outcome.faults if f["lost_steps"] is not None]
    s = outcome.result.summary
    return {
        "failures": len(outcome.faults),
        "detect_s_median": _median(detect),
        "detect_s_max": _max(detect),
        "recover_s_median": _median(recover),
        "recover_s_max": _max(recover),
        "recover_s": recover,
        "lost_steps": sum(lost),
        "transfer_bytes": sum(f["transfer_bytes"] for f in outcome.faults),
        "goodput_ratio": s["summary/goodput_ratio"],
        "samples_per_s": s["summary/samples_per_s"],
        "median_iter_s": s["summary/median_iter_s"],
        "final_loss": s["summary/final_loss"],
        "wall_s": outcome.wall_s,
        **({"unfired": outcome.unfired} if outcome.unfired else {}),
    }


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


# -- part 1 ----------------------------------------------------------------------------------------------------------


def parse_kills(text: str) -> list[tuple[int, int]]:
    kills = []
    for item in text.split(","):
        node, _, step = item.strip().partition("@")
        kills.append((int(node), int(step)))
    return kills


def recovery_comparison(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    kills = parse_kills(args.kills)
    faults = explicit_kills(kills, args.kill_phase)
    steps = [f"train.steps={args.steps}"]
    print(f"Part 1: recovery comparison, {args.steps} steps, node kills (node, step) {kills}, phase {args.kill_phase}",
          flush=True)  # fmt: skip
    runs = {"none": run_one("none", "part1", [*steps, "faults=none"], scratch)}
    for policy in compared():
        runs[policy] = run_one(policy, "part1", [*steps, *faults], scratch)
    report = {name: figures(outcome) for name, outcome in runs.items()}
    free_rate = fault_free_rate(runs["none"].result) if runs["none"].ok else None
    workers = JOB_WORKERS
    for name, outcome in runs.items():
        if name == "none" or "error" in report[name]:
            continue
        windows = fault_scaled(outcome, free_rate, workers)
        report[name]["fault_scaled_windows"] = windows
        # Each window is scaled by its own surviving workers, so windows after one and after two failures compare.
        report[name]["fault_scaled_throughput"] = _median([w["fault_scaled_throughput"] for w in windows])
    for name in in_place():  # a policy that predicts its plans' iteration times (ReCycle) is measured against them
        predicted = predictions(runs[name], free_rate and JOB_BATCH / free_rate)
        if predicted:
            report[name]["predictions"] = predicted

    print()
    print(f"{'policy':<20}{'faults':>7}{'detect med':>12}{'detect max':>12}{'recover med':>13}{'recover max':>13}"
          f"{'lost steps':>12}{'goodput':>9}{'samples/s':>11}{'MB copied':>11}{'fault-scaled':>14}")  # fmt: skip
    for name, r in report.items():
        if "error" in r:
            print(f"{name:<20}did not finish: {r['error'].splitlines()[0]}")
            continue
        print(
            f"{name:<20}{r['failures']:>7}{_fmt(r['detect_s_median']):>12}{_fmt(r['detect_s_max']):>12}"
            f"{_fmt(r['recover_s_median']):>13}{_fmt(r['recover_s_max']):>13}{r['lost_steps']:>12}"
            f"{r['goodput_ratio']:>9.3f}{r['samples_per_s']:>11.2f}{r['transfer_bytes'] / 1e6:>11.2f}"
            f"{_fmt(r.get('fault_scaled_throughput')):>14}"
        )
    for name, row in ((n, row) for n in in_place() for row in report[n].get("predictions", [])):
        print(f"{name} plan {row['generation']} (failed {row['failed']}, {row['method']}): predicted "
              f"{row['predicted_iter_s']:.3f} s, measured {row['measured_iter_s']:.3f} s ({row['error']:+.0%}); "
              f"slowdown over fault-free predicted {_fmt(row.get('predicted_slowdown'))}x, measured "
              f"{_fmt(row.get('measured_slowdown'))}x")  # fmt: skip

    # Checks: the oracle of correctness is the fault-free loss curve.
    reference = losses_by_step(runs["none"].result) if runs["none"].ok else None
    for name in compared():
        outcome, r = runs[name], report[name]
        if not outcome.ok or reference is None:
            continue
        losses = losses_by_step(outcome.result)
        complete = sorted(losses) == list(range(args.steps))
        worst = max(
            (abs(losses[s] - reference[s]) / abs(reference[s]) for s in reference if s in losses), default=math.inf
        )
        r["all_steps_committed"] = complete
        r["loss_max_rel_diff"] = worst
        r["losses_match_fault_free"] = complete and worst <= LOSS_RTOL
        print(
            f"check {name}: every step committed: {complete}; per-step loss vs fault-free: max rel diff "
            f"{worst:.2e} -> {'OK' if r['losses_match_fault_free'] else 'MISMATCH'} (rtol {LOSS_RTOL:g})"
        )
    for name in in_place():
        r = report[name]
        if "error" in r:
            continue
        unmeasured = [f for f in runs[name].faults if f["lost_steps"] is None]
        r["lost_no_committed_step"] = r["lost_steps"] == 0 and not unmeasured
        print(f"check {name}: lost no committed step: {r['lost_no_committed_step']} "
              f"(lost {r['lost_steps']}, {len(unmeasured)} faults unmeasured)")  # fmt: skip
    baseline = next(iter(restarts()), None)
    cr = report[baseline] if baseline else {}
    for name in in_place():
        speedup = None
        if report[name].get("recover_s_median") and cr.get("recover_s_median"):
            speedup = cr["recover_s_median"] / report[name]["recover_s_median"]
            print(f"recovery speedup ({baseline} median / {name} median): {speedup:.1f}x (target >= 10)")
        report[name]["recovery_speedup"] = speedup
    report["recovery_speedup"] = report.get("oobleck", {}).get("recovery_speedup")
    return report


# -- part 3: throughput with failed workers ----------------------------------------------------------------------


def failed_workers_sweep(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """ReCycle's comparison: throughput after 1, 2, 4 failed workers of cluster=local-8, recycle against oobleck.

    The workers die together at ``--sweep-kill-step`` (in ``--kill-phase``), alternately from stage 1 and stage 0 of
    the 2-stage grid (nodes 1, 2, 5, 6), so ReCycle keeps a replica of every stage; each job then trains to
    ``--sweep-steps``. Per cell: samples/s after the recovery, fault-scaled throughput, recovery time, and for
    ReCycle the planner's predicted iteration time against the measured one.
    """
    victims = (1, 2, 5, 6)
    counts = [int(x) for x in args.sweep_failures.split(",")]
    steps = [f"train.steps={args.sweep_steps}"]
    print(f"\nPart 3: throughput with {counts} failed workers on local-8, {args.sweep_steps} steps, kills at step "
          f"{args.sweep_kill_step}", flush=True)  # fmt: skip
    free = run_one("none", "sweep", [*steps, "faults=none"], scratch, SWEEP_JOB)
    free_rate = fault_free_rate(free.result) if free.ok else None
    cells = []
    for k in counts:
        faults = explicit_kills([(n, args.sweep_kill_step) for n in victims[:k]], args.kill_phase)
        for policy in in_place():
            outcome = run_one(policy, f"sweep {k} failed", [*steps, *faults], scratch, SWEEP_JOB)
            cell: dict[str, Any] = {"policy": policy, "failed_workers": k}
            if not outcome.ok:
                cell["error"] = outcome.error
            else:
                windows = fault_scaled(outcome, free_rate, SWEEP_WORKERS)
                last = windows[-1] if windows else {}
                cell.update(
                    samples_per_s=last.get("samples_per_s"), fault_scaled_throughput=last.get("fault_scaled_throughput"),
                    recover_s=_median([f["recover_s"] for f in outcome.faults if f["recover_s"] is not None]),
                    lost_steps=sum(f["lost_steps"] or 0 for f in outcome.faults),
                )  # fmt: skip
                predicted = predictions(outcome, free_rate and SWEEP_BATCH / free_rate)
                if predicted:
                    cell["predictions"] = predicted
                if outcome.unfired:
                    cell["unfired"] = outcome.unfired
            cells.append(cell)
    out = {"fault_free_samples_per_s": free_rate, "steps": args.sweep_steps, "kill_step": args.sweep_kill_step,
           "cells": cells}  # fmt: skip
    table = format_sweep(out)
    print("\n" + table)
    _save_and_log_sweep(out, table, args)
    return out


def format_sweep(out: dict[str, Any]) -> str:
    lines = [f"fault-free: {_fmt(out['fault_free_samples_per_s'], '.2f')} samples/s",
             f"{'policy':<10}{'failed':>7}{'samples/s':>11}{'fault-scaled':>14}{'recover s':>11}{'lost':>6}"
             f"{'predicted s':>13}{'measured s':>12}{'error':>8}"]  # fmt: skip
    for c in out["cells"]:
        if "error" in c:
            lines.append(f"{c['policy']:<10}{c['failed_workers']:>7}  did not finish: {c['error'].splitlines()[0]}")
            continue
        rows = c.get("predictions") or [{}]
        p = rows[-1]
        lines.append(
            f"{c['policy']:<10}{c['failed_workers']:>7}{_fmt(c['samples_per_s'], '.2f'):>11}"
            f"{_fmt(c['fault_scaled_throughput']):>14}{_fmt(c['recover_s'], '.2f'):>11}{c['lost_steps']:>6}"
            f"{_fmt(p.get('predicted_iter_s')):>13}{_fmt(p.get('measured_iter_s')):>12}"
            f"{(format(p['error'], '+.0%') if 'error' in p else '-'):>8}"
        )
    return "\n".join(lines)


def _save_and_log_sweep(out: dict[str, Any], table: str, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stamp = time.strftime("%Y%m%d-%H%M%S")
    plot_path = BENCH_DIR / f"failed-workers-{stamp}.png"
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for policy in dict.fromkeys(c["policy"] for c in out["cells"]):
        cells = [c for c in out["cells"] if c["policy"] == policy and c.get("samples_per_s")]
        xs = [c["failed_workers"] for c in cells]
        left.plot(xs, [c["samples_per_s"] for c in cells], "o-", label=policy)
        right.plot(xs, [c["fault_scaled_throughput"] for c in cells], "o-", label=policy)
    if out["fault_free_samples_per_s"]:
        left.axhline(out["fault_free_samples_per_s"], color="grey", linestyle="--", label="fault-free")
    right.axhline(1.0, color="grey", linestyle="--", label="fault-scaled ideal")
    left.set(xlabel="failed workers (of 8)", ylabel="samples/s after recovery", title="throughput")
    right.set(xlabel="failed workers (of 8)", ylabel="fault-scaled throughput", title="against surviving capacity")
    for ax in (left, right):
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(plot_path, dpi=110)
    plt.close(fig)
    (BENCH_DIR / f"failed-workers-{stamp}.txt").write_text(table + "\n")
    print(f"saved {plot_path.relative_to(REPO)}")
    _log_bench(args, f"failed_workers-{stamp}", {"failed_workers.txt": table, "failed_workers.json": out},
               [plot_path], {f"sweep/{c['policy']}_{c['failed_workers']}_failed/{key}": c[key] for c in out["cells"]
                             for key in ("samples_per_s", "fault_scaled_throughput") if c.get(key) is not None})


def _log_bench(
    args: argparse.Namespace, name: str, texts: dict[str, Any], files: list[Path], metrics: dict[str, float]
) -> None:
    """One MLflow run in the experiment ``ftlab-bench``: texts (JSON for non-strings), files, metrics."""
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=args.bench_tracking_uri)
        experiment = client.get_experiment_by_name("ftlab-bench")
        if experiment is None:
            experiment_id = client.create_experiment("ftlab-bench", artifact_location=(BENCH_DIR / "mlartifacts").as_uri())
        else:
            experiment_id = experiment.experiment_id
        run = client.create_run(experiment_id, run_name=f"bench_recovery-{name}", tags={"bench": "recovery"})
        rid = run.info.run_id
        for file_name, text in texts.items():
            client.log_text(rid, text if isinstance(text, str) else json.dumps(text, indent=1, default=str), file_name)
        for path in files:
            client.log_artifact(rid, str(path))
        for key, value in metrics.items():
            client.log_metric(rid, key, value)
        client.set_terminated(rid)
        print(f"logged to MLflow {args.bench_tracking_uri}, experiment ftlab-bench, run {rid}")
    except Exception as exc:  # noqa: BLE001 - the figures are already saved and printed
        print(f"MLflow logging failed: {type(exc).__name__}: {exc}")


# -- part 2: Table 2 ---------------------------------------------------------------------------------------------------


def step_kills(every: int, steps: int, max_failures: int, seed: int, nodes: int = 6) -> list[tuple[int, int]]:
    """(node, step) of a node kill every ``every`` steps, victims drawn with ``seed`` among the alive nodes.

    The highest alive node is never drawn after the first kill: checkpoint-restart leaves it idle on five nodes (its
    grid takes the lowest workers), where its loss would cost nothing, so the policies would not meet the same
    faults."""
    rng = random.Random(seed)
    alive = list(range(nodes))
    kills = []
    for k in range(1, max_failures + 1):
        if every * k >= steps:
            break
        candidates = alive if k == 1 else alive[:-1]
        node = rng.choice(candidates)
        alive.remove(node)
        kills.append((node, every * k))
    return kills


def explicit_kills(kills: list[tuple[int, int]], phase: str) -> list[str]:
    """``faults=explicit`` with a node kill per (node, step). The kills of the first step they hit wait for
    ``phase``: they meet the first plan, which has every victim in it. A later one fires as its step starts: after a
    recovery, a policy may have left its victim out as a spare or moved it where it has no work in ``phase`` (Varuna
    morphs five nodes into one pipeline, which reduces no gradients), and a kill armed on a phase its target never
    enters would not fire, so the policies would not meet the same faults."""
    first = min((step for _, step in kills), default=None)
    events = ", ".join(
        f"{{kind: node, node: {n}, at_step: {s}" + (f", phase: {phase}}}" if s == first else "}") for n, s in kills
    )
    return ["faults=explicit", f"faults.events=[{events}]"]


def unfired(report: dict[str, Any]) -> list[str]:
    """Every planned fault of the bench's jobs that did not fire, named by its job."""
    entries = [(name, e) for name, e in report.items() if isinstance(e, dict) and name not in LATER_PARTS]
    for part in LATER_PARTS:
        entries += [(f"{part} {c['policy']}", c) for c in (report.get(part) or {}).get("cells", [])]
    return [f"{name}: {fault}" for name, e in entries for fault in e.get("unfired", [])]


def table2(args: argparse.Namespace, scratch: Path, part1: dict[str, Any]) -> dict[str, Any]:
    schedule = args.table2_schedule
    if schedule == "steps":
        every = [float(int(x)) for x in args.table2_every_steps.split(",")]
        unit, what = "steps", f"a node kill every K steps (phase {args.kill_phase})"
    else:
        every = [float(x) for x in args.table2_every_s.split(",")]
        unit, what = "s", f"faults={schedule}, a node fault every K s of training (mean for exponential)"
    steps = [f"train.steps={args.table2_steps}"]
    print(
        f"\nPart 2: Table 2 shape, {args.table2_steps} steps, {what}, K in {every}, at most "
        f"{args.table2_max_failures} failures, seed {args.table2_seed}",
        flush=True,
    )
    free = run_one("none", "table2", [*steps, "faults=none"], scratch)
    free_cell = _cell(free, None)
    iter_s = free.result.summary["summary/median_iter_s"] if free.ok else None
    cells: list[dict[str, Any]] = []
    for k in every:
        if schedule == "steps":
            kills = step_kills(int(k), args.table2_steps, args.table2_max_failures, args.table2_seed)
            faults = explicit_kills(kills, args.kill_phase)
        else:
            key = "faults.interval" if schedule == "fixed" else "faults.mtbf"
            # The shipped configs give their rate in steps; this part of the benchmark wants seconds.
            faults = [f"faults={schedule}", f"{key}_steps=null", f"{key}_s={k}",
                      f"faults.max_failures={args.table2_max_failures}", f"faults.seed={args.table2_seed}"]  # fmt: skip
        for policy in compared():
            outcome = run_one(policy, f"table2 every {k:g} {unit}", [*steps, *faults], scratch)
            cells.append(_cell(outcome, k))

    out = {
        "schedule": schedule,
        "unit": unit,
        "every": every,
        "kill_phase": args.kill_phase if schedule == "steps" else None,
        "fault_free_iter_s": iter_s,
        "steps": args.table2_steps,
        "max_failures": args.table2_max_failures,
        "seed": args.table2_seed,
        "fault_free": free_cell,
        "cells": cells,
    }
    table = format_table2(out)
    print("\n" + table)
    _save_and_log(out, table, args, part1)
    return out


def format_table2(out: dict[str, Any]) -> str:
    """Average samples/s per (policy, rate), with the faults that landed; then ratios, goodput and recovery times."""
    every, unit, free = out["every"], out["unit"], out["fault_free"]

    def column(k: float) -> str:
        approx = f" ~{k * out['fault_free_iter_s']:.0f}s" if unit == "steps" and out["fault_free_iter_s"] else ""
        return f"every {k:g} {unit}{approx}"

    def cell(policy: str, k: float) -> dict[str, Any]:
        return free if policy == "none" else next(c for c in out["cells"] if c["policy"] == policy and c["every"] == k)

    def row(title: str, policy: str, text) -> str:  # noqa: ANN001 - cell -> str
        return f"{title:<36}" + "".join(f"{text(cell(policy, k)):>{width}}" for k in every)

    def number(key: str, spec: str):  # noqa: ANN202
        return lambda c: "-" if c.get(key) is None else format(c[key], spec)

    width = max(18, *(len(column(k)) + 2 for k in every))
    policies = tuple(dict.fromkeys(c["policy"] for c in out["cells"]))
    names = {"none": "fault-free", **{p: p for p in policies}}
    lines = [f"{'samples/s (faults landed)':<36}" + "".join(f"{column(k):>{width}}" for k in every)]
    lines += [row(names[p], p, _cell_text) for p in names]
    for p in policies:
        ok = "samples_per_s" in free
        lines.append(row(f"{p} / fault-free", p, lambda c: f"{c['samples_per_s'] / free['samples_per_s']:.2f}"
                         if ok and "samples_per_s" in c else "-"))  # fmt: skip
    for p in policies:
        lines.append(row(f"{p} goodput_ratio", p, number("goodput_ratio", ".3f")))
    for p in policies:
        lines.append(row(f"{p} recover_s median", p, number("recover_s_median", ".2f")))
    for p in policies:
        lines.append(row(f"{p} lost steps", p, number("lost_steps", "d")))
    return "\n".join(lines)


def _cell(outcome: Outcome, every: float | None) -> dict[str, Any]:
    cell: dict[str, Any] = {"policy": outcome.policy, "every": every, "wall_s": round(outcome.wall_s, 2)}
    if not outcome.ok:
        cell["error"] = outcome.error
        return cell
    s = outcome.result.summary
    recover = [f["recover_s"] for f in outcome.faults if f["recover_s"] is not None]
    cell.update(
        samples_per_s=s["summary/samples_per_s"],
        goodput_ratio=s["summary/goodput_ratio"],
        failures=len(outcome.faults),
        recover_s_median=_median(recover),
        lost_steps=sum(f["lost_steps"] or 0 for f in outcome.faults),
    )
    if outcome.unfired:
        cell["unfired"] = outcome.unfired
    return cell


def _cell_text(cell: dict[str, Any]) -> str:
    if "error" in cell:
        return "stopped"
    return f"{cell['samples_per_s']:.2f} ({cell['failures']})"


def _save_and_log(out: dict[str, Any], table: str, args: argparse.Namespace, part1: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    table_path = BENCH_DIR / f"table2-{stamp}.txt"
    json_path = BENCH_DIR / f"table2-{stamp}.json"
    plot_path = BENCH_DIR / f"table2-{stamp}.png"
    table_path.write_text(table + "\n")
    json_path.write_text(json.dumps(out, indent=1, default=str) + "\n")

    every, unit = out["every"], out["unit"]
    series = {"fault-free": [out["fault_free"]] * len(every)}
    for policy in dict.fromkeys(c["policy"] for c in out["cells"]):
        series[policy] = [next(c for c in out["cells"] if c["policy"] == policy and c["every"] == k) for k in every]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(series)
    for k, (name, cells) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(every))]
        heights = [c.get("samples_per_s", 0.0) for c in cells]
        bars = ax.bar(xs, heights, width, label=name)
        for bar, c in zip(bars, cells):
            note = "stopped" if "error" in c else f"{c['failures']} faults"
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(every)), [f"a fault every {k:g} {unit}" for k in every])
    ax.set_ylabel("average samples/s")
    ax.set_title(f"gpt2-tiny on local-6, {out['steps']} steps, <= {out['max_failures']} node faults ({out['schedule']})")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(plot_path, dpi=110)
    plt.close(fig)
    print(f"saved {table_path.relative_to(REPO)}, {json_path.name}, {plot_path.name}")

    metrics = {}
    for c in [out["fault_free"], *out["cells"]]:
        if "samples_per_s" in c:
            tag = "fault_free" if c["every"] is None else f"{c['policy']}_every_{c['every']:g}{unit}"
            metrics[f"table2/{tag}/samples_per_s"] = c["samples_per_s"]
    _log_bench(args, stamp, {"table2.txt": table + "\n", "table2.json": out, "recovery.json": part1}, [plot_path],
               metrics)  # fmt: skip


# -- main --------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="part 1: training steps")
    parser.add_argument("--kills", default="1@8,4@14", help="part 1: node kills NODE@STEP,... (in --kill-phase)")
    parser.add_argument("--part1", action=argparse.BooleanOptionalAction, default=True, help="run part 1")
    parser.add_argument("--table2", action=argparse.BooleanOptionalAction, default=True, help="run part 2")
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True, help="run part 3")
    parser.add_argument("--sweep-failures", default="1,2,4", help="part 3: failed workers per job")
    parser.add_argument("--sweep-steps", type=int, default=16, help="part 3: training steps")
    parser.add_argument("--sweep-kill-step", type=int, default=4, help="part 3: the step the workers die in")
    parser.add_argument("--table2-steps", type=int, default=40)
    parser.add_argument("--kill-phase", default="reduce",
                        help="phase of the step in which the first faulted step's kills fire")
    parser.add_argument("--table2-schedule", choices=("steps", "fixed", "exponential"), default="steps",
                        help="steps: explicit kills every K steps; fixed/exponential: wall-time schedules")
    parser.add_argument("--table2-every-steps", default="33,16,8", help="steps schedule: K, one per rate")
    parser.add_argument("--table2-every-s", default="16,8,4", help="fixed/exponential: seconds, one per rate")
    parser.add_argument("--table2-max-failures", type=int, default=2)
    parser.add_argument("--table2-seed", type=int, default=0)
    parser.add_argument("--bench-tracking-uri", default=f"sqlite:///{BENCH_DIR}/mlflow.db")
    parser.add_argument("--keep", action="store_true", help="keep the jobs' temporary MLflow stores and checkpoints")
    parser.add_argument("--write-docs", action="store_true", help="write the parts' tables into docs/results.md")
    args = parser.parse_args(argv)

    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="ftlab-bench-recovery-"))
    started = time.monotonic()
    try:
        report = recovery_comparison(args, scratch) if args.part1 else {}
        if args.table2:
            report["table2"] = table2(args, scratch, dict(report))
        if args.sweep:
            report["failed_workers"] = failed_workers_sweep(args, scratch)
    finally:
        if args.keep:
            print(f"job stores kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"total {time.monotonic() - started:.0f} s")
    missed = unfired(report)
    for fault in missed:
        print(f"FAILED: a planned fault never fired, so its scenario was not tested: {fault}")
    print(json.dumps(report, default=str))
    if args.write_docs:
        from ftlab.experiments import results_doc

        parts = {
            "bench_recovery": ("In-place recovery against checkpoint-restart",
                               {p: f for p, f in report.items()
                                if isinstance(f, dict) and p not in LATER_PARTS}),
            "bench_recovery_table2": ("The shape of Oobleck's Table 2 on the local runtime",
                                      report["table2"] and [report["table2"]["fault_free"], *report["table2"]["cells"]]
                                      if "table2" in report else None),
            "bench_recovery_failed_workers": ("Throughput with failed workers: ReCycle against Oobleck",
                                              report.get("failed_workers", {}).get("cells")),
        }  # fmt: skip
        for name, (title, rows) in parts.items():
            if rows:
                results_doc.write_section(name, title, {"": rows}, argv, module="bench_recovery")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
