"""Paper-scale experiments on the simulator, as tables and plots in the MLflow experiment ``ftlab-sim``.

    .venv/bin/python -m experiments.sim_paper            # the three studies, full size
    .venv/bin/python -m experiments.sim_paper --smoke    # a few cells of each (what a busy machine can afford)

Every cell is one simulated job (``experiments.simulate``: the real coordinator, policies and programs on a
simulated cluster); the study's tables, plots and a JSON of every cell are logged to one MLflow run.

**Table 2 of Oobleck (SOSP'23)**: average throughput (samples/s over the whole run) of BERT-Large, GPT-3 medium, 2.7B
and 6.7B on the paper's cluster (``cluster=a40-30x1``: 30 A40 nodes of one GPU, 40 GB usable, 200 Gb/s) with the paper's batches
(Table 1: 8192 in micro-batches of 16 for medium, 1024 in micro-batches of 2 for the others), activation checkpointing
on (Oobleck and Varuna use it), under the bundled synthetic traces ``6h``, ``1h`` and ``10m`` (a node fails every 6
hours, hour, 10 minutes, never replaced), until 15 of the 30 nodes remain, as in the paper (Section 7.2): a fault-free
run and, by role (``table2_policies``), every policy that recovers by restarting from saved state alone
(checkpoint-restart, Varuna) and every one that recovers in place (Oobleck with f = 1, ReCycle, Bamboo, elastic), each
that can restart with a checkpoint every 10 iterations (the paper's Varuna setting). Bamboo runs as the paper ran it
(Table 1): no activation checkpointing, BERT-Large in micro-batches of 4; on the GPT-3 models it is refused for
memory, the paper's OOM cells. The grid of the fault-free run and checkpoint-restart has ``train.stages`` stages (2; 6 for
6.7B, whose half of the model does not fit an A40's 40 GB), Oobleck plans its own. The paper's storage (MinIO on six
NVMe servers over 200 Gb/s) is taken as 5 GB/s of writes and 10 GB/s of reads, all writers or readers together
(``STORAGE``): a stated assumption, not a measurement.

**MTBF sweep**: goodput (useful samples per second over the fault-free rate) of ``llama2-6.7b`` against cluster
size (``--sizes``, nodes of 8 A100-80GB), over ``--hours`` of training, with node failures at published large-cluster
rates, each failed node replaced an hour later (spares), for every policy with every protection it works with (every
policy found, with each protection its ``check`` accepts; ``combinations``):
- Llama 3 (Dubey et al. 2024, Section 3.3.4): 419 unexpected interruptions in 54 days on 16,384 GPUs, i.e. one per
  1.82e8 GPU-seconds; a cluster of G GPUs fails every 1.82e8 / G seconds;
- Meta's research clusters (Kokolis et al. 2024): projected job MTTF of 7.9 h at 1,024 GPUs and 1.8 h at 16,384;
  between and beyond, interpolated on a log-log line (MTTF proportional to G^-0.53).
The protections: ``storage`` (a checkpoint every 50 steps at ``STORAGE``) and ``reft`` (a snapshot in host memory
after every step, mode arc, copied at ``SNAPSHOTS``, with a flush to storage every 50 steps).

**ReCycle's comparison (SOSP'24, Section 6: "training throughput with increasing failures")**: throughput after 0, 1, 2,
4, 8 GPUs fail at once, relative to the fault-free run, for ReCycle (``policy=recycle``) and Oobleck
(``policy=oobleck``, f = 1): every policy that recovers in place (``recycle_policies``). The paper's testbed is 4 Azure
NC96ads_A100_v4 (8 A100-80GB each, NVLink inside, 640 Gb/s between nodes), GPT-3 medium / 3.35B / 6.7B at
(PP, DP) = (2, 16), (4, 8), (8, 4), no tensor parallelism.
Ours: ``cluster=a100-16x8 cluster.nodes=4`` (the analytic A100-80GB profile, one 200 Gb/s port per GPU), the same
models with ``gpt3-2.7b`` standing in for 3.35B (we have no 3.35B config), ``train.stages`` = the paper's PP and
activation checkpointing on. Choices where the paper (its slides, /work/shared/papers) is vague:
- Batch: micro-batches of 2, 8 per pipeline (global batch 16 x DP): the paper gives neither.
- Which GPUs fail: a seeded random permutation of the 32 GPUs, the first k of it for k failures (the failed sets
  grow by inclusion), all killed at the start of step ``RECYCLE_FAIL_STEP``, never replaced.
- Throughput is the steady state after the failures: global batch over the last step's iteration time (iterations
  of one plan are identical in the simulator), over the fault-free grid's (DeepSpeed's 1F1B on PP x DP, the
  paper's "Fault-Free"); "fault-scaled" (the paper's large-scale reference) is (32 - k) / 32.
- Two layouts (``RECYCLE_LAYOUTS``): ``4x8``, the paper's hardware, where a failed GPU is its worker process
  killed, and Oobleck, whose unit is the node, gives up the whole node (``policies/oobleck``: "a node whose worker
  process died counts as a lost node"); and ``32x1``, every GPU its own node (as in Oobleck's own evaluation), where
  a failed GPU is a node lost for both policies.
- Neither policy has a protection (``protection=none``): when ReCycle loses every replica of a stage, or Oobleck
  has fewer nodes than f + 1 pipelines need, the policy stops the job; the table says so instead of a figure.

Faults of the MTBF sweep are drawn from an exponential distribution (``faults=exponential``) with a fixed seed, the
same for every policy of a cell.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ftlab.policies import catalog
from ftlab.runtime.core.contract import ConfigError

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".ftlab" / "sim"
STORAGE = ["sim.storage_write_bytes_per_s=5e9", "sim.storage_read_bytes_per_s=1e10"]
SNAPSHOTS = ["sim.snapshot_bytes_per_s=1e10"]
"""A REFT snapshot's copy from an A100 into its host's memory: PCIe 4.0 x16 peaks near 25 GB/s and a DGX A100 puts
two GPUs behind each PCIe switch, so 10 GB/s per GPU: a stated assumption, not a measurement."""
HOST_MEMORY = ["protection.host_memory_gb=1024"]
"""A DGX A100's 1 TB of host memory, for the snapshots' records."""

TABLE2_MODELS = {
    "bert-large": ["model=bert-large", "train.global_batch=8192", "train.micro_batch=32"],
    "gpt3-medium": ["model=gpt3-medium", "train.global_batch=8192", "train.micro_batch=16"],
    "gpt3-2.7b": ["model=gpt3-2.7b", "train.global_batch=1024", "train.micro_batch=2"],
    "gpt3-6.7b": ["model=gpt3-6.7b", "train.global_batch=1024", "train.micro_batch=2", "train.stages=6"],
}
TABLE2_TRACES = ("6h", "1h", "10m")
PAPER_TABLE2 = {  # Oobleck's Table 2, samples/s: (Bamboo, Varuna, Oobleck) per model and trace; None: Bamboo's OOM
    "bert-large": {"6h": (77.04, 259.57, 287.10), "1h": (75.60, 245.39, 286.28), "10m": (69.84, 168.15, 282.11)},
    "gpt3-medium": {"6h": (None, 29.52, 29.30), "1h": (None, 27.61, 29.21), "10m": (None, 20.71, 28.70)},
    "gpt3-2.7b": {"6h": (None, 7.27, 7.29), "1h": (None, 6.41, 7.23), "10m": (None, 0.36, 6.89)},
    "gpt3-6.7b": {"6h": (None, 4.02, 4.33), "1h": (None, 2.91, 4.22), "10m": (None, 0.12, 3.55)},
}
PAPER_COLUMN = {"bamboo": 0, "varuna": 1, "checkpoint_restart": 1, "oobleck": 2}
"""Which of the paper's systems a policy is compared with (checkpoint-restart with Varuna, which it resembles)."""
SETTINGS = {"oobleck": ["policy.fault_threshold=1"], "bamboo": ["train.activation_checkpointing=false"]}
"""Settings a policy runs with beyond a study's own (which policies run is what their roles say): Bamboo does not
use activation checkpointing (Oobleck 7.1), which every study turns on for the others."""
BAMBOO_MICRO_BATCH = {"bert-large": 4}
"""Oobleck's Table 1: the largest micro-batch Bamboo runs per model (GPT-3 models: none, out of memory; there it
keeps the others' micro-batch and is refused for memory, the paper's OOM cells)."""
PROTECTION_SETTINGS = {
    "storage": ["protection.every=50"],
    "reft": ["protection.interval=1", "protection.flush_every=50", *HOST_MEMORY],
}
"""The MTBF sweep's protections: a checkpoint every 50 steps; a snapshot after every step, flushed every 50."""


def table2_policies() -> dict[str, list[str]]:
    """Table 2's rows, by role: the fault-free run, every policy that recovers by restarting from saved state alone
    (checkpoint-restart, Varuna) and every one that recovers in place (Oobleck, ReCycle, Bamboo, elastic); each that
    can restart checkpoints every 10 iterations (the paper's Varuna setting)."""
    roles = catalog.roles()
    compared = catalog.policies_with(lambda r: r.recovers and not r.chooses and (r.restarts_only or r.in_place))
    return {
        "fault-free": ["policy=none", "faults=none"],
        **{p: [f"policy={p}", *(["protection=storage", "protection.every=10"] if roles[p].restarts else []),
               *SETTINGS.get(p, [])] for p in compared},
    }  # fmt: skip


def combinations() -> dict[str, list[str]]:
    """The MTBF sweep's policy x protection pairs, by name: every policy found with every protection it works with."""
    return {
        f"{policy}+{protection}": [f"policy={policy}", f"protection={protection}",
                                   *PROTECTION_SETTINGS.get(protection, []), *SETTINGS.get(policy, [])]
        for policy in catalog.roles()
        for protection in catalog.component_schemas()["protection"]
        if works_with(policy, protection)
    }  # fmt: skip


def works_with(policy: str, protection: str) -> bool:
    """The policy's ``check`` accepts the protection, and a policy that does not recover is paired only with one that
    keeps nothing (it would save state nobody restores)."""
    kept = catalog.build_default("protection", protection)
    if not catalog.roles()[policy].recovers and kept.keeps_state:
        return False
    try:
        catalog.build_default("policy", policy).check(kept)
    except ConfigError:
        return False
    return True
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
    try:
        run = simulate(cfg)
    except ConfigError as refused:  # the paper's OOM cells: a job that cannot run here is a finding, not a crash
        return {"samples_per_s": None, "goodput": None, "failures": 0, "steps": 0, "plans": 0, "stopped": None,
                "refused": str(refused), "wall_s": time.perf_counter() - began}  # fmt: skip
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
            for policy, settings in table2_policies().items():
                faults = [] if policy == "fault-free" else ["faults=trace", f"faults.trace={trace}",
                                                            "faults.trace_s_per_step=null", "faults.time_compression=1"]  # fmt: skip
                micro = [f"train.micro_batch={BAMBOO_MICRO_BATCH[model]}"] if policy == "bamboo" and model in BAMBOO_MICRO_BATCH else []
                overrides = [*TABLE2_MODELS[model], "cluster=a40-30x1", "train.activation_checkpointing=true",
                             "train.steps=100000000", f"sim.horizon_s={horizon}", *STORAGE, *settings, *micro, *faults]  # fmt: skip
                cell = {"model": model, "trace": trace, "policy": policy, **simulated(overrides)}
                column = PAPER_COLUMN.get(policy)
                cell["paper"] = None if column is None else PAPER_TABLE2[model][trace][column] or "OOM"
                rows.append(cell)
                print(f"[table2] {model} {trace} {policy}: {_rate(cell)} (paper {cell['paper']}), "
                      f"{cell['failures']} failures, {cell['wall_s']:.1f} s", flush=True)
    return rows


def render_table2(rows: list[dict[str, Any]]) -> str:
    lines = ["Throughput (samples/s), simulated; in brackets Oobleck's Table 2 (Varuna for checkpoint-restart, OOM where "
             "Bamboo could not run); 'refused' = the job does not fit the cluster's memory", ""]  # fmt: skip
    models = list(dict.fromkeys(r["model"] for r in rows))
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    lines.append("| policy | " + " | ".join(f"{m} {t}" for m in models for t in traces) + " |")
    lines.append("|---" * (1 + len(models) * len(traces)) + "|")
    for policy in dict.fromkeys(r["policy"] for r in rows):
        cells = []
        for m in models:
            for t in traces:
                r = next((r for r in rows if (r["model"], r["trace"], r["policy"]) == (m, t, policy)), None)
                if r is None:
                    cells.append("")
                    continue
                paper = f" ({r['paper']})" if r["paper"] is not None else ""
                stop = " stopped" if r["stopped"] else ""
                cells.append(f"{_rate(r)}{paper}{stop}")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _rate(cell: dict[str, Any]) -> str:
    """A cell's samples/s, or ``refused`` (the job cannot run there: out of memory, in the paper's words)."""
    return "refused" if cell.get("refused") else f"{cell['samples_per_s']:.2f}"


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
            for combination, settings in combinations().items():
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
        for combination in dict.fromkeys(r["combination"] for r in rows):
            cells = []
            for g in sizes:
                r = next(r for r in rows if (r["source"], r["gpus"], r["combination"]) == (source, g, combination))
                cells.append("refused" if r.get("refused") else f"{r['goodput']:.3f}" + (" stopped" if r["stopped"] else ""))
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
        for combination in dict.fromkeys(r["combination"] for r in rows):
            points = sorted((r["gpus"], r["goodput"]) for r in rows
                            if (r["source"], r["combination"]) == (source, combination) and not r.get("refused"))  # fmt: skip
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=combination)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("goodput")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"failures at {source} rates")
        ax.legend(fontsize="small")
    return _saved(fig, path)


# -- ReCycle's comparison ------------------------------------------------------------------------------------------
RECYCLE_MODELS = {  # the paper's (PP, DP) on 32 GPUs; gpt3-2.7b stands in for its 3.35B
    "gpt3-medium": ["model=gpt3-medium", "train.stages=2", "train.global_batch=256"],
    "gpt3-2.7b": ["model=gpt3-2.7b", "train.stages=4", "train.global_batch=128"],
    "gpt3-6.7b": ["model=gpt3-6.7b", "train.stages=8", "train.global_batch=64"],
}
RECYCLE_LAYOUTS = {"4x8": (4, 8), "32x1": (32, 1)}
RECYCLE_FAILED = (0, 1, 2, 4, 8)
RECYCLE_FAIL_STEP = 3
RECYCLE_STEPS = 8
PAPER_RECYCLE = {  # ReCycle's Table 1, samples/s: fault-free DeepSpeed, and (Oobleck, ReCycle) per failure frequency
    "gpt3-medium": (27.58, {"6h": (27.26, 27.27), "2h": (25.37, 25.42), "30m": (19.47, 22.27)}),
    "gpt3-2.7b": (14.87, {"6h": (14.55, 14.59), "2h": (13.44, 14.17), "30m": (9.78, 12.63)}),
    "gpt3-6.7b": (5.33, {"6h": (4.98, 5.17), "2h": (4.65, 4.85), "30m": (2.78, 3.53)}),
}


def recycle_policies() -> tuple[str, ...]:
    """ReCycle's comparison, by role: every policy found that recovers in place (ReCycle, Oobleck), by name."""
    return catalog.policies_with(lambda roles: roles.in_place and not roles.chooses)


def failed_gpus(layout: str, count: int, seed: int = 0) -> list[str]:
    """The explicit fault events of ``count`` GPUs failing at once: the first ``count`` of a seeded permutation."""
    nodes, per_node = RECYCLE_LAYOUTS[layout]
    gpus = random.Random(seed).sample(range(nodes * per_node), nodes * per_node)[:count]
    if per_node == 1:
        return [f"{{kind: node, node: {g}, at_step: {RECYCLE_FAIL_STEP}}}" for g in gpus]
    return [f"{{kind: process, node: {g // per_node}, worker: {g % per_node}, at_step: {RECYCLE_FAIL_STEP}}}"
            for g in gpus]  # fmt: skip


def steady(cell: dict[str, Any], result: Any) -> dict[str, Any]:
    """Samples/s of the last step, if it ran after the failures (module docstring)."""
    last = result.steps[-1] if result.steps else None
    after = last is not None and last.step > RECYCLE_FAIL_STEP and result.stopped is None
    cell["steady_samples_per_s"] = last.samples / last.iter_s if after else None
    cell["pipelines_after"] = last.pipelines if after else None
    return cell


def simulated_run(overrides: list[str]) -> tuple[dict[str, Any], Any]:
    """``simulated`` with the job's result too (the steady state needs its steps)."""
    from ftlab.experiments.job import compose_config
    from ftlab.experiments.simulate import simulate

    cfg = OmegaConf.to_object(compose_config(["experiment=plain", "mode=simulate", "progress=false", *overrides]))
    began = time.perf_counter()
    try:
        result = simulate(cfg).result
    except ConfigError as refused:
        return {"stopped": None, "refused": str(refused), "plans": 0, "wall_s": time.perf_counter() - began,
                "steady_samples_per_s": None, "pipelines_after": None}, None  # fmt: skip
    cell = {"stopped": result.stopped, "plans": len(result.plans), "wall_s": time.perf_counter() - began}
    return steady(cell, result), result


def recycle_study(models: list[str], layouts: list[str], counts: list[int]) -> list[dict[str, Any]]:
    rows = []
    for model in models:
        for layout in layouts:
            nodes, per_node = RECYCLE_LAYOUTS[layout]
            base = [*RECYCLE_MODELS[model], "cluster=a100-16x8", f"cluster.nodes={nodes}",
                    f"cluster.workers_per_node={per_node}", "train.activation_checkpointing=true",
                    "train.micro_batch=2", f"train.steps={RECYCLE_STEPS}", "protection=none"]  # fmt: skip
            reference, _ = simulated_run([*base, "policy=none", "faults=none"])
            fault_free = reference["steady_samples_per_s"]
            for policy in recycle_policies():
                for count in counts:
                    faults = ["faults=explicit", f"faults.events=[{','.join(failed_gpus(layout, count))}]"]
                    cell, _ = simulated_run([*base, f"policy={policy}", *SETTINGS.get(policy, []),
                                             *(faults if count else ["faults=none"])])  # fmt: skip
                    rate = cell["steady_samples_per_s"]
                    cell.update(model=model, layout=layout, policy=policy, failed=count, fault_free=fault_free,
                                relative=None if rate is None else rate / fault_free,
                                fault_scaled=(nodes * per_node - count) / (nodes * per_node))  # fmt: skip
                    rows.append(cell)
                    shown = (f"refused: {cell['refused']}" if cell.get("refused") else "stopped: " + str(cell["stopped"])
                             if rate is None else f"{rate:.2f} samples/s ({cell['relative']:.3f})")  # fmt: skip
                    print(f"[recycle] {model} {layout} {policy} {count} failed: {shown}, {cell['wall_s']:.1f} s",
                          flush=True)  # fmt: skip
    return rows


def render_recycle(rows: list[dict[str, Any]]) -> str:
    lines = ["Throughput after k GPUs fail at once, relative to the fault-free grid (samples/s in brackets); "
             "fault-scaled = (32 - k) / 32; 'stopped' = the policy cannot continue without a protection; 'refused' = "
             "the job cannot run there (out of memory)", ""]  # fmt: skip
    counts = sorted({r["failed"] for r in rows})
    lines.append("| model | layout | policy | " + " | ".join(f"{k} failed" for k in counts) + " |")
    lines.append("|---" * (3 + len(counts)) + "|")
    for model in dict.fromkeys(r["model"] for r in rows):
        for layout in dict.fromkeys(r["layout"] for r in rows):
            for policy in (*dict.fromkeys(r["policy"] for r in rows), "fault-scaled"):
                cells = []
                for k in counts:
                    at = [r for r in rows if (r["model"], r["layout"], r["failed"]) == (model, layout, k)]
                    r = next((r for r in at if r["policy"] == policy), None)
                    if not at:
                        cells.append("")
                    elif policy == "fault-scaled":
                        cells.append(f"{at[0]['fault_scaled']:.3f}")
                    elif r is None:
                        cells.append("")
                    else:
                        cells.append("refused" if r.get("refused") else "stopped" if r["relative"] is None
                                     else f"{r['relative']:.3f} ({r['steady_samples_per_s']:.1f})")  # fmt: skip
                lines.append(f"| {model} | {layout} | {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_recycle(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(len(layouts), len(models), figsize=(4.2 * len(models), 3.2 * len(layouts)), squeeze=False)
    for i, layout in enumerate(layouts):
        for ax, model in zip(axes[i], models):
            mine = [r for r in rows if (r["model"], r["layout"]) == (model, layout)]
            counts = sorted({r["failed"] for r in mine})
            ax.plot(counts, [next(r["fault_scaled"] for r in mine if r["failed"] == k) for k in counts], "k--",
                    label="fault-scaled")  # fmt: skip
            for policy in dict.fromkeys(r["policy"] for r in mine):
                points = [(r["failed"], r["relative"]) for r in mine if r["policy"] == policy and r["relative"] is not None]
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
                lost = [r["failed"] for r in mine if r["policy"] == policy and r["relative"] is None]
                ax.plot(lost, [0.0] * len(lost), marker="x", linestyle="none", color=ax.lines[-1].get_color())
            ax.set_ylim(0, 1.1)
            ax.set_xlabel("failed GPUs (x: stopped)")
            ax.set_ylabel("throughput / fault-free")
            ax.set_title(f"{model}, {layout}")
            ax.legend(fontsize="small")
    return _saved(fig, path)


def plot_table2(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.4), squeeze=False)
    for ax, model in zip(axes[0], models):
        policies = list(dict.fromkeys(r["policy"] for r in rows))
        width = 0.81 / len(policies)  # three bars of 0.27 per trace
        for i, policy in enumerate(policies):
            values = [next(r["samples_per_s"] or 0.0 for r in rows if (r["model"], r["trace"], r["policy"]) == (model, t, policy))
                      for t in traces]  # fmt: skip
            offset = width * (i - (len(policies) - 1) / 2)
            ax.bar([j + offset for j in range(len(traces))], values, width=width, label=policy)
        ax.set_xticks(range(len(traces)), traces)
        ax.set_title(model)
        ax.set_ylabel("samples/s")
        ax.legend(fontsize="small")
    return _saved(fig, path)


def _saved(fig: Any, path: Path) -> Path:  # noqa: ANN401 - a matplotlib Figure
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_study(
    tracker: Any, name: str, rows: list[dict[str, Any]], render: Callable[[list[dict[str, Any]]], str],
    plot: Callable[[list[dict[str, Any]], Path], Path], local: Path,
) -> None:  # fmt: skip  # noqa: ANN401 - a Tracker
    """Print a study's table and log it with its plot (``<name>.md``, ``<name>.png``)."""
    text = render(rows)
    print(text)
    tracker.log_text(f"{name}.md", text)
    tracker.log_file(plot(rows, local / f"{name}.png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one model and trace, two cluster sizes, 6 hours; one model, layout 4x8 and 0, 2, 8 failed GPUs")
    parser.add_argument("--sizes", default="16,32,64,128,256,512", help="nodes of 8 GPUs for the MTBF sweep")
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--tracking-uri", default=f"sqlite:///{REPO / 'mlflow.db'}")
    parser.add_argument("--no-table2", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-recycle", action="store_true")
    parser.add_argument("--write-docs", action="store_true", help="write the studies' tables into docs/results.md")
    args = parser.parse_args()
    from ftlab.runtime.core.config import TrackingConfig
    from ftlab.runtime.reporting.tracking import Tracker

    models, traces = list(TABLE2_MODELS), list(TABLE2_TRACES)
    sizes, hours, sources = [int(n) for n in args.sizes.split(",")], args.hours, ["llama3", "meta"]
    recycle_models, layouts, counts = list(RECYCLE_MODELS), list(RECYCLE_LAYOUTS), list(RECYCLE_FAILED)
    if args.smoke:
        models, traces, sizes, hours = ["bert-large"], ["10m"], [16, 64], 6.0
        recycle_models, layouts, counts = ["gpt3-6.7b"], ["4x8"], [0, 2, 8]
    OUT.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(TrackingConfig(uri=args.tracking_uri, experiment="ftlab-sim", run_name="paper-scale"))
    tracker.start({"smoke": args.smoke, "sizes": sizes, "hours": hours}, {"backend": "sim", "study": "paper-scale"}, "")
    found: dict[str, Any] = {}
    try:
        local = Path(tempfile.mkdtemp(prefix="ftlab-sim-paper-"))
        if not args.no_table2:
            rows = found["table2"] = table2(models, traces)
            log_study(tracker, "table2", rows, render_table2, plot_table2, local)
            for r in (r for r in rows if not r.get("refused")):
                tracker.log_metrics({f"table2/{r['model']}/{r['trace']}/{r['policy']}": r["samples_per_s"]}, 0)
        if not args.no_recycle:
            rows = found["recycle"] = recycle_study(recycle_models, layouts, counts)
            log_study(tracker, "recycle", rows, render_recycle, plot_recycle, local)
            for r in rows:
                if r["relative"] is not None:
                    tracker.log_metrics({f"recycle/{r['model']}/{r['layout']}/{r['policy']}": r["relative"]}, r["failed"])
        if not args.no_sweep:
            rows = found["sweep"] = sweep(sizes, hours, sources)
            log_study(tracker, "mtbf_sweep", rows, render_sweep, plot_sweep, local)
            for r in (r for r in rows if not r.get("refused")):
                name = r["combination"].replace("+", "_with_")
                tracker.log_metrics({f"sweep/{r['source']}/{name}/goodput": r["goodput"]}, r["gpus"])
        tracker.log_text("cells.json", json.dumps(found, indent=1, default=str))
        tracker.finish()
    except BaseException as exc:
        tracker.finish(failure=f"{type(exc).__name__}: {exc}")
        raise
    (OUT / "paper.json").write_text(json.dumps(found, default=str))
    print(json.dumps({k: len(v) for k, v in found.items()}))
    if args.write_docs:
        from ftlab.experiments import results_doc

        studies = (("table2", "Oobleck's Table 2 on the simulator", render_table2),
                   ("recycle", "ReCycle's comparison on the simulator", render_recycle),
                   ("sweep", "Goodput against cluster size at published failure rates", render_sweep))
        for study, title, render in studies:
            if study in found:
                results_doc.write_section(f"sim_paper_{study}", title, render(found[study]), module="sim_paper")


if __name__ == "__main__":
    main()
