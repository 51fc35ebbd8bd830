"""Every recovery policy and ``policy=adaptive`` side by side, on one job under one mixed fault schedule.

    .venv/bin/python -m ftlab.experiments.bench_policies            # the full comparison (local-8, 40 steps)
    .venv/bin/python -m ftlab.experiments.bench_policies --smoke    # local-6, 20 steps: that it runs and prints
    .venv/bin/python -m ftlab.experiments.bench_policies --rounds 3 # each policy three times: its median run

The job: gpt2-tiny, ``train.stages=2``, each device granted 40 MB for each stage's state its policy keeps (80 MB for
Bamboo's own and its neighbour's; so every policy's pipelines have two stages and the schedule's victims sit in
known stages of the 2 x N grid: even workers hold stage 0, odd ones stage 1). The
schedule (explicit, step-clocked, the same kills for every policy):

- a single worker process killed (worker 1, stage 1), in ``--phase`` of its step,
- a node killed (node 2, stage 0),
- a whole-stage loss: the processes of every other stage-1 worker killed, one a step (with worker 1 already gone,
  the last kill leaves no replica of stage 1 in the grid; killed in one step, all but the first would find the
  iteration already aborted),
- a join: a new node (``local-N``'s node N) starts right after the stage is lost and boots beside training; the
  policy gets it at the first iteration boundary after it is up.

Every fault the schedule plans must fire: a fault that did not (its target never entered its phase, or was gone
already) fails the bench, since the scenario it claims to test was not tested. So only the first kill waits for a
phase: it alone meets the grid as planned. The later ones fire as their step starts, wherever their target is then:
after a recovery a policy may have moved a worker, left it out as a spare, or kept it as a stage's last replica,
which has no gradient reduction to be killed in.

Every policy found that recovers runs (``Roles``): each single one (``checkpoint_restart``, ``oobleck``, ``recycle``)
with its best protection, and each that chooses among the others' answers (``policy=adaptive``) with the same:
``protection=reft`` (in-memory snapshots every step, flushed to storage every ``--flush-every`` steps; a restart from
memory loses no committed step where a snapshot survives, and costs less than a restart from storage), overridable with
``--protection``. A job a policy cannot finish is reported with its reason, not hidden.

Printed per policy: goodput (useful samples per second, ``summary/samples_per_s``: every step committed once, over
the training time after warm-up, so detection, pauses, lost steps and slower plans all count), its ratio to the same
run's fault-free iterations, the total pause (``ft/recover_s`` summed over the faults), the lost steps, and for a
policy that predicts (adaptive) the prediction error: per recovery, |predicted - measured| / measured of the pause
(predicted ``ft/predicted_recover_s`` against ``ft/recover_s``) and of the iteration time (``predicted_iter_s``
against the median ``iter_s`` of the plan it chose; a switch at a review counts too), the median over recoveries.
``join_stall_s`` is how long training stood still for the join: from the iteration boundary where the policy got the
node to the start of the next step (the decision and its configuration; the node's start-up runs beside training and
is ``join_boot_s``, with ``steps_while_joining`` committed meanwhile). Its target is the configuration pause alone,
under ``JOIN_STALL_TARGET_S``, not a process start. With ``--rounds N`` every policy runs N times, each round in an
order rotated by one, and the figures are each policy's run of median goodput (every round's goodput beside them):
one run of a policy and the next differ by 5-10% on this shared machine, as much as the policies' own differences on
this schedule. The last line is one JSON object: ``goodput`` and ``join_stall_s`` per policy and
``adaptive_vs_best_single`` (adaptive's goodput over the best single policy's; ``vs_best_single`` has it for every
policy that chooses), with the other figures beside them.

Adaptive predicts for the host in ``sim`` (``Job.machinery``): ``conf/sim/measured.yaml`` holds an idle host's
constants, and this machine is shared. Before each job the bench measures the cores the workers of the job's first
plan get computing their layers side by side now, one to all of them at once (``runtime.processes.profiler.cores_by_load``,
as ``bench_simulator`` does) and gives them to the job (``sim.host_cores_by_load`` and ``sim.host_layer_speed``):
the host the real run meets, measured beside it, not fitted to its result (``--cores-as-measured``: the idle
host's). Run the full comparison on a quiet machine; ``--smoke`` only shows it works.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from ftlab.policies import catalog

JOIN_STALL_TARGET_S = 1.0
"""A join may stop training for its configuration, not for a node's start."""
DEVICE_MEMORY_GB = 0.04
"""A device's memory for one stage's state: two-stage pipelines; a policy gets it for each stage's state it holds."""

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO / ".ftlab" / "cache"


def singles() -> tuple[str, ...]:
    """The single policies: every policy found that recovers on its own, by name."""
    return catalog.policies_with(lambda roles: roles.recovers and not roles.chooses)


def choosers() -> tuple[str, ...]:
    """The policies that recover by choosing among the others' answers (adaptive), each measured against the best
    single policy."""
    return catalog.policies_with(lambda roles: roles.recovers and roles.chooses)


def compared() -> list[str]:
    """Every policy the bench runs, the single ones first."""
    return [*singles(), *choosers()]


def job(nodes: int, steps: int) -> list[str]:
    return ["experiment=plain", "model=gpt2-tiny", f"cluster=local-{nodes}", "train.stages=2",
            "train.global_batch=16", "train.micro_batch=2", f"train.steps={steps}"]  # fmt: skip


def schedule(nodes: int, steps: int, phase: str) -> list[str]:
    """The mixed schedule, spread over the job: a worker, a node, the rest of stage 1, then a new node (node ids are
    never reused) that boots through the rest of the job."""
    at = [max(2, round(steps * f)) for f in (0.1, 0.2, 0.3)]  # the join's node boots through the rest of the job

    def process(n: int, step: int) -> str:
        return f"{{kind: process, node: {n}, worker: 0, at_step: {step}}}"

    rest = list(range(3, nodes, 2))
    stage_one = [process(n, at[2] + i) for i, n in enumerate(rest)]
    first = f"{{kind: process, node: 1, worker: 0, at_step: {at[0]}, phase: {phase}}}"
    events = [first, f"{{kind: node, node: 2, at_step: {at[1]}}}", *stage_one,
              f"{{kind: join, node: {nodes}, at_step: {at[2] + len(rest)}}}"]  # fmt: skip
    return ["faults=explicit", f"faults.events=[{', '.join(events)}]"]


def run_policy(policy: str, overrides: list[str], scratch: Path, measure_cores: bool) -> dict[str, Any]:
    """One job in this process; a job that stops or crashes is reported with its reason. ``measure_cores``: measure
    the cores the workers of the job's first plan get computing side by side now and give them to the job
    (``sim.host_cores``, ``sim.host_cores_by_load`` and ``sim.host_layer_speed``), the host its predictions are for
    (False: ``conf/sim/measured.yaml``'s idle host)."""
    from ftlab.experiments.bench_simulator import first_plan, host_overrides, measured_host, workers_share
    from ftlab.experiments.job import compose_config, run_job

    d = Path(tempfile.mkdtemp(prefix=f"{policy}-", dir=scratch))
    memory = catalog.device_memory(policy, DEVICE_MEMORY_GB)
    common = [f"tracking.uri=sqlite:///{d}/mlflow.db", f"train.cache_dir={CACHE_DIR}",
              f"train.checkpoint_dir={d}/checkpoints", "progress=false", f"policy={policy}", memory]
    started = time.monotonic()
    try:
        host = []
        if measure_cores:
            cfg, plan = first_plan([*common, *overrides])
            host = host_overrides(measured_host(cfg, plan, workers_share(cfg, plan)))
        print(f"  {policy}: {' '.join([memory, *overrides, *host])}", flush=True)
        result = run_job(compose_config([*common, *host, *overrides]))
    except Exception as exc:  # noqa: BLE001 - a refusal, JobStopped, a crash: findings to report
        print(f"  {policy}: did not finish: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
        if type(exc).__name__ != "JobStopped":
            traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}", "wall_s": time.monotonic() - started}
    figures = measure(result)
    figures["wall_s"] = time.monotonic() - started
    unfired = result.unfired
    if unfired:
        figures["unfired"] = unfired
        print(f"  {policy}: planned faults that never fired: {'; '.join(unfired)}", flush=True)
    print(f"  {policy}: {figures['wall_s']:.0f} s, goodput {figures['goodput']:.2f} samples/s, join stall "
          f"{_seconds(figures.get('join_stall_s'))} (boot {_seconds(figures.get('join_boot_s'))})", flush=True)
    return figures


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def join_figures(result: Any) -> dict[str, Any]:
    """How the join went: ``join_boot_s`` from the node's start to the boundary where the policy got it (training
    going on), ``steps_while_joining`` committed meanwhile, and ``join_stall_s``, how long training stood still for
    it: from that boundary to the start of the next step (the decision and its configuration). None where the node
    was not up before the job ended."""
    from ftlab.runtime.control import events as ev

    started = [e for e in result.events if isinstance(e, ev.FaultInjected) and e.fault_kind == "join"]
    offered = [e for e in result.events if isinstance(e, ev.NodesJoined)]
    if not started:
        return {}
    if not offered:
        return {"join_stall_s": None, "join_boot_s": None, "steps_while_joining": None}
    start, offer = started[0], offered[0]
    after = [s for s in result.steps if s.at > offer.at]
    resumed = after[0].at - after[0].iter_s if after else None
    return {
        "join_stall_s": None if resumed is None else resumed - offer.at,
        "join_boot_s": offer.at - start.at,
        "steps_while_joining": len([s for s in result.steps if start.at < s.at < offer.at]),
    }


def measure(result: Any) -> dict[str, Any]:
    from ftlab.runtime.control import events as ev

    s = result.summary
    pauses = [f.recover_s for f in result.faults if f.recover_s is not None]
    figures: dict[str, Any] = {
        "goodput": s["summary/samples_per_s"],
        "goodput_ratio": s["summary/goodput_ratio"],
        "pause_s": sum(pauses),
        "lost_steps": sum(f.lost_steps or 0 for f in result.faults),
        "faults": len(result.faults),
        "decisions": [],
    }
    iter_of: dict[int, list[float]] = {}
    for step in result.steps:
        iter_of.setdefault(step.generation, []).append(step.iter_s)
    recovered = [e for e in result.events if isinstance(e, ev.Recovered)]
    pause_errors, iter_errors = [], []
    for decided in (e for e in result.events if isinstance(e, ev.Decided)):
        row: dict[str, Any] = {"outcome": decided.outcome, "chosen": decided.details.get("chosen"),
                               "committed_step": decided.committed_step}  # fmt: skip
        if decided.predicted_iter_s is not None and decided.generation in iter_of:
            measured = statistics.median(iter_of[decided.generation])
            row |= {"predicted_iter_s": decided.predicted_iter_s, "iter_s": measured}
            iter_errors.append(abs(decided.predicted_iter_s - measured) / measured)
        after = [r for r in recovered if r.at >= decided.at and r.recover_s]
        if decided.predicted_pause_s is not None and decided.predicted_iter_s is not None and after:
            predicted = decided.predicted_pause_s + decided.predicted_iter_s
            row |= {"predicted_recover_s": predicted, "recover_s": after[0].recover_s}
            pause_errors.append(abs(predicted - after[0].recover_s) / after[0].recover_s)
        figures["decisions"].append(row)
    configured = {e.generation: e.at for e in result.events if isinstance(e, ev.PlanConfigured)}
    for review in (e for e in result.events if isinstance(e, ev.Reviewed) and e.outcome != "keep"):
        row = {"outcome": review.outcome, "chosen": review.details.get("chosen"), "review_step": review.step}
        if review.predicted_iter_s is not None and review.generation in iter_of:
            measured = statistics.median(iter_of[review.generation])
            row |= {"predicted_iter_s": review.predicted_iter_s, "iter_s": measured}
            iter_errors.append(abs(review.predicted_iter_s - measured) / measured)
        if review.predicted_pause_s is not None and review.generation in configured:
            row |= {"predicted_pause_s": review.predicted_pause_s, "pause_s": configured[review.generation] - review.at}
        figures["decisions"].append(row)
    figures |= join_figures(result)
    if pause_errors or iter_errors:
        figures["pause_error"] = statistics.median(pause_errors) if pause_errors else None
        figures["iter_error"] = statistics.median(iter_errors) if iter_errors else None
    return figures


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median goodput (the lower of two middle ones), with every round's goodput beside it; a policy
    that failed in any round is reported failed, and a fault unfired in any round is reported unfired."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return {**failed[0], "error": f"failed in {len(failed)} of {len(runs)} rounds: {failed[0]['error']}"}
    ranked = sorted(runs, key=lambda r: r["goodput"])
    unfired = [fault for r in runs for fault in r.get("unfired", [])]
    median = {**ranked[(len(ranked) - 1) // 2], "rounds_goodput": [r["goodput"] for r in runs]}
    return {**median, "unfired": unfired} if unfired else median


def table(report: dict[str, dict[str, Any]]) -> str:
    def pct(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    lines = [f"{'policy':<20}{'goodput':>10}{'ratio':>8}{'pause s':>9}{'lost':>6}{'pause err':>11}{'iter err':>10}"
             f"{'join stall s':>14}"]
    for policy, r in report.items():
        if "error" in r:
            lines.append(f"{policy:<20}  did not finish: {r['error'].splitlines()[0][:80]}")
            continue
        lines.append(
            f"{policy:<20}{r['goodput']:>10.2f}{r['goodput_ratio']:>8.3f}{r['pause_s']:>9.2f}{r['lost_steps']:>6}"
            f"{pct(r.get('pause_error')):>11}{pct(r.get('iter_error')):>10}{_seconds(r.get('join_stall_s')):>14}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="local-6, 20 steps: that it runs and prints")
    parser.add_argument("--nodes", type=int, default=8, help="cluster=local-N (even: a 2 x N/2 grid)")
    parser.add_argument("--steps", type=int, default=40,
                        help="enough that the joining node, started after the stage is lost, is up before the end "
                             "where the stage loss was recovered in place (a restart may leave too few steps: "
                             "join_stall_s is then -)")
    parser.add_argument("--phase", default="reduce", help="the phase of its step the first kill fires in")
    parser.add_argument("--protection", default="reft", help="every policy's protection (reft or storage)")
    parser.add_argument("--flush-every", type=int, default=10, help="reft: storage flush period; storage: its period")
    parser.add_argument("--policies", nargs="*", default=compared())
    parser.add_argument("--keep", action="store_true", help="keep the jobs' MLflow stores and checkpoints")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every policy this many times, in rotated order; report each one's median run")
    parser.add_argument("--cores-as-measured", action="store_true",
                        help="predict for conf/sim/measured.yaml's idle host, not the share of it measured now")  # fmt: skip
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/results.md")
    args = parser.parse_args(argv)
    if args.smoke:
        args.nodes, args.steps = 6, 20
    protection = [f"protection={args.protection}",
                  f"protection.{'flush_every' if args.protection == 'reft' else 'every'}={args.flush_every}"]  # fmt: skip
    overrides = [*job(args.nodes, args.steps), *schedule(args.nodes, args.steps, args.phase), *protection]
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="ftlab-bench-policies-"))
    try:
        runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in args.policies}
        for round_ in range(args.rounds):
            # Each round starts one policy later: a load that drifts over the bench falls on every policy alike.
            first = round_ % len(args.policies)
            for policy in [*args.policies[first:], *args.policies[:first]]:
                runs[policy].append(run_policy(policy, overrides, scratch, not args.cores_as_measured))
        report = {policy: median_run(tried) for policy, tried in runs.items()}
    finally:
        if args.keep:
            print(f"job stores kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(table(report))
    goodput = {p: r["goodput"] for p, r in report.items() if "goodput" in r}
    best = max((goodput[p] for p in singles() if p in goodput), default=None)
    vs_best = {p: goodput[p] / best if p in goodput and best else None for p in choosers()}
    for policy, ratio in vs_best.items():
        print(f"{policy} vs best single policy: {'-' if ratio is None else f'{ratio:.3f}'}")
    stalls = {p: r.get("join_stall_s") for p, r in report.items() if "goodput" in r}
    print(f"join stall (target under {JOIN_STALL_TARGET_S:g} s): "
          + ", ".join(f"{p} {_seconds(stall)}" for p, stall in stalls.items()))  # fmt: skip
    print(json.dumps({"goodput": goodput, "adaptive_vs_best_single": vs_best.get("adaptive"), "vs_best_single": vs_best,
                      "join_stall_s": stalls, "policies": report}, default=str))  # fmt: skip
    if args.write_docs:
        from ftlab.experiments import results_doc

        results_doc.write_section("bench_policies", "Every policy and adaptive under one mixed fault schedule", {
            f"local-{args.nodes}, {args.steps} steps, protection={args.protection}; each policy's run of median "
            f"goodput over {args.rounds} round(s) (samples/s; pause and lost steps summed over the faults; "
            f"prediction errors: median over recoveries)": report,
            "": {f"{policy}_vs_best_single": ratio for policy, ratio in vs_best.items()},
        }, argv)  # fmt: skip
    unfired = {p: r["unfired"] for p, r in report.items() if r.get("unfired")}
    for policy, faults in unfired.items():
        print(f"FAILED: {policy}'s job did not fire every planned fault: {'; '.join(faults)}", file=sys.stderr)
    return 1 if unfired else 0


if __name__ == "__main__":
    sys.exit(main())
