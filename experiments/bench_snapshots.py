"""REFT's in-memory snapshots, side by side: what they add to an iteration, and what they save at a failure.

    .venv/bin/python -m ftlab.experiments.bench_snapshots              # the comparison (takes a while on 2 cores)
    .venv/bin/python -m ftlab.experiments.bench_snapshots --smoke      # a short run through every part

Part 1, overhead. One job (gpt2-tiny on ``cluster=local-6``, ``train.stages=2``: three replicas per stage, so AEC's
parity is not simply a copy) runs without snapshots and with a snapshot every step in each mode: arc, aec, arc+aec,
and aor, which protects ZeRO-1's optimizer chunks and so is compared with ZeRO-1 without snapshots. The jobs run in
alternating rounds, their order rotated each round, so a slow phase of this shared machine falls on all of them.
The figure per job is the median iteration (``perf/iter_s``) after ``--warmup`` steps, over all rounds; overhead is
that median over the baseline's, less one. Beside it: the time a snapshot spends on the critical path (the slowest
worker's wait for its copy before reporting ready, ``ft/snapshot_s``) and the copy itself (``ft/snapshot_copy_s``),
which say where an overhead comes from (waiting for copies, or copies competing with training for the two cores).

Part 2, load and recovery. ``policy=checkpoint_restart`` with ``protection=storage`` (every ``--storage-every``
steps) and with ``protection=reft`` (arc, a snapshot every step) lose the same node at the same point, alternating
over the rounds. The restore (``ft/restore_s``, the slowest worker's load) reads the same model state, laid out the
same way, from the checkpoint files or from the nodes' memory and their peers; load_speedup is the ratio of the
medians. Recovery is measured from the kill until the step the failure found committed is committed again (lost
steps recomputed included); recovery_speedup_vs_storage is the ratio of the medians. On this machine a restart spends
most of its time starting worker processes, which both protections pay alike.

What "storage" is here matters: the checkpoint directory is on this machine's disk, and the files just written are
still in its page cache, so a load from "storage" is a read from RAM, not the paper's NFS over 10 Gb/s. A load from
memory, for its part, receives every shard its node does not hold from a peer over gloo (TCP on the loopback), and
checks checksums. Expect load_speedup near 1 here; the ratio the paper reports needs a real network file system.

The last line printed is one JSON object with at least ``overhead_arc``, ``overhead_aec``, ``overhead_aor``
(fractions of iteration time added), ``load_speedup`` and ``recovery_speedup_vs_storage``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from ftlab.experiments.job import JobResult, compose_config, run_job

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO / ".ftlab" / "cache"
JOB = ["experiment=plain", "model=gpt2-tiny", "cluster=local-6", "train.stages=2", "train.global_batch=16",
       "train.micro_batch=2", "progress=false"]  # fmt: skip
NO_FLUSH = "protection.flush_every=1000000"  # part 1 measures the snapshots alone
OVERHEAD = {
    "none": ["policy=none", "protection=none"],
    "arc": ["policy=none", "protection=reft", "protection.mode=arc", NO_FLUSH],
    "aec": ["policy=none", "protection=reft", "protection.mode=aec", NO_FLUSH],
    "arc+aec": ["policy=none", "protection=reft", "protection.mode=arc+aec", NO_FLUSH],
    "zero1": ["policy=none", "protection=none", "train.zero=1"],
    "aor": ["policy=none", "protection=reft", "protection.mode=aor", "train.zero=1", NO_FLUSH],
}
BASELINE = {"arc": "none", "aec": "none", "arc+aec": "none", "aor": "zero1"}


def run(overrides: list[str], scratch: Path, steps: int) -> tuple[JobResult, MlflowClient]:
    uri = f"sqlite:///{scratch}/mlflow.db"
    result = run_job(compose_config([*JOB, f"train.steps={steps}", f"tracking.uri={uri}",
                                     f"train.cache_dir={CACHE_DIR}", f"train.checkpoint_dir={scratch}/checkpoints",
                                     *overrides]))  # fmt: skip
    return result, MlflowClient(uri)


def metric(client: MlflowClient, run_id: str, name: str) -> list[float]:
    return [m.value for m in client.get_metric_history(run_id, name)]


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def overheads(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    names = list(OVERHEAD)
    iters: dict[str, list[float]] = {n: [] for n in names}
    critical: dict[str, list[float]] = {n: [] for n in names}
    copies: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            print(f"round {r + 1}/{args.rounds}: {name}", flush=True)
            result, client = run(OVERHEAD[name], scratch / f"{name}-{r}", args.steps)
            steady = [s for s in result.steps if s.step >= args.warmup]
            iters[name] += [s.iter_s for s in steady]
            critical[name] += [s.snapshot_s for s in steady if s.snapshot_s is not None]
            copies[name] += metric(client, result.run_id, "ft/snapshot_copy_s")[args.warmup:]
    out = {}
    for name in names:
        out[name] = {"iter_s": median(iters[name]), "snapshot_s": median(critical[name]),
                     "snapshot_copy_s": median(copies[name])}  # fmt: skip
    for mode, base in BASELINE.items():
        out[mode]["overhead"] = out[mode]["iter_s"] / out[base]["iter_s"] - 1
    return out


def regain_s(result: JobResult) -> float | None:
    """From the kill until the step the failure found committed is committed again."""
    fault = result.faults[0]
    if fault.fired_at is None or fault.committed_step is None:
        return None
    again = [s.at for s in result.steps if s.at > fault.fired_at and s.step >= fault.committed_step - 1]
    return min(again) - fault.fired_at if again else None


def recoveries(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    kill = f"faults.events=[{{kind: node, node: 3, at_step: {args.kill_step}, phase: {args.kill_phase}}}]"
    jobs = {
        "storage": ["policy=checkpoint_restart", "protection=storage", f"protection.every={args.storage_every}"],
        "reft": ["policy=checkpoint_restart", "protection=reft", "protection.mode=arc", NO_FLUSH],
    }
    figures: dict[str, dict[str, list[float]]] = {n: {"restore_s": [], "regain_s": [], "lost": [], "bytes": []}
                                                  for n in jobs}  # fmt: skip
    for r in range(args.rounds):
        for name in (list(jobs) if r % 2 == 0 else list(reversed(jobs))):
            print(f"round {r + 1}/{args.rounds}: recovery with {name}", flush=True)
            result, client = run([*jobs[name], "faults=explicit", kill], scratch / f"recovery-{name}-{r}", args.recovery_steps)
            figures[name]["restore_s"] += metric(client, result.run_id, "ft/restore_s")
            figures[name]["bytes"] += metric(client, result.run_id, "ft/restore_bytes")
            figures[name]["lost"] += [float(f.lost_steps) for f in result.faults if f.lost_steps is not None]
            regained = regain_s(result)
            if regained is not None:
                figures[name]["regain_s"].append(regained)
    return {name: {key: median(values) for key, values in f.items()} for name, f in figures.items()}


def table(over: dict[str, Any], rec: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return f"{value * 1e3:9.1f}" if value is not None else "        -"

    lines = [f"{'job':<10}{'iter ms':>9}{'overhead':>10}{'critical ms':>13}{'copy ms':>9}"]
    for name, f in over.items():
        overhead = f"{f['overhead'] * 100:9.1f}%" if "overhead" in f else "         -"
        lines.append(f"{name:<10}{ms(f['iter_s'])}{overhead}{ms(f['snapshot_s']):>13}{ms(f['snapshot_copy_s'])}")
    lines.append("")
    lines.append(f"{'recovery':<10}{'restore ms':>11}{'MB':>7}{'regain s':>10}{'lost steps':>11}")
    for name, f in rec.items():
        mb = f"{f['bytes'] / 1e6:7.1f}" if f["bytes"] else "      -"
        regain = f"{f['regain_s']:10.2f}" if f["regain_s"] is not None else "         -"
        lost = f"{f['lost']:11.0f}" if f["lost"] is not None else "          -"
        lines.append(f"{name:<10}{ms(f['restore_s']):>11}{mb}{regain}{lost}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="part 1: steps per job")
    parser.add_argument("--warmup", type=int, default=5, help="part 1: steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--recovery-steps", type=int, default=14)
    parser.add_argument("--kill-step", type=int, default=8)
    parser.add_argument("--kill-phase", default="backward")
    parser.add_argument("--storage-every", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="one round of short jobs")
    parser.add_argument("--keep", action="store_true", help="keep the jobs' MLflow stores and checkpoints")
    parser.add_argument("--write-docs", action="store_true", help="write the tables into docs/results.md")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.rounds, args.recovery_steps, args.kill_step, args.storage_every = 6, 2, 1, 6, 4, 3
    scratch = Path(tempfile.mkdtemp(prefix="bench-snapshots-"))
    try:
        over = overheads(args, scratch)
        rec = recoveries(args, scratch)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print(table(over, rec))
    load = rec["storage"]["restore_s"] / rec["reft"]["restore_s"] if rec["reft"]["restore_s"] else None
    recovery = rec["storage"]["regain_s"] / rec["reft"]["regain_s"] if rec["reft"]["regain_s"] else None
    summary = {
        "overhead_arc": over["arc"]["overhead"], "overhead_aec": over["aec"]["overhead"],
        "overhead_arc_aec": over["arc+aec"]["overhead"], "overhead_aor": over["aor"]["overhead"],
        "load_speedup": load, "recovery_speedup_vs_storage": recovery,
        "overhead": over, "recovery": rec, "settings": vars(args),
    }  # fmt: skip
    print(json.dumps(summary))
    if args.write_docs:
        from ftlab.experiments import results_doc

        results_doc.write_section("bench_snapshots", "REFT's snapshots: overhead per iteration, restore and recovery", {
            "Per iteration (seconds; overhead against none, aor's against ZeRO-1 without snapshots)": over,
            "Checkpoint-restart after a node kill, by protection (seconds, bytes, steps)": rec,
            "": {"load_speedup": load, "recovery_speedup_vs_storage": recovery},
        }, argv)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
