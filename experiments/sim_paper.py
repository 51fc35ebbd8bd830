"""Paper-scale experiments on the simulator, as tables and plots in the MLflow experiment ``ftlab-sim``.

    .venv/bin/python -m experiments.sim_paper            # both studies, full size
    .venv/bin/python -m experiments.sim_paper --smoke    # a few cells of each (what a busy machine can afford)

Every cell is one simulated job (``experiments.simulate``: the real coordinator, policies and programs on a
simulated cluster); the study's tables, plots and a JSON of every cell are logged to one MLflow run.

**Table 2 of Oobleck (SOSP'23)**: average throughput (samples/s over the whole run) of GPT-3 medium, 2.7B and 6.7B
on the paper's cluster (``cluster=a40-30x1``: 30 A40 nodes of one GPU, 40 GB usable, 200 Gb/s) with the paper's
batches (Table 1: 8192 in micro-batches of 16 for medium, 1024 in micro-batches of 2 for the others), activation
checkpointing on (Oobleck and Varuna use it), under the bundled synthetic traces ``6h``, ``1h`` and ``10m`` (a node
fails every 6 hours, hour, 10 minutes, never replaced), until 15 of the 30 nodes remain, as in the paper (Section
7.2): a fault-free run, checkpoint-restart with a checkpoint every 10 iterations (the paper's Varuna setting) and
Oobleck (f = 1). The paper's storage (MinIO on six NVMe servers over 200 Gb/s) is taken as 5 GB/s of writes and
10 GB/s of reads, all writers or readers together (``STORAGE``): a stated assumption, not a measurement.

**MTBF sweep**: goodput (useful samples per second over the fault-free rate) of ``llama2-6.7b`` against cluster
size (``--sizes``, nodes of 8 A100-80GB), over ``--hours`` of training, with node failures at published large-cluster
rates, each failed node replaced an hour later (spares), for every policy with every protection it works with:
- Llama 3 (Dubey et al. 2024, Section 3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. one per
  1.82e8 GPU-seconds; a cluster of G GPUs fails every 1.82e8 / G seconds;
- Meta's research clusters (Kokolis et al. 2024): projected job MTTF of 7.9 h at 1,024 GPUs and 1.8 h at 16,384;
  between and beyond, interpolated on a log-log line (MTTF proportional to G^-0.53).
The protections: ``storage`` (a checkpoint every 50 steps at ``STORAGE``) and ``reft`` (a snapshot in host memory
after every step, mode arc, copied at ``SNAPSHOTS``, with a flush to storage every 50 steps).

Faults are drawn from an exponential distribution (``faults=exponential``) with a fixed seed, the same for every
policy of a cell.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".ftlab" / "sim"
STORAGE = ["sim.storage_write_bytes_per_s=5e9", "sim.storage_read_bytes_per_s=1e10"]
SNAPSHOTS = ["sim.snapshot_bytes_per_s=1e10"]
"""A REFT snapshot's copy from an A100 into its host's memory: PCIe 4.0 x16 peaks near 25 GB/s and a DGX A100 puts
two GPUs behind each PCIe switch, so 10 GB/s per GPU: a stated assumption, not a measurement."""
HOST_MEMORY = ["protection.host_memory_gb=1024"]
"""A DGX A100's 1 TB of host memory, for the snapshots' records."""

TABLE2_MODELS = {
    "gpt3-medium": ["model=gpt3-medium", "train.global_batch=8192", "train.micro_batch=16"],
    "gpt3-2.7b": ["model=gpt3-2.7b", "train.global_batch=1024", "train.micro_batch=2"],
    "gpt3-6.7b": ["model=gpt3-6.7b", "train.global_batch=1024", "train.micro_batch=2"],
}
TABLE2_TRACES = ("6h", "1h", "10m")
PAPER_TABLE2 = {  # Oobleck's Table 2, samples/s: (Varuna, Oobleck) per model and trace
    "gpt3-medium": {"6h": (29.52, 29.30), "1h": (27.61, 29.21), "10m": (20.71, 28.70)},
    "gpt3-2.7b": {"6h": (7.27, 7.29), "1h": (6.41, 7.23), "10m": (0.36, 6.89)},
    "gpt3-6.7b": {"6h": (4.02, 4.33), "1h": (2.91, 4.22), "10m": (0.12, 3.55)},
}
POLICIES = {
    "fault-free": ["policy=none", "faults=none"],
    "checkpoint_restart": ["policy=checkpoint_restart", "protection=storage", "protection.every=10"],
    "oobleck": ["policy=oobleck", "policy.fault_threshold=1"],
}
COMBINATIONS = {  # policy x protection, every pair that can run
    "none+none": ["policy=none", "protection=none"],
    "checkpoint_restart+storage": ["policy=checkpoint_restart", "protection=storage", "protection.every=50"],
    "oobleck+none": ["policy=oobleck", "protection=none"],
    "oobleck+storage": ["policy=oobleck", "protection=storage", "protection.every=50"],
    "checkpoint_restart+reft": ["policy=checkpoint_restart", "protection=reft", "protection.interval=1",
                                "protection.flush_every=50", *HOST_MEMORY],
    "oobleck+reft": ["policy=oobleck", "protection=reft", "protection.interval=1", "protection.flush_every=50",
                     *HOST_MEMORY],
}
LLAMA3_GPU_S = 54 * 24 * 3600 * 16384 / 419
META_MTTF = ((1024, 7.9 * 3600), (16384, 1.8 * 3600))


def cluster_mtbf_s(source: str, gpus: int) -> float:
    """Seconds between failures of a cluster of ``gpus`` GPUs, by published rates (module docstring)."""
    if source == "llama3":
        return LLAMA3_GPU_S / gpus
    (g0, t0), (g1, t1) = META_MTTF
    slope = math.log(t1 / t0) / math.log(g1 / g0)
    return t0 * (gpus / g0) ** slope


def last_failure_s(trace: str) -> float:
    """Until half the nodes remain, as the paper measures: the synthetic trace's 15th (and last) failure."""
    from ftlab.faults.schedules import ClusterShape, FaultsConfig, build_schedule

    events = build_schedule(FaultsConfig(schedule="trace", trace=trace, time_compression=1.0), ClusterShape(30, 1))
    return max(e.at_time_s or 0.0 for e in events)


def simulated(overrides: list[str]) -> dict[str, Any]:
    from ftlab.experiments.job import compose_config
    from ftlab.experiments.simulate import simulate

    cfg = OmegaConf.to_object(compose_config(["experiment=plain", "mode=simulate", "progress=false", *overrides]))
    began = time.perf_counter()
    run = simulate(cfg)
    result = run.result
    s = result.summary
    return {
        "samples_per_s": s.get("summary/samples_per_s", 0.0),
        "goodput": s.get("summary/goodput_ratio", 0.0),
        "failures": sum(f.noticed_at is not None for f in result.faults),
        "steps": len({step.step for step in result.steps}),
        "plans": len(result.plans),
        "stopped": result.stopped,
        "wall_s": time.perf_counter() - began,
    }


# -- Oobleck's Table 2 ---------------------------------------------------------------------------------------------
def table2(models: list[str], traces: list[str]) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        for trace in traces:
            horizon = last_failure_s(trace)
            for policy, settings in POLICIES.items():
                faults = [] if policy == "fault-free" else ["faults=trace", f"faults.trace={trace}",
                                                            "faults.trace_s_per_step=null", "faults.time_compression=1"]  # fmt: skip
                overrides = [*TABLE2_MODELS[model], "cluster=a40-30x1", "train.activation_checkpointing=true",
                             "train.steps=100000000", f"sim.horizon_s={horizon}", *STORAGE, *settings, *faults]  # fmt: skip
                cell = {"model": model, "trace": trace, "policy": policy, **simulated(overrides)}
                paper = PAPER_TABLE2[model][trace]
                cell["paper"] = {"checkpoint_restart": paper[0], "oobleck": paper[1]}.get(policy)
                rows.append(cell)
                print(f"[table2] {model} {trace} {policy}: {cell['samples_per_s']:.2f} samples/s "
                      f"(paper {cell['paper']}), {cell['failures']} failures, {cell['wall_s']:.1f} s", flush=True)
    return rows


def render_table2(rows: list[dict[str, Any]]) -> str:
    lines = ["Throughput (samples/s), simulated; in brackets Oobleck's Table 2 (Varuna for checkpoint-restart)", ""]
    models = list(dict.fromkeys(r["model"] for r in rows))
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    lines.append("| policy | " + " | ".join(f"{m} {t}" for m in models for t in traces) + " |")
    lines.append("|---" * (1 + len(models) * len(traces)) + "|")
    for policy in POLICIES:
        cells = []
        for m in models:
            for t in traces:
                r = next((r for r in rows if (r["model"], r["trace"], r["policy"]) == (m, t, policy)), None)
                if r is None:
                    cells.append("")
                    continue
                paper = f" ({r['paper']:g})" if r["paper"] is not None else ""
                stop = " stopped" if r["stopped"] else ""
                cells.append(f"{r['samples_per_s']:.2f}{paper}{stop}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- the MTBF sweep ------------------------------------------------------------------------------------------------
def sweep(sizes: list[int], hours: float, sources: list[str]) -> list[dict[str, Any]]:
    rows = []
    for source in sources:
        for nodes in sizes:
            gpus = 8 * nodes
            mtbf = cluster_mtbf_s(source, gpus)
            faults = ["faults=exponential", "faults.mtbf_steps=null", f"faults.mtbf_s={mtbf:.6g}", "faults.max_failures=null",
                      f"faults.horizon_s={hours * 3600:g}",
                      "faults.replace_after_s=3600", "faults.seed=0"]  # fmt: skip
            for combination, settings in COMBINATIONS.items():
                overrides = [
                    "model=llama2-6.7b", "cluster=a100-125x8", f"cluster.nodes={nodes}",
                    "train.activation_checkpointing=true", f"train.global_batch={gpus}", "train.micro_batch=1",
                    "train.steps=100000000", f"sim.horizon_s={hours * 3600:g}", *STORAGE, *SNAPSHOTS, *settings,
                    *faults,
                ]  # fmt: skip
                cell = {"source": source, "nodes": nodes, "gpus": gpus, "mtbf_s": mtbf, "combination": combination,
                        **simulated(overrides)}  # fmt: skip
                rows.append(cell)
                print(f"[sweep] {source} {gpus} GPUs (MTBF {mtbf / 3600:.2f} h) {combination}: goodput "
                      f"{cell['goodput']:.3f}, {cell['failures']} failures, {cell['wall_s']:.1f} s", flush=True)
    return rows


def render_sweep(rows: list[dict[str, Any]]) -> str:
    lines = ["Goodput (useful samples/s over the fault-free rate), simulated llama2-6.7b, by cluster size", ""]
    for source in dict.fromkeys(r["source"] for r in rows):
        sizes = sorted({r["gpus"] for r in rows if r["source"] == source})
        lines.append(f"{source}: " + ", ".join(
            f"{g} GPUs MTBF {next(r['mtbf_s'] for r in rows if r['gpus'] == g and r['source'] == source) / 3600:.1f} h"
            for g in sizes))  # fmt: skip
        lines.append("| policy+protection | " + " | ".join(f"{g} GPUs" for g in sizes) + " |")
        lines.append("|---" * (1 + len(sizes)) + "|")
        for combination in COMBINATIONS:
            cells = []
            for g in sizes:
                r = next(r for r in rows if (r["source"], r["gpus"], r["combination"]) == (source, g, combination))
                cells.append(f"{r['goodput']:.3f}" + (" stopped" if r["stopped"] else ""))
            lines.append(f"| {combination} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(dict.fromkeys(r["source"] for r in rows))
    fig, axes = plt.subplots(1, len(sources), figsize=(5.5 * len(sources), 3.6), squeeze=False)
    for ax, source in zip(axes[0], sources):
        for combination in COMBINATIONS:
            points = sorted((r["gpus"], r["goodput"]) for r in rows if (r["source"], r["combination"]) == (source, combination))
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=combination)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("goodput")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"failures at {source} rates")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_table2(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for i, policy in enumerate(POLICIES):
            values = [next(r["samples_per_s"] for r in rows if (r["model"], r["trace"], r["policy"]) == (model, t, policy))
                      for t in traces]  # fmt: skip
            ax.bar([j + 0.27 * (i - 1) for j in range(len(traces))], values, width=0.27, label=policy)
        ax.set_xticks(range(len(traces)), traces)
        ax.set_title(model)
        ax.set_ylabel("samples/s")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one model and trace, two cluster sizes, 6 hours")
    parser.add_argument("--sizes", default="16,32,64,128,256,512", help="nodes of 8 GPUs for the MTBF sweep")
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--tracking-uri", default=f"sqlite:///{REPO / 'mlflow.db'}")
    parser.add_argument("--no-table2", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    from ftlab.runtime.config import TrackingConfig
    from ftlab.runtime.tracking import Tracker

    models, traces = list(TABLE2_MODELS), list(TABLE2_TRACES)
    sizes, hours, sources = [int(n) for n in args.sizes.split(",")], args.hours, ["llama3", "meta"]
    if args.smoke:
        models, traces, sizes, hours = ["gpt3-2.7b"], ["10m"], [16, 64], 6.0
    OUT.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(TrackingConfig(uri=args.tracking_uri, experiment="ftlab-sim", run_name="paper-scale"))
    tracker.start({"smoke": args.smoke, "sizes": sizes, "hours": hours}, {"backend": "sim", "study": "paper-scale"}, "")
    found: dict[str, Any] = {}
    try:
        local = Path(tempfile.mkdtemp(prefix="ftlab-sim-paper-"))
        if not args.no_table2:
            rows = table2(models, traces)
            found["table2"] = rows
            text = render_table2(rows)
            print(text)
            tracker.log_text("table2.md", text)
            tracker.log_file(plot_table2(rows, local / "table2.png"))
            for r in rows:
                tracker.log_metrics({f"table2/{r['model']}/{r['trace']}/{r['policy']}": r["samples_per_s"]}, 0)
        if not args.no_sweep:
            rows = sweep(sizes, hours, sources)
            found["sweep"] = rows
            text = render_sweep(rows)
            print(text)
            tracker.log_text("mtbf_sweep.md", text)
            tracker.log_file(plot_sweep(rows, local / "mtbf_sweep.png"))
            for r in rows:
                name = r["combination"].replace("+", "_with_")
                tracker.log_metrics({f"sweep/{r['source']}/{name}/goodput": r["goodput"]}, r["gpus"])
        tracker.log_text("cells.json", json.dumps(found, indent=1, default=str))
        tracker.finish()
    except BaseException as exc:
        tracker.finish(failure=f"{type(exc).__name__}: {exc}")
        raise
    (OUT / "paper.json").write_text(json.dumps(found, default=str))
    print(json.dumps({k: len(v) for k, v in found.items()}))


if __name__ == "__main__":
    main()
