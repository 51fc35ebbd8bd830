"""In-place recovery (Oobleck) against checkpoint-restart, side by side on the same job and the same faults.

    .venv/bin/python -m ftlab.experiments.bench_recovery                     # both parts
    .venv/bin/python -m ftlab.experiments.bench_recovery --no-table2         # part 1 only
    .venv/bin/python -m ftlab.experiments.bench_recovery --kills 1@8,4@14 --steps 20 --table2-every-steps 33,16,8

Part 1, recovery comparison. One job (gpt2-tiny on ``cluster=local-6`` with ``cluster.device_memory_gb=0.04``, so
Oobleck's pipelines span two nodes and an in-place recovery must copy layers between nodes) runs three times:
- ``policy=none faults=none``: the fault-free reference (its losses are the oracle; policy=none would stop at the
  first failure, so it only runs without faults);
- ``policy=checkpoint_restart protection=storage protection.every=5`` and ``policy=oobleck policy.fault_threshold=1`` under the
  same explicit node kills (``--kills NODE@STEP,...``, each in ``--kill-phase`` of that step).
With 6 nodes, f = 1 and two-node minimum pipelines, Oobleck recovers in place as long as (f + 1) * n0 = 4 nodes
survive: two kills. A third kill leaves a single pipeline and the policy stops (reported, not hidden).
Printed per policy: detection and recovery times (median, max), committed steps lost, goodput; then checks that
Oobleck lost no committed step and that its per-step losses (the last record of each step) equal the fault-free
run's within rel 1e-5 (checkpoint-restart's too).

Kills fire in the ``reduce`` phase by default, where every survivor has finished its point-to-point work with the
victim, so the figures compare the policies rather than where in the pipeline a kill lands. ``--kill-phase backward``
kills mid-pipeline, where survivors also see the victim's closed connections in their sends and receives; the
runtime recovers from that as well (``tests/test_recovery.py`` kills a node in every phase).

Part 2 (``--table2``, on by default), the shape of Oobleck's Table 2 at this machine's scale: average throughput
(``summary/samples_per_s``: committed samples over the whole training time) of the fault-free job, checkpoint-restart
and Oobleck at three failure rates, time-compressed to a node kill every K training steps (K in
``--table2-every-steps``; the table also shows K in seconds of fault-free training), victims drawn with a seed, the
same kills for both policies, at most ``--table2-max-failures`` (2: Oobleck keeps f + 1 pipelines on 6 nodes).
Step-clocked faults are kinder to checkpoint-restart than wall-clock ones: a slow restart does not expose it to more
faults. ``--table2-schedule fixed|exponential`` uses the wall-clock schedules instead (``faults.interval_s`` /
``faults.mtbf_s`` from ``--table2-every-s``); with intervals shorter than a restart (~25 s here) the second fault
lands during checkpoint-restart's worker restart, which the runtime does not survive today (ClusterError from
``Trainer._restart_workers``); such a cell shows "stopped" with the reason in the JSON.
The table and a bar plot are saved under ``.ftlab/bench/`` and logged to an MLflow run in the experiment
``ftlab-bench`` (``--bench-tracking-uri``, default the SQLite store ``.ftlab/bench/mlflow.db``).

Each job runs in this process with ``runtime.launch.run_job`` and a temporary MLflow store; the token cache and the
Oobleck profile live in ``.ftlab/cache`` and are reused between runs. The last line printed is one JSON object keyed
by policy name (``none``, ``checkpoint_restart``, ``oobleck``), plus ``recovery_speedup`` (checkpoint-restart's median
recovery time over Oobleck's) and, with part 2, ``table2``.
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

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / ".ftlab" / "bench"
CACHE_DIR = REPO / ".ftlab" / "cache"
LOSS_RTOL = 1e-5

JOB = [
    "experiment=plain",  # not the default quick-start preset, whose faults.events would leak into faults=none
    "model=gpt2-tiny",
    "cluster=local-6",
    "cluster.device_memory_gb=0.04",
    "train.global_batch=16",
    "train.micro_batch=2",
]
POLICIES = {
    "none": ["policy=none"],
    "checkpoint_restart": ["policy=checkpoint_restart", "protection=storage", "protection.every=5"],
    "oobleck": ["policy=oobleck", "policy.fault_threshold=1"],
}


@dataclass
class Outcome:
    """One job: its result, or why it did not finish."""

    policy: str
    label: str
    wall_s: float
    result: Any = None  # runtime.launch.JobResult
    error: str | None = None
    faults: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result is not None


def run_one(policy: str, label: str, overrides: list[str], scratch: Path) -> Outcome:
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
        result = run_job(compose_config([*common, *JOB, *POLICIES[policy], *overrides]))
    except Exception as exc:  # noqa: BLE001 - JobStopped, ClusterError, a runtime bug: all are findings to report
        wall = time.monotonic() - started
        reason = f"{type(exc).__name__}: {exc}"
        print(f"  [{label}] {policy}: did not finish after {wall:.1f} s: {reason.splitlines()[0]}", flush=True)
        if type(exc).__name__ != "JobStopped":
            traceback.print_exc()
        return Outcome(policy, label, wall, error=reason)
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
    return Outcome(policy, label, wall, result, None, faults)


def losses_by_step(result: Any) -> dict[int, float]:
    """The loss of each step as finally committed: a step re-run after a restart counts once, the last time."""
    by_step: dict[int, float] = {}
    for record in result.steps:
        by_step[record.step] = record.loss
    return by_step


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
    runs = {
        "none": run_one("none", "part1", [*steps, "faults=none"], scratch),
        "checkpoint_restart": run_one("checkpoint_restart", "part1", [*steps, *faults], scratch),
        "oobleck": run_one("oobleck", "part1", [*steps, *faults], scratch),
    }
    report = {name: figures(outcome) for name, outcome in runs.items()}

    print()
    print(f"{'policy':<20}{'faults':>7}{'detect med':>12}{'detect max':>12}{'recover med':>13}{'recover max':>13}"
          f"{'lost steps':>12}{'goodput':>9}{'samples/s':>11}{'MB copied':>11}")  # fmt: skip
    for name, r in report.items():
        if "error" in r:
            print(f"{name:<20}did not finish: {r['error'].splitlines()[0]}")
            continue
        print(
            f"{name:<20}{r['failures']:>7}{_fmt(r['detect_s_median']):>12}{_fmt(r['detect_s_max']):>12}"
            f"{_fmt(r['recover_s_median']):>13}{_fmt(r['recover_s_max']):>13}{r['lost_steps']:>12}"
            f"{r['goodput_ratio']:>9.3f}{r['samples_per_s']:>11.2f}{r['transfer_bytes'] / 1e6:>11.2f}"
        )

    # Checks: the oracle of correctness is the fault-free loss curve.
    reference = losses_by_step(runs["none"].result) if runs["none"].ok else None
    for name in ("oobleck", "checkpoint_restart"):
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
    oob = report["oobleck"]
    if "error" not in oob:
        unmeasured = [f for f in runs["oobleck"].faults if f["lost_steps"] is None]
        oob["lost_no_committed_step"] = oob["lost_steps"] == 0 and not unmeasured
        print(f"check oobleck: lost no committed step: {oob['lost_no_committed_step']} "
              f"(lost {oob['lost_steps']}, {len(unmeasured)} faults unmeasured)")  # fmt: skip
    cr = report["checkpoint_restart"]
    speedup = None
    if oob.get("recover_s_median") and cr.get("recover_s_median"):
        speedup = cr["recover_s_median"] / oob["recover_s_median"]
        print(f"recovery speedup (checkpoint_restart median / oobleck median): {speedup:.1f}x (target >= 10)")
    report["recovery_speedup"] = speedup
    return report


# -- part 2: Table 2 ---------------------------------------------------------------------------------------------------


def step_kills(every: int, steps: int, max_failures: int, seed: int, nodes: int = 6) -> list[tuple[int, int]]:
    """(node, step) of a node kill every ``every`` steps, victims drawn with ``seed`` among the alive nodes.

    The highest alive node is never drawn after the first kill: checkpoint-restart leaves it idle on five nodes (its
    grid takes the lowest workers), and a kill armed on a phase of an idle worker would never fire there, so the two
    policies would not meet the same faults."""
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
    events = ", ".join(f"{{kind: node, node: {n}, at_step: {s}, phase: {phase}}}" for n, s in kills)
    return ["faults=explicit", f"faults.events=[{events}]"]


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
        for policy in ("checkpoint_restart", "oobleck"):
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
    names = {"none": "fault-free", "checkpoint_restart": "checkpoint_restart", "oobleck": "oobleck"}
    lines = [f"{'samples/s (faults landed)':<36}" + "".join(f"{column(k):>{width}}" for k in every)]
    lines += [row(names[p], p, _cell_text) for p in names]
    for p in ("checkpoint_restart", "oobleck"):
        ok = "samples_per_s" in free
        lines.append(row(f"{p} / fault-free", p, lambda c: f"{c['samples_per_s'] / free['samples_per_s']:.2f}"
                         if ok and "samples_per_s" in c else "-"))  # fmt: skip
    for p in ("checkpoint_restart", "oobleck"):
        lines.append(row(f"{p} goodput_ratio", p, number("goodput_ratio", ".3f")))
    for p in ("checkpoint_restart", "oobleck"):
        lines.append(row(f"{p} recover_s median", p, number("recover_s_median", ".2f")))
    for p in ("checkpoint_restart", "oobleck"):
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
    return cell


def _cell_text(cell: dict[str, Any]) -> str:
    if "error" in cell:
        return "stopped"
    return f"{cell['samples_per_s']:.2f} ({cell['failures']})"


def _save_and_log(out: dict[str, Any], table: str, args: argparse.Namespace, part1: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow.tracking import MlflowClient

    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    table_path = BENCH_DIR / f"table2-{stamp}.txt"
    json_path = BENCH_DIR / f"table2-{stamp}.json"
    plot_path = BENCH_DIR / f"table2-{stamp}.png"
    table_path.write_text(table + "\n")
    json_path.write_text(json.dumps(out, indent=1, default=str) + "\n")

    every, unit = out["every"], out["unit"]
    series = {"fault-free": [out["fault_free"]] * len(every)}
    for policy in ("checkpoint_restart", "oobleck"):
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

    try:
        client = MlflowClient(tracking_uri=args.bench_tracking_uri)
        experiment = client.get_experiment_by_name("ftlab-bench")
        if experiment is None:
            experiment_id = client.create_experiment("ftlab-bench", artifact_location=(BENCH_DIR / "mlartifacts").as_uri())
        else:
            experiment_id = experiment.experiment_id
        run = client.create_run(experiment_id, run_name=f"bench_recovery-{stamp}", tags={"bench": "recovery"})
        rid = run.info.run_id
        client.log_text(rid, table + "\n", "table2.txt")
        client.log_text(rid, json.dumps(out, indent=1, default=str), "table2.json")
        client.log_artifact(rid, str(plot_path))
        client.log_text(rid, json.dumps(part1, indent=1, default=str), "recovery.json")
        for c in [out["fault_free"], *out["cells"]]:
            if "samples_per_s" in c:
                tag = "fault_free" if c["every"] is None else f"{c['policy']}_every_{c['every']:g}{unit}"
                client.log_metric(rid, f"table2/{tag}/samples_per_s", c["samples_per_s"])
        client.set_terminated(rid)
        print(f"logged to MLflow {args.bench_tracking_uri}, experiment ftlab-bench, run {rid}")
    except Exception as exc:  # noqa: BLE001 - the figures are already saved and printed
        print(f"MLflow logging failed: {type(exc).__name__}: {exc}")


# -- main --------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="part 1: training steps")
    parser.add_argument("--kills", default="1@8,4@14", help="part 1: node kills NODE@STEP,... (in --kill-phase)")
    parser.add_argument("--part1", action=argparse.BooleanOptionalAction, default=True, help="run part 1")
    parser.add_argument("--table2", action=argparse.BooleanOptionalAction, default=True, help="run part 2")
    parser.add_argument("--table2-steps", type=int, default=40)
    parser.add_argument("--kill-phase", default="reduce", help="phase of the step in which step-armed kills fire")
    parser.add_argument("--table2-schedule", choices=("steps", "fixed", "exponential"), default="steps",
                        help="steps: explicit kills every K steps; fixed/exponential: wall-time schedules")
    parser.add_argument("--table2-every-steps", default="33,16,8", help="steps schedule: K, one per rate")
    parser.add_argument("--table2-every-s", default="16,8,4", help="fixed/exponential: seconds, one per rate")
    parser.add_argument("--table2-max-failures", type=int, default=2)
    parser.add_argument("--table2-seed", type=int, default=0)
    parser.add_argument("--bench-tracking-uri", default=f"sqlite:///{BENCH_DIR}/mlflow.db")
    parser.add_argument("--keep", action="store_true", help="keep the jobs' temporary MLflow stores and checkpoints")
    args = parser.parse_args(argv)

    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="ftlab-bench-recovery-"))
    started = time.monotonic()
    try:
        report = recovery_comparison(args, scratch) if args.part1 else {}
        if args.table2:
            report["table2"] = table2(args, scratch, dict(report))
    finally:
        if args.keep:
            print(f"job stores kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"total {time.monotonic() - started:.0f} s")
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
