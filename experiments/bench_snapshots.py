"""REFT's in-memory snapshots, side by side: what they cost against memory speed, what they add to an iteration, and
what they save at a failure.

    .venv/bin/python -m ftlab.experiments.bench_snapshots              # the comparison (takes a while on 2 cores)
    .venv/bin/python -m ftlab.experiments.bench_snapshots --smoke      # a short run through every part
    .venv/bin/python -m ftlab.experiments.bench_snapshots --parts memory   # part 0 alone, in seconds

Part 0, memory speed (``experiments.snapshot_speed``, in this process). One worker's ARC records of stage 0 of the
overhead job's layout, against this machine's single-threaded memcpy of the same bytes: the checksum candidates
(zlib's CRC-32, XXH3, CRC32C where installed), a snapshot's CPU time (copy and checksum), a restore from the worker's
own node's memory (verify, copy into fresh layers and optimizer state), and the same layers loaded from a storage
checkpoint with its pages dropped from the page cache (cold: the read goes to the device) and cached. Targets: snapshot
and restore within 2x of memcpy; load_speedup_cold at least 10, load_speedup_cached at least 3.

Part 1, overhead. One job (gpt2-tiny on ``cluster=local-4``, ``train.stages=2``: two replicas per stage) runs without
snapshots and with a snapshot every step in each mode: arc, aec (with two members a parity is the other member's
sub-chunk), arc+aec, and aor, which protects ZeRO-1's optimizer chunks and so is compared with ZeRO-1 without
snapshots. The jobs run in alternating rounds, their order rotated each round, so a slow phase of this shared machine
falls on all of them. The figure per job is the median iteration (``perf/iter_s``) after ``--warmup`` steps, over all
rounds; overhead is that median over the baseline's, less one (target for arc: at most 5%). Beside it: the time a
snapshot spends on the critical path (the slowest worker's start of its copy and wait for it before reporting ready,
``ft/snapshot_s``), the copy itself (``ft/snapshot_copy_s``, the slowest worker's) and its CPU time
(``ft/snapshot_cpu_s``, all workers' copy threads together), which say where an overhead comes from: waiting for
copies, or copies competing with training for the cores. ``cpu_share`` is that CPU time over the host's core time
per iteration: what the copies can add to an iteration that keeps every core busy, free of the noise that a shared
machine puts into the iteration times.

Part 2, load and recovery. ``policy=checkpoint_restart`` with ``protection=storage`` (every ``--storage-every``
steps) and with ``protection=reft`` (arc, a snapshot every step) lose the same node at the same point, alternating
over the rounds. The restore (``ft/restore_s``, the slowest worker's load) reads the same model state, laid out the
same way, from the checkpoint files or from the nodes' memory and their peers; load_speedup_job is the ratio of the
medians. Recovery is measured from the kill until the step the failure found committed is committed again (lost
steps recomputed included); recovery_speedup_vs_storage is the ratio of the medians. On this machine a restart spends
most of its time starting worker processes, which both protections pay alike. The checkpoint files a restarted job
reads were just written, so they are in the page cache: load_speedup_job compares with a cached read, and a record
on another node crosses gloo on the loopback, as it would cross a network.

The last line printed is one JSON object with at least ``overhead_arc``, ``overhead_aec``, ``overhead_aor``
(fractions of iteration time added), ``cpu_share_arc``, ``snapshot_vs_memcpy``, ``restore_vs_memcpy``,
``load_speedup_cold``, ``load_speedup_cached``, ``load_speedup_job`` and ``recovery_speedup_vs_storage`` (a part not
run reads null).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from ftlab.experiments import snapshot_speed
from ftlab.experiments.job import JobResult, compose_config, run_job
from ftlab.runtime.state import shm

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO / ".ftlab" / "cache"
MODEL, STAGES, REPLICAS = "gpt2-tiny", 2, 2
JOB = ["experiment=plain", f"model={MODEL}", "cluster=local-4", f"train.stages={STAGES}", "train.global_batch=16",
       "train.micro_batch=2", "progress=false"]  # fmt: skip
TARGETS = {"snapshot_vs_memcpy": ("<=", 2.0), "restore_vs_memcpy": ("<=", 2.0), "overhead_arc": ("<=", 0.05),
           "load_speedup_cold": (">=", 10.0), "load_speedup_cached": (">=", 3.0)}  # fmt: skip
CORES = os.cpu_count() or 1
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
    cpus: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            print(f"round {r + 1}/{args.rounds}: {name}", flush=True)
            result, client = run(OVERHEAD[name], scratch / f"{name}-{r}", args.steps)
            steady = [s for s in result.steps if s.step >= args.warmup]
            iters[name] += [s.iter_s for s in steady]
            critical[name] += [s.snapshot_s for s in steady if s.snapshot_s is not None]
            copies[name] += metric(client, result.run_id, "ft/snapshot_copy_s")[args.warmup:]
            cpus[name] += metric(client, result.run_id, "ft/snapshot_cpu_s")[args.warmup:]
    out = {}
    for name in names:
        out[name] = {"iter_s": median(iters[name]), "snapshot_s": median(critical[name]),
                     "snapshot_copy_s": median(copies[name]), "snapshot_cpu_s": median(cpus[name])}  # fmt: skip
    for mode, base in BASELINE.items():
        out[mode]["overhead"] = out[mode]["iter_s"] / out[base]["iter_s"] - 1
        out[mode]["cpu_share"] = ratio(out[mode]["snapshot_cpu_s"], CORES * out[mode]["iter_s"])
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


def memory_table(speed: dict[str, Any]) -> str:
    lines = [f"memory speed: {speed['bytes'] / 1e6:.1f} MB of one worker's ARC records (layers {speed['layers']}), "
             f"memcpy {speed['memcpy_gb_s']:.1f} GB/s", f"{'figure':<24}{'ms':>9}{'x memcpy':>10}"]  # fmt: skip
    for name, seconds in speed["seconds"].items():
        ratio = speed["ratios"].get(f"{name}_vs_memcpy")
        lines.append(f"{name:<24}{seconds * 1e3:9.2f}{ratio if ratio is not None else 1.0:10.2f}")
    return "\n".join(lines)


def table(over: dict[str, Any], rec: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return f"{value * 1e3:9.1f}" if value is not None else "        -"

    lines = [f"{'job':<10}{'iter ms':>9}{'overhead':>10}{'critical ms':>13}{'copy ms':>9}{'cpu ms':>9}"
             f"{'cpu share':>11}"]
    for name, f in over.items():
        overhead = f"{f['overhead'] * 100:9.1f}%" if "overhead" in f else "         -"
        share = f"{f['cpu_share'] * 100:10.1f}%" if f.get("cpu_share") is not None else "          -"
        lines.append(f"{name:<10}{ms(f['iter_s'])}{overhead}{ms(f['snapshot_s']):>13}{ms(f['snapshot_copy_s'])}"
                     f"{ms(f['snapshot_cpu_s'])}{share}")
    lines.append("")
    lines.append(f"{'recovery':<10}{'restore ms':>11}{'MB':>7}{'regain s':>10}{'lost steps':>11}")
    for name, f in rec.items():
        mb = f"{f['bytes'] / 1e6:7.1f}" if f["bytes"] else "      -"
        regain = f"{f['regain_s']:10.2f}" if f["regain_s"] is not None else "         -"
        lost = f"{f['lost']:11.0f}" if f["lost"] is not None else "          -"
        lines.append(f"{name:<10}{ms(f['restore_s']):>11}{mb}{regain}{lost}")
    return "\n".join(lines)


def verdicts(summary: dict[str, Any]) -> dict[str, str]:
    """Each target: the figure against it, met or not (or not measured)."""
    out = {}
    for name, (sense, bound) in TARGETS.items():
        value = summary.get(name)
        met = value is not None and (value <= bound if sense == "<=" else value >= bound)
        out[name] = "not measured" if value is None else f"{value:.3g} ({'met' if met else 'NOT met'}: {sense} {bound})"
    return out


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def note(speed: dict[str, Any] | None, loads: list[float]) -> str:
    """What bounds a restore on this host, from part 0's own figures, and how busy the host was."""
    busy = f"Load average {loads[0]:.1f} at the start, {loads[1]:.1f} at the end, on {CORES} CPUs."
    if not speed:
        return busy
    r = speed["ratios"]
    return (f"A new process's restore reads its records out of the node's memory by the kernel's copy (shm_read: "
            f"{r['shm_read_vs_memcpy']:.2f}x memcpy, the floor of a restore by a process that has not mapped them) "
            f"into moments whose fresh pages that copy faults in (fresh_pages, faulting them in by touching each: "
            f"{r['fresh_pages_vs_memcpy']:.2f}x); the restore adds "
            f"{r['restore_vs_memcpy'] - r['shm_read_vs_memcpy']:.2f}x memcpy to the kernel's copy, its checksum "
            f"included. {busy}")


PARTS = ("memory", "overhead", "recovery")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run, of {', '.join(PARTS)}")
    parser.add_argument("--reps", type=int, default=15, help="part 0: timings per figure (the fastest counts)")
    parser.add_argument("--memory-root", type=Path, default=shm.ROOT,
                        help="part 0: where the records go (a tmpfs; default: where jobs keep them)")
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
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if args.smoke:
        args.steps, args.warmup, args.rounds, args.recovery_steps, args.kill_step, args.storage_every = 6, 2, 1, 6, 4, 3
        args.reps = 3
    loads = [os.getloadavg()[0]]  # the machine is shared: the section says how busy it was
    scratch = Path(tempfile.mkdtemp(prefix="bench-snapshots-"))
    memory = Path(tempfile.mkdtemp(prefix="bench-snapshots-", dir=args.memory_root))
    try:
        speed = (snapshot_speed.measure(MODEL, STAGES, REPLICAS, scratch / "speed", memory, args.reps)
                 if "memory" in parts else None)  # fmt: skip
        over = overheads(args, scratch) if "overhead" in parts else None
        rec = recoveries(args, scratch) if "recovery" in parts else None
    finally:
        shutil.rmtree(memory, ignore_errors=True)  # host memory: never kept
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    loads.append(os.getloadavg()[0])
    if speed:
        print(memory_table(speed))
    if over and rec:
        print(table(over, rec))
    summary: dict[str, Any] = {
        **{f"overhead_{m.replace('+', '_')}": over[m]["overhead"] if over else None for m in BASELINE},
        "cpu_share_arc": over["arc"]["cpu_share"] if over else None,
        "snapshot_vs_memcpy": speed["ratios"]["snapshot_vs_memcpy"] if speed else None,
        "restore_vs_memcpy": speed["ratios"]["restore_vs_memcpy"] if speed else None,
        "load_speedup_cold": speed["load_speedup_cold"] if speed else None,
        "load_speedup_cached": speed["load_speedup_cached"] if speed else None,
        "load_speedup_job": ratio(rec["storage"]["restore_s"], rec["reft"]["restore_s"]) if rec else None,
        "recovery_speedup_vs_storage": ratio(rec["storage"]["regain_s"], rec["reft"]["regain_s"]) if rec else None,
    }  # fmt: skip
    targets = verdicts(summary)
    for name, verdict in targets.items():
        print(f"target {name}: {verdict}")
    print(json.dumps({**summary, "memory": speed, "overhead": over, "recovery": rec, "settings": vars(args)},
                     default=str))  # fmt: skip
    if args.write_docs:
        from ftlab.experiments import results_doc

        tables: dict[str, Any] = {}
        if speed:
            tables[f"Memory speed: {speed['bytes'] / 1e6:.1f} MB of one worker's ARC records, against a "
                   f"single-threaded memcpy of the same bytes ({speed['memcpy_gb_s']:.1f} GB/s); fastest of "
                   f"{args.reps}"] = {name: {"ms": round(seconds * 1e3, 3),
                                             "x memcpy": round(speed["ratios"].get(f"{name}_vs_memcpy", 1.0), 3)}
                                      for name, seconds in speed["seconds"].items()}  # fmt: skip
        if over:
            tables["Per iteration (seconds; overhead against none, aor's against ZeRO-1 without snapshots)"] = over
        if rec:
            tables["Checkpoint-restart after a node kill, by protection (seconds, bytes, steps)"] = rec
        tables["Figures"] = {k: v for k, v in summary.items() if v is not None}
        tables["Targets"] = targets
        results_doc.write_section("bench_snapshots", "REFT's snapshots: overhead per iteration, restore and recovery",
                                  tables, argv, note=note(speed, loads))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
