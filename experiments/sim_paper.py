"""Published tables of Oobleck, ReCycle and REFT, and Llama 3's scale, reproduced on the simulator.

    python -m ftlab.experiments.sim_paper                # every study; writes docs/results-paper.md
    python -m ftlab.experiments.sim_paper --smoke        # a few cells of each study
    python -m ftlab.experiments.sim_paper --cell ID      # one cell (its id is in the docs table), printed
    python -m ftlab.experiments.sim_paper --studies table2,recycle   # some studies (the MTBF sweep: sweep)

Every cell is one simulated job (``experiments.simulate``: the real coordinator, policies and programs on a simulated
cluster). The docs table (``--docs``, default ``docs/results-paper.md``) gives per cell the published figure, the
simulated one, their ratio and the command that prints the cell; the tables and every cell go to one MLflow run of the
experiment ``ftlab-sim``. The run ends with one JSON line:
- ``max_cell_error``: the largest relative error over the published cells of Oobleck's Table 2 and ReCycle's Table 1
  that neither collapse nor were fitted;
- ``collapses_missed``: published collapses (below ``COLLAPSE`` of the fault-free throughput, OOM, or no progress)
  that the simulation does not reproduce;
- ``orderings_reproduced`` / ``orderings_total``: per published cell, every pair of systems the paper orders (one
  ahead of the other, or level within ``LEVEL``), and how many the simulation orders alike;
- ``faster_than_fault_free``: plans after failures that run faster than their job's fault-free plan on fewer workers;
- ``llama3_sim_s``, ``llama3_effective``: wall seconds to simulate Llama 3's pre-training, and its goodput;
- ``reft_restore_speedup``: storage restore over memory restore in REFT's setup.

**Calibration**, one per model and cluster (``cluster.device_efficiency``, found by ``experiments.calibration``):
- Oobleck (cluster ``a40-30x1``, TF32 as the paper trained): the paper publishes no fault-free throughput, so each model
  is calibrated on its Oobleck 6h cell of Table 2 (a run that averages 30 down to 15 nodes); that cell is fitted and
  left out of ``max_cell_error``. Figure 10 runs at the same efficiency (same model, same cluster).
- ReCycle (cluster ``azure-a100-4x8``): each model on its published fault-free DeepSpeed throughput (27.58, 14.87,
  5.33 samples/s), which the paper equates with ReCycle's own without a failure, so with ``policy=recycle`` and no
  fault (``RECYCLE_FAULT_FREE``). ReCycle schedules its fault-free grid with the planner of its reroutes, which beats
  DeepSpeed's 1F1B by 3% on the uneven stages of 3.35B and 6.7B (``policies/recycle/policy.py``); calibrating on
  1F1B would credit every failure with that 3%. No cell of Table 1 is fitted.
- REFT and Llama 3: the default efficiency. Llama 3's published 400 TFLOP/s per GPU needs its interleaved pipeline
  schedule; ftlab's 1F1B over 16 stages at 16 micro-batches idles half the time, and no efficiency up to 1 reaches it.

**Oobleck's Table 2** (SOSP'23, Section 7.2): average samples/s of BERT-Large, GPT-2 (345M), GPT-3 medium, 2.7B and 6.7B
on 30 A40 nodes of one GPU, with the paper's batches (Table 1: 8192 in micro-batches of 32 for BERT-Large and GPT-2, 16
for medium; 1024 in micro-batches of 2 for the others), activation checkpointing on, under the bundled traces ``6h``,
``1h`` and ``10m`` (a node fails every 6 hours, hour, 10 minutes, never replaced) until 15 of the 30 nodes remain: the
run ends ``PAST_LAST_FAILURE_S`` after the 15th failure, so that it fires. Rows: a fault-free run and the paper's
systems (Oobleck with f = 1, Varuna, Bamboo); with ``--by-role``, by role (``table2_policies``), every policy that
recovers by restarting from saved state alone (checkpoint-restart, Varuna) and every one that recovers in place (Oobleck,
ReCycle, Bamboo, elastic). Each that can restart checkpoints every 10 iterations (the paper's Varuna setting). Bamboo
runs as the paper ran it (Table 1): no activation checkpointing, BERT-Large in micro-batches of 4, GPT-2 of 1; on the GPT-3 models it is refused for memory, the paper's OOM. The grid of the
fault-free run and checkpoint-restart has ``train.stages`` stages (2; 6 for 6.7B), Oobleck plans its own. A checkpoint
is written and read at 0.28 GB/s and a restart relaunches the processes in 20 s (``OOBLECK_IO``), figures derived
from the paper's Table 4 rather than from the storage servers' NVMe (see there); no failure of Table 2 is announced
(Section 7.1: only the spot evaluation used early warning).

**Oobleck's Figure 10** (Section 7.3): the same models, cluster and batches under the spot traces ``p3`` and ``scale_gcp``
replayed for 12 hours, nodes leaving and joining, each preemption announced ``GRACE_S`` before its kill (Varuna and
checkpoint-restart checkpoint then, Section 7.3's "preemption grace period"). They hear a warning at once and give
the iteration in flight up for the save, so the checkpoint is lost with the node only when the write outlasts the
grace (at ``OOBLECK_IO``'s 0.28 GB/s, 6.7B's 82 GB take 290 s). The paper gives no figures in its text, only
orderings (Oobleck ahead of Varuna ahead of Bamboo) and collapses (Bamboo runs no GPT-3 model, Varuna makes no progress
on GPT-3 6.7B): those are the published cells.

**ReCycle's Table 1** (SOSP'24): samples/s over 6 hours of GPT-3 medium, 3.35B and 6.7B at (PP, DP) = (2, 16), (4, 8),
(8, 4) on 4 Azure NC96ads_A100_v4 (8 A100-80GB, 640 Gb/s between nodes), for the fault-free grid, Bamboo, Oobleck and
ReCycle (every policy that recovers in place: ``recycle_policies``), with a GPU failing every 6 h, 2 h or 30 min, never
replaced. Choices where the paper is vague: ``gpt3-3.35b`` for its 3.35B (no such GPT-3 exists: GPT-3's 32 blocks at the
width that gives 3.35B, ``conf/model/gpt3-3.35b.yaml``); micro-batches of 2, 32 per pipeline (global batches of 1024,
512 and 256). With 8 per pipeline, 8-stage 1F1B idles 7/15 of an iteration and a failed GPU's micro-batches largely
fit into its peers' bubbles: on 6.7B one failure lengthens the iteration by 1%, eight failures by 12%.
At 32 a pipeline idles (PP - 1) / (31 + PP) of 1F1B (3-18%), and a stage with one of its DP peers lost has DP / (DP - 1)
of the work: what Table 1's 6 h column shows, one failure costing ReCycle 1-3% of its 6 hours; failures at the middle of
each period (6 h: one at 3 h; 30 min: twelve), on GPUs drawn by a seeded permutation; every GPU is a node of its own
(``cluster.nodes=32``, each with its share of the node's 640 Gb/s), so that Oobleck, whose unit is the node, loses one
GPU per failure as in the paper and not eight; the policies that can restart (Bamboo, ReCycle) checkpoint every 10
iterations to ``STORAGE``, for when they must; no activation checkpointing for any system: Bamboo runs without it
(Oobleck's Section 7.1), and ReCycle's decoupled backward keeps a micro-batch's activations until its weight gradients,
the "memory pressure" its slides plan around, which recomputation would not have; the fault-free DeepSpeed grid is then
the same pipeline without redundancy or rerouting. Oobleck's templates span at least PP nodes (``policy.min_nodes``,
``recycle_settings``): the paper runs every system at its (PP, DP), and its Oobleck reaches 0.988 of DeepSpeed's
throughput with one failure in 6 h, where one-GPU templates (pure data parallelism, which an 80 GB A100 fits without
activation checkpointing) run 19% ahead of it in the simulation.

**Where the simulation departs from the published cells** (what ``max_cell_error`` and the missed orderings come from;
nothing is fitted to them):
- Bamboo in Oobleck's Table 2: 3.0-4.3x the published samples/s. The simulation runs Bamboo's design as the papers
  describe it (a redundant forward, a copy of the next stage, Table 1's micro-batches of 4 and 1, no activation
  checkpointing) at the model's calibrated efficiency and keeps about 0.7 of the fault-free throughput; the published
  cells are about a quarter of Oobleck's, a gap Oobleck's authors call surprising and put down to their environment and
  to indirect costs they could not separate (Sections 7.2 and 7.4.2).
- Varuna at 10m on GPT-2 and GPT-3 medium: at the published rates an iteration of 8192 samples takes about 95 and 280
  seconds, so a checkpoint every 10 iterations comes every 16 and 47 minutes, after the next failure: no checkpoint
  commits and the simulation collapses, where the paper reports 69.67 and 20.71 samples/s. The paper's checkpoint interval and
  these two cells do not agree; the simulation keeps the interval.
- Oobleck at 10m on GPT-3 medium: 0.75 of the published figure. A failure every 600 s loses half of a 280 s iteration on
  average, where the paper reports 2% below its 6h cell.
- Oobleck in ReCycle's Table 1 at 30 min: 1.2-1.6x the published figures, which ReCycle's slides put down to Oobleck's
  "imbalanced pipelines and higher reconfiguration latency (re-shuffle)" without figures. The simulated Oobleck
  reconfigures in seconds and plans its own templates, whose fault-free throughput is 7% and 4.5% above ReCycle's
  fault-free grid on GPT-3 medium and 6.7B (3% below on 3.35B), so it comes out ahead of ReCycle on those two, against
  the paper's ordering.
- ReCycle's first failure costs more than the paper's: on 3.35B and 6.7B one failure in 6 h leaves 0.96 and 0.90 of
  the fault-free throughput (published 0.98 and 0.97), twelve in 30 min 0.71 and 0.72 (published 0.85 and 0.66). The
  failed GPU's stage peers absorb its micro-batches, DP / (DP - 1) of their work (4/3 at DP 4), which the pipeline's
  bubbles (18% at PP 8) only partly hide; later failures in other stages add work beside that bottleneck rather than
  to it. What a failure costs depends on its stage: the grid splits 6.7B's 34 layers 5/5/4/.../4 (DeepSpeed's uniform
  partition), so losing a GPU of stage 1 (five blocks) lengthens the iteration by 24%, of stage 0 (embedding and four
  blocks) by 15%, of the others by 4-10%. Megatron-DeepSpeed's GPT pipeline partitions by transformer block instead
  (four on every stage, the embedding and the head beside the first and last): tried, it brings ReCycle's 3.35B and
  6.7B cells at 6 h and 2 h closer to the published ones, but the slower fault-free grid raises the calibrated
  efficiency and Oobleck's cells move further off (6.7B at 30 min: 1.63x), so the grid keeps the uniform split.

**REFT** (Section 7.4, Figure 12): restoring Llama-2 1.3B trained with (TP, PP, DP) = (4, 4, 8) on 128 V100s from NFS
(9.27 s) and from host memory (ARC 0.84 s, AEC 0.75 s), after a node is lost. ftlab has no tensor parallelism: on
REFT's cluster (``v100-128x4``, 32 of its nodes of four V100s) one worker per node stands for the node's TP group, so
4 stages x 8 pipelines with each node holding one stage, as REFT's nodes do (its compute is one V100's, which the
restore does not depend on). NFS is 10 Gb/s for all readers together (``NFS``), a snapshot is copied at
``V100_SNAPSHOTS``. The snapshot overhead (Table 3: less than 3%) is the iteration time with a snapshot every
iteration over without.

**Llama 3 405B** (Dubey et al. 2024, Section 3.3.4): 54 days on 16,384 H100s with 419 unexpected interruptions and more
than 90% effective training time. A worker is one node's eight H100s, tensor-parallel over NVLink as the paper ran them
(TP 8: device ``H100-80GBx8``, cluster ``h100-2048x8``), 16 pipeline stages, 128 pipelines, 2048 sequences of 8192
tokens per step in micro-batches of 1; checkpoint-restart with a checkpoint every ``LLAMA3_EVERY`` steps to storage at
2 TB/s (Tectonic's sustained throughput, Section 3.3.1); interruptions drawn from an exponential distribution at the
published rate, each failed node replaced by a spare at once. Effective training time is the run's goodput.

The MTBF sweep (``--studies sweep``): goodput of ``llama2-6.7b`` against cluster size at Llama 3's and Meta's research
clusters' failure rates, for every policy with every protection it works with (``combinations``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ftlab.experiments.calibration import calibrated_efficiency, search
from ftlab.policies import catalog
from ftlab.runtime.control.events import StateRestored
from ftlab.runtime.core.contract import ConfigError

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".ftlab" / "sim"
DOCS = REPO / "docs" / "results-paper.md"
COLLAPSE = 0.15
"""A throughput below this fraction of the fault-free one is a collapse (the paper's 0.36 and 0.12 samples/s)."""
LEVEL = 0.03
"""Two systems within this relative difference are level, not one ahead of the other."""
STORAGE = ["sim.storage_write_bytes_per_s=5e9", "sim.storage_read_bytes_per_s=1e10"]
"""Checkpoint storage where a study's paper gives no figure to derive it from (ReCycle's Table 1, the MTBF sweep):
5 GB/s of writes and 10 GB/s of reads, a stated assumption."""
SNAPSHOTS = ["sim.snapshot_bytes_per_s=1e10"]
"""A REFT snapshot's copy from an A100 into its host's memory: PCIe 4.0 x16 peaks near 25 GB/s and a DGX A100 puts
two GPUs behind each PCIe switch, so 10 GB/s per GPU: a stated assumption, not a measurement."""
HOST_MEMORY = ["protection.host_memory_gb=1024"]
"""A DGX A100's 1 TB of host memory, for the snapshots' records."""

# -- Oobleck: Table 2 and Figure 10 ---------------------------------------------------------------------------------
OOBLECK_IO = ["sim.storage_write_bytes_per_s=2.8e8", "sim.storage_read_bytes_per_s=2.8e8", "sim.process_start_s=20"]
"""Varuna's checkpoints and restarts on Oobleck's cluster, from the paper's Table 4 (Varuna beside Varuna with no
checkpoint overhead, which checkpoints every 2 iterations instead of 10) and not from Table 2's cells. At 6h, where
failures are rare, removing the saves lifts BERT-Large from 259.57 to 275.27 samples/s and GPT-3 6.7B from 4.02 to
4.57: a save every 10 iterations (~27 s and ~228 s each) costs 6% and 14% of the time, ~16 s for BERT-Large's
4.4 GB and ~310 s for 6.7B's 82 GB, 0.27-0.28 GB/s. At 10m without save costs, a failure costs BERT-Large ~64 s
and 6.7B ~550 s; less the iteration lost on average (a checkpoint every 2), the restart (Section 7.4.3: framework
initialisation plus loading the checkpoint) takes ~37 s and ~325 s: loading at ~0.27 GB/s after ~20 s of relaunch.
One rate for both ways, as of one ``torch.save`` / ``torch.load`` stream per stage through the MinIO object store.
It agrees with Section 7.3's account of the spot traces, where 6.7B's checkpoint cannot be written within a
preemption's grace period and the small models' can (at 30 s: between 0.17 and 2.7 GB/s), which the storage
servers' NVMe bandwidth (GB/s) would contradict."""
OOBLECK_CLUSTER = ["cluster=a40-30x1", "train.precision=tf32", "train.activation_checkpointing=true", *OOBLECK_IO]
OOBLECK_MODELS = {
    "bert-large": ["model=bert-large", "train.global_batch=8192", "train.micro_batch=32"],
    "gpt2-medium": ["model=gpt2-medium", "train.global_batch=8192", "train.micro_batch=32"],
    "gpt3-medium": ["model=gpt3-medium", "train.global_batch=8192", "train.micro_batch=16"],
    "gpt3-2.7b": ["model=gpt3-2.7b", "train.global_batch=1024", "train.micro_batch=2"],
    "gpt3-6.7b": ["model=gpt3-6.7b", "train.global_batch=1024", "train.micro_batch=2", "train.stages=6"],
}
TABLE2_TRACES = ("6h", "1h", "10m")
PAST_LAST_FAILURE_S = 1.0
PAPER_TABLE2 = {  # Oobleck's Table 2, samples/s: (Bamboo, Varuna, Oobleck) per model and trace; "OOM": Bamboo's
    "bert-large": {"6h": (77.04, 259.57, 287.10), "1h": (75.60, 245.39, 286.28), "10m": (69.84, 168.15, 282.11)},
    "gpt2-medium": {"6h": (17.47, 86.42, 85.59), "1h": (17.13, 83.94, 85.42), "10m": (16.01, 69.67, 84.80)},
    "gpt3-medium": {"6h": ("OOM", 29.52, 29.30), "1h": ("OOM", 27.61, 29.21), "10m": ("OOM", 20.71, 28.70)},
    "gpt3-2.7b": {"6h": ("OOM", 7.27, 7.29), "1h": ("OOM", 6.41, 7.23), "10m": ("OOM", 0.36, 6.89)},
    "gpt3-6.7b": {"6h": ("OOM", 4.02, 4.33), "1h": ("OOM", 2.91, 4.22), "10m": ("OOM", 0.12, 3.55)},
}
OOBLECK_SYSTEMS = ("bamboo", "varuna", "oobleck")
"""The systems of Oobleck's evaluation, in the order of its tables."""
CALIBRATION_TRACE = "6h"
"""Each model's Oobleck cell of this trace is what its efficiency is solved for (module docstring)."""
SETTINGS = {"oobleck": ["policy.fault_threshold=1"],
            "bamboo": ["train.activation_checkpointing=false", "model.attention=eager_dropout"]}  # fmt: skip
"""Settings a policy runs with beyond a study's own: Bamboo does not use activation checkpointing (Oobleck 7.1), and
its implementation, on DeepSpeed's pipeline engine from before fused attention kernels (FlashAttention, 2022), keeps
each block's attention probabilities, their dropout mask and the dropped probabilities. The other systems keep the
runtime's fused attention, an assumption: their papers do not say, and with unfused attention ReCycle's 3.35B and
6.7B cells fall to 0.78-0.88 of its published near fault-free throughput (rerouting runs out of memory headroom)."""
BAMBOO_MICRO_BATCH = {"bert-large": 4, "gpt2-medium": 1}
"""Oobleck's Table 1: the largest micro-batch Bamboo runs per model (GPT-3 models: none, out of memory; there it
keeps the others' micro-batch and is refused for memory, the paper's OOM cells)."""
FIGURE10_TRACES = ("p3", "scale_gcp")
FIGURE10_HOURS = 12.0
GRACE_S = 30.0
"""A spot preemption's notice: GCP's 30 s; EC2 gives two minutes, more than some gaps of the P3 trace."""
FIGURE10_COLLAPSES = {("gpt3-medium", "bamboo"): "OOM", ("gpt3-2.7b", "bamboo"): "OOM",
                      ("gpt3-6.7b", "bamboo"): "OOM", ("gpt3-6.7b", "varuna"): "no progress"}  # fmt: skip

# -- ReCycle: Table 1 ----------------------------------------------------------------------------------------------
RECYCLE_CLUSTER = ["cluster=azure-a100-4x8", "cluster.nodes=32", "cluster.workers_per_node=1",
                   "cluster.node_network_gbps=80", "train.precision=bf16", "train.activation_checkpointing=false",
                   "train.micro_batch=2", *STORAGE]  # fmt: skip
RECYCLE_MODELS = {  # the paper's (PP, DP) on 32 GPUs, 32 micro-batches of 2 per pipeline
    "gpt3-medium": ["model=gpt3-medium", "train.stages=2", "train.global_batch=1024"],
    "gpt3-3.35b": ["model=gpt3-3.35b", "train.stages=4", "train.global_batch=512"],
    "gpt3-6.7b": ["model=gpt3-6.7b", "train.stages=8", "train.global_batch=256"],
}
RECYCLE_PERIODS_S = {"6h": 6 * 3600.0, "2h": 2 * 3600.0, "30m": 1800.0}
RECYCLE_HOURS = 6.0
PAPER_RECYCLE = {  # ReCycle's Table 1, samples/s: fault-free DeepSpeed, and per period (Bamboo, Oobleck, ReCycle)
    "gpt3-medium": (27.58, {"6h": (19.47, 27.26, 27.27), "2h": (18.98, 25.37, 25.42), "30m": (15.24, 19.47, 22.27)}),
    "gpt3-3.35b": (14.87, {"6h": ("OOM", 14.55, 14.59), "2h": ("OOM", 13.44, 14.17), "30m": ("OOM", 9.78, 12.63)}),
    "gpt3-6.7b": (5.33, {"6h": ("OOM", 4.98, 5.17), "2h": ("OOM", 4.65, 4.85), "30m": ("OOM", 2.78, 3.53)}),
}
RECYCLE_SYSTEMS = ("bamboo", "oobleck", "recycle")
RECYCLE_FAULT_FREE = ["policy=recycle", "faults=none"]
"""Table 1's fault-free column: ReCycle's own plan without a failure, which the paper equates with DeepSpeed's."""

# -- REFT ----------------------------------------------------------------------------------------------------------
NFS = ["sim.storage_read_bytes_per_s=1.25e9", "sim.storage_write_bytes_per_s=1.25e9"]
"""REFT's NFS "via 10Gbps networks" (Section 7.1), read as 10 Gb/s for every reader together: an assumption."""
V100_SNAPSHOTS = ["sim.snapshot_bytes_per_s=1e10"]
"""A V100's copy into its host's memory over PCIe 3.0 x16 (16 GB/s peak): 10 GB/s, an assumption."""
REFT_JOB = ["model=llama2-1.3b", "cluster=v100-128x4", "cluster.nodes=32", "cluster.workers_per_node=1",
            "train.stages=4", "train.precision=fp16", "train.global_batch=64", "train.micro_batch=2",
            "train.activation_checkpointing=true", "train.steps=8", *NFS, *V100_SNAPSHOTS]  # fmt: skip
REFT_KILL = "faults.events=[{kind: node, node: 1, at_step: 6}]"
PAPER_REFT = {"storage": 9.27, "arc": 0.84, "aec": 0.75}
"""REFT's Figure 12: seconds to load the checkpoint from NFS, and from host memory under ARC and AEC."""
PAPER_REFT_OVERHEAD = 0.03
"""REFT's Table 3: a snapshot every iteration costs less than 3% of throughput."""

# -- Llama 3 -------------------------------------------------------------------------------------------------------
LLAMA3_DAYS = 54.0
LLAMA3_INTERRUPTIONS = 419
LLAMA3_EFFECTIVE = 0.90
LLAMA3_EVERY = 20
"""Steps between checkpoints: about Young's optimum, sqrt(2 x checkpoint time x MTBF) = sqrt(2 x 4 s x 11,100 s)
= 300 s, some 20 steps of ftlab's 16 s."""
LLAMA3_JOB = ["model=llama3-405b", "cluster=h100-2048x8", "train.stages=16", "train.global_batch=2048",
              "train.micro_batch=1", "train.activation_checkpointing=true", "train.precision=bf16",
              "policy=checkpoint_restart", "protection=storage", f"protection.every={LLAMA3_EVERY}",
              "sim.storage_write_bytes_per_s=2e12", "sim.storage_read_bytes_per_s=2e12"]  # fmt: skip


@dataclass
class Cell:
    """One simulated job beside the figure a paper published for it."""

    study: str
    model: str
    setting: str
    """The failure rate, trace or measure."""
    system: str
    """The policy (or ``fault-free``)."""
    published: float | str | None
    """The paper's figure; a collapse in words (``OOM``, ``no progress``); None where it publishes none."""
    overrides: list[str]
    metric: str = "samples_per_s"
    """What ``simulated`` is: samples_per_s, goodput, restore_s or iter_s (``measure``)."""
    fitted: bool = False
    """The calibration solved for this cell: it matches by construction."""
    simulated: float | None = None
    """None: refused (out of memory) or stopped before any step."""
    refused: str | None = None
    stopped: str | None = None
    failures: int = 0
    faster: int = 0
    """Plans after failures faster than the job's fault-free plan (``runtime.sim.fault_free``)."""
    wall_s: float = 0.0

    @property
    def id(self) -> str:
        return f"{self.study}/{self.model}/{self.setting}/{self.system}"

    @property
    def collapsed_in_paper(self) -> bool:
        return isinstance(self.published, str)


# -- running a job -------------------------------------------------------------------------------------------------
def run_job(overrides: list[str]) -> Any:  # noqa: ANN401 - a Simulated
    from ftlab.experiments.simulate import simulate

    return simulate(job_config(overrides))


def job_config(overrides: list[str]) -> Any:  # noqa: ANN401 - a JobConfig
    from ftlab.experiments.job import compose_config

    return OmegaConf.to_object(compose_config(["experiment=plain", "mode=simulate", "progress=false", *overrides]))


def measure(cell: Cell) -> Cell:
    """Run the cell's job and fill in what it gives; a job refused for memory is the paper's OOM, not a crash."""
    began = time.perf_counter()
    try:
        simulated = run_job(cell.overrides)
    except ConfigError as refused:
        cell.refused, cell.wall_s = str(refused), time.perf_counter() - began
        return cell
    cell.wall_s = time.perf_counter() - began
    result = simulated.result
    cell.stopped = result.stopped
    cell.failures = sum(f.noticed_at is not None for f in result.faults)
    cell.faster = len(simulated.faster_than_fault_free)
    if cell.metric == "restore_s":
        loads = [e.seconds for e in result.events if isinstance(e, StateRestored)]
        cell.simulated = max(loads) if loads else None
    elif cell.metric == "iter_s":
        cell.simulated = min(s.iter_s for s in result.steps) if result.steps else None
    else:
        key = "summary/goodput_ratio" if cell.metric == "goodput" else "summary/samples_per_s"
        cell.simulated = result.summary.get(key, 0.0)
    return cell


def efficiency(value: float) -> str:
    return f"cluster.device_efficiency={value:.6g}"


# -- Oobleck's Table 2 and Figure 10 -------------------------------------------------------------------------------
def table2_policies() -> dict[str, list[str]]:
    """Table 2's rows, by role: the fault-free run, every policy that recovers by restarting from saved state alone
    and every one that recovers in place."""
    compared = catalog.policies_with(lambda r: r.recovers and not r.chooses and (r.restarts_only or r.in_place))
    return {"fault-free": ["policy=none", "faults=none"], **{p: policy_settings(p) for p in compared}}


def policy_settings(policy: str) -> list[str]:
    """The policy, with a checkpoint every 10 iterations where it can restart (the paper's Varuna setting), and its
    own ``SETTINGS``."""
    restarts = catalog.roles()[policy].restarts
    return [f"policy={policy}", *(["protection=storage", "protection.every=10"] if restarts else []),
            *SETTINGS.get(policy, [])]  # fmt: skip


def trace_end_s(trace: str) -> float:
    """Until half the nodes remain, as the paper measures: just past the synthetic trace's 15th (last) failure."""
    from ftlab.faults.schedules import ClusterShape, FaultsConfig, build_schedule

    events = build_schedule(FaultsConfig(schedule="trace", trace=trace, time_compression=1.0), ClusterShape(30, 1))
    return max(e.at_time_s or 0.0 for e in events) + PAST_LAST_FAILURE_S


def oobleck_job(model: str, policy: str, settings: list[str], faults: list[str], horizon_s: float) -> list[str]:
    micro = [f"train.micro_batch={BAMBOO_MICRO_BATCH[model]}"] if policy == "bamboo" and model in BAMBOO_MICRO_BATCH else []
    return [*OOBLECK_MODELS[model], *OOBLECK_CLUSTER, "train.steps=100000000", f"sim.horizon_s={horizon_s:g}",
            *settings, *micro, *([] if policy == "fault-free" else faults)]  # fmt: skip


def trace_faults(trace: str, *extra: str) -> list[str]:
    return ["faults=trace", f"faults.trace={trace}", "faults.trace_s_per_step=null", "faults.time_compression=1", *extra]


@functools.cache
def oobleck_efficiency(model: str) -> float:
    """The efficiency at which the model's Oobleck cell of ``CALIBRATION_TRACE`` gives the published figure."""
    trace = CALIBRATION_TRACE
    job = oobleck_job(model, "oobleck", table2_policies()["oobleck"], trace_faults(trace), trace_end_s(trace))

    def throughput(e: float) -> float:
        return run_job([*job, efficiency(e)]).result.summary["summary/samples_per_s"]

    target = PAPER_TABLE2[model][trace][OOBLECK_SYSTEMS.index("oobleck")]
    found, reached = search(throughput, target, job_config(job).cluster.device_efficiency)
    print(f"[calibration] {model} on a40-30x1: {efficiency(found)} ({reached:.4g} samples/s, published {target})",
          flush=True)  # fmt: skip
    return found


def table2_cells(models: list[str], traces: list[str], by_role: bool) -> list[Cell]:
    """The paper's systems and the fault-free run; with ``by_role``, every other policy of the same roles too."""
    policies = {p: s for p, s in table2_policies().items() if by_role or p in ("fault-free", *OOBLECK_SYSTEMS)}
    cells = []
    for model in models:
        for trace in traces:
            for policy, settings in policies.items():
                published = PAPER_TABLE2[model][trace][OOBLECK_SYSTEMS.index(policy)] if policy in OOBLECK_SYSTEMS else None
                job = oobleck_job(model, policy, settings, trace_faults(trace), trace_end_s(trace))
                cells.append(Cell("table2", model, trace, policy, published, [*job, efficiency(oobleck_efficiency(model))],
                                  fitted=policy == "oobleck" and trace == CALIBRATION_TRACE))  # fmt: skip
    return cells


def figure10_cells(models: list[str], traces: list[str]) -> list[Cell]:
    policies = {p: s for p, s in table2_policies().items() if p in (*OOBLECK_SYSTEMS, "fault-free")}
    cells = []
    for model in models:
        for trace in traces:
            for policy, settings in policies.items():
                faults = trace_faults(trace, f"faults.warning_s={GRACE_S:g}")
                job = oobleck_job(model, policy, settings, faults, FIGURE10_HOURS * 3600)
                cells.append(Cell("figure10", model, trace, policy, FIGURE10_COLLAPSES.get((model, policy)),
                                  [*job, efficiency(oobleck_efficiency(model))]))  # fmt: skip
    return cells


# -- ReCycle's Table 1 ---------------------------------------------------------------------------------------------
def recycle_policies() -> tuple[str, ...]:
    """ReCycle's comparison, by role: every policy found that recovers in place (ReCycle, Oobleck, Bamboo, ...)."""
    return catalog.policies_with(lambda roles: roles.in_place and not roles.chooses)


def gpu_failures(period_s: float, hours: float, gpus: int = 32, seed: int = 0) -> list[str]:
    """One GPU (a node of ``RECYCLE_CLUSTER``) failing at the middle of each period, drawn by a seeded permutation."""
    count = int(hours * 3600 / period_s)
    chosen = random.Random(seed).sample(range(gpus), gpus)[:count]
    events = [f"{{kind: node, node: {g}, at_time_s: {(k + 0.5) * period_s:g}}}" for k, g in enumerate(chosen)]
    return ["faults=explicit", f"faults.events=[{','.join(events)}]"]


def recycle_settings(policy: str, model: str) -> list[str]:
    """The policy's settings in ReCycle's study: Oobleck's pipelines at least the table's pipeline depth, every system
    running at the paper's (PP, DP)."""
    depth = next(o.removeprefix("train.stages=") for o in RECYCLE_MODELS[model] if o.startswith("train.stages="))
    return [*policy_settings(policy), *([f"policy.min_nodes={depth}"] if policy == "oobleck" else [])]


def recycle_job(model: str, *extra: str) -> list[str]:
    return [*RECYCLE_MODELS[model], *RECYCLE_CLUSTER, "train.steps=100000000",
            f"sim.horizon_s={RECYCLE_HOURS * 3600:g}", *extra]  # fmt: skip


@functools.cache
def recycle_efficiency(model: str) -> float:
    """The efficiency at which ReCycle's fault-free plan gives the published fault-free throughput."""
    found = calibrated_efficiency(job_config([*RECYCLE_MODELS[model], *RECYCLE_CLUSTER, *RECYCLE_FAULT_FREE,
                                              f"sim.calibrate_samples_per_s={PAPER_RECYCLE[model][0]}"]))
    print(f"[calibration] {model} on azure-a100-4x8: {efficiency(found)}", flush=True)
    return found


def recycle_cells(models: list[str], periods: list[str]) -> list[Cell]:
    cells = []
    for model in models:
        fault_free, published = PAPER_RECYCLE[model]
        calibrated = efficiency(recycle_efficiency(model))
        for period in periods:
            cells.append(Cell("recycle", model, period, "fault-free", fault_free,
                              recycle_job(model, *RECYCLE_FAULT_FREE, calibrated), fitted=True))  # fmt: skip
            for policy in recycle_policies():
                paper = published[period][RECYCLE_SYSTEMS.index(policy)] if policy in RECYCLE_SYSTEMS else None
                faults = gpu_failures(RECYCLE_PERIODS_S[period], RECYCLE_HOURS)
                cells.append(Cell("recycle", model, period, policy, paper,
                                  recycle_job(model, *recycle_settings(policy, model), *faults, calibrated)))
    return cells


# -- REFT ----------------------------------------------------------------------------------------------------------
def reft_cells() -> list[Cell]:
    restore = ["policy=checkpoint_restart", "faults=explicit", REFT_KILL]
    reft = ["protection=reft", "protection.interval=1", "protection.flush_every=1000", *HOST_MEMORY]
    return [
        Cell("reft", "llama2-1.3b", "restore", "storage", PAPER_REFT["storage"],
             [*REFT_JOB, *restore, "protection=storage", "protection.every=5"], metric="restore_s"),
        Cell("reft", "llama2-1.3b", "restore", "arc", PAPER_REFT["arc"],
             [*REFT_JOB, *restore, *reft, "protection.mode=arc"], metric="restore_s"),
        Cell("reft", "llama2-1.3b", "restore", "aec", PAPER_REFT["aec"],
             [*REFT_JOB, *restore, *reft, "protection.mode=aec"], metric="restore_s"),
        Cell("reft", "llama2-1.3b", "iteration", "none", None, [*REFT_JOB, "policy=none"], metric="iter_s"),
        Cell("reft", "llama2-1.3b", "iteration", "arc", None, [*REFT_JOB, "policy=none", *reft, "protection.mode=arc"],
             metric="iter_s"),
    ]  # fmt: skip


def reft_figures(cells: list[Cell]) -> dict[str, tuple[str, float | None]]:
    """REFT's ratios, published (in words) and simulated: the restore from storage over the restore from memory,
    and what a snapshot every iteration adds to the iteration time."""
    by = {(c.setting, c.system): c.simulated for c in cells if c.study == "reft"}
    storage, memory = by.get(("restore", "storage")), by.get(("restore", "arc"))
    plain, snapshots = by.get(("iteration", "none")), by.get(("iteration", "arc"))
    return {
        "restore_speedup": (f"{PAPER_REFT['storage'] / PAPER_REFT['arc']:.1f} (ARC; target: at least 10)",
                            storage / memory if storage and memory else None),
        "snapshot_overhead": (f"less than {PAPER_REFT_OVERHEAD:.0%}", snapshots / plain - 1 if plain and snapshots else None),
    }  # fmt: skip


# -- Llama 3 -------------------------------------------------------------------------------------------------------
def llama3_cell(days: float) -> Cell:
    mtbf = LLAMA3_DAYS * 86400 / LLAMA3_INTERRUPTIONS
    faults = ["faults=exponential", "faults.mtbf_steps=null", f"faults.mtbf_s={mtbf:.6g}", "faults.max_failures=null",
              f"faults.horizon_s={days * 86400:g}", "faults.replace_after_s=0", "faults.seed=0"]  # fmt: skip
    return Cell("llama3", "llama3-405b", f"{days:g}d", "checkpoint_restart", LLAMA3_EFFECTIVE,
                [*LLAMA3_JOB, "train.steps=1000000000", f"sim.horizon_s={days * 86400:g}", *faults], metric="goodput")


# -- scoring -------------------------------------------------------------------------------------------------------
def reference_of(cells: list[Cell], cell: Cell) -> Cell | None:
    """The fault-free run beside ``cell``."""
    return next((c for c in cells if (c.study, c.model, c.setting, c.system) ==
                 (cell.study, cell.model, cell.setting, "fault-free")), None)  # fmt: skip


def fault_free(cells: list[Cell], cell: Cell) -> float | None:
    reference = reference_of(cells, cell)
    return None if reference is None else reference.simulated


def collapsed(cells: list[Cell], cell: Cell) -> bool:
    """The simulation collapses: refused, stopped before any progress, or below ``COLLAPSE`` of fault-free."""
    reference = fault_free(cells, cell)
    return cell.simulated is None or not cell.simulated or (reference is not None and cell.simulated < COLLAPSE * reference)


def published_collapse(cells: list[Cell], cell: Cell) -> bool:
    reference = fault_free(cells, cell)
    if cell.collapsed_in_paper:
        return True
    return isinstance(cell.published, float) and reference is not None and cell.published < COLLAPSE * reference


def error(cell: Cell) -> float | None:
    """Relative error of a published number (None where the paper has none); a simulation refused or stopped
    before any progress is off by all of it."""
    if not isinstance(cell.published, float):
        return None
    return abs((cell.simulated or 0.0) / cell.published - 1)


@dataclass(frozen=True)
class Ordering:
    """Two systems of one published cell as the paper orders them: ``ahead`` ahead of ``behind``, or level."""

    where: str
    ahead: str
    behind: str
    level: bool
    reproduced: bool


def orderings(cells: list[Cell]) -> list[Ordering]:
    """Every pair of systems in a published cell of the tables (a collapse ranks last), and Figure 10's orderings:
    Oobleck ahead of Varuna ahead of Bamboo, each on every model it runs."""
    found = []
    groups: dict[tuple[str, str, str], dict[str, Cell]] = {}
    for c in cells:
        groups.setdefault((c.study, c.model, c.setting), {})[c.system] = c
    for (study, model, setting), systems in groups.items():
        where = f"{study}/{model}/{setting}"
        if study == "figure10":
            chain = [s for s in ("oobleck", "varuna", "bamboo") if s in systems]
            pairs = [(a, b, False) for i, a in enumerate(chain) for b in chain[i + 1:]
                     if (model, a) not in FIGURE10_COLLAPSES]  # fmt: skip
        else:
            ranked = {s: (0.0 if c.collapsed_in_paper else c.published) for s, c in systems.items()
                      if c.published is not None}  # fmt: skip
            pairs = []
            for a, b in ((a, b) for a in ranked for b in ranked if a < b):
                hi, lo = (a, b) if ranked[a] >= ranked[b] else (b, a)
                pairs.append((hi, lo, _level(ranked[hi], ranked[lo])))
        for ahead, behind, level in pairs:
            got_a, got_b = (systems[s].simulated or 0.0 for s in (ahead, behind))
            same = _level(got_a, got_b) if level else got_a > got_b and not _level(got_a, got_b)
            found.append(Ordering(where, ahead, behind, level, same))
    return found


def _level(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= LEVEL * max(a, b)


def score(cells: list[Cell]) -> dict[str, Any]:
    """The study's JSON line (module docstring)."""
    tables = [c for c in cells if c.study in ("table2", "recycle") and c.system != "fault-free"]
    errors = [error(c) for c in tables if not c.fitted and not published_collapse(cells, c)]
    found = orderings(cells)
    llama3 = next((c for c in cells if c.study == "llama3"), None)
    return {
        "max_cell_error": max((e for e in errors if e is not None), default=None),
        "collapses_missed": sum(published_collapse(cells, c) and not collapsed(cells, c) for c in cells),
        "orderings_reproduced": sum(o.reproduced for o in found),
        "orderings_total": len(found),
        "faster_than_fault_free": sum(c.faster for c in cells),
        "llama3_sim_s": llama3.wall_s if llama3 else None,
        "llama3_effective": llama3.simulated if llama3 else None,
        "reft_restore_speedup": reft_figures(cells)["restore_speedup"][1],
    }


# -- the docs table ------------------------------------------------------------------------------------------------
def render(cells: list[Cell], study: str) -> str:
    lines = ["| cell | published | simulated | ratio | of fault-free, published / simulated | failures | command |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in (c for c in cells if c.study == study):
        lines.append(f"| {c.model} {c.setting} {c.system} | {_published(c)} | {_simulated(c)} | {_ratio(c, cells)} "
                     f"| {_of_fault_free(c, cells)} | {c.failures} "
                     f"| `python -m ftlab.experiments.sim_paper --cell {c.id}` |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _of_fault_free(c: Cell, cells: list[Cell]) -> str:
    """The cell as a fraction of its fault-free run: published where the paper gives both figures, and simulated."""
    reference = reference_of(cells, c)
    if reference is None or c is reference or c.metric != "samples_per_s":
        return ""
    paper = (f"{c.published / reference.published:.3f}" if isinstance(c.published, float)
             and isinstance(reference.published, float) else "-")  # fmt: skip
    got = f"{c.simulated / reference.simulated:.3f}" if c.simulated is not None and reference.simulated else "-"
    return f"{paper} / {got}"


def _published(c: Cell) -> str:
    if c.published is None:
        return ""
    if c.study == "llama3":
        return f"> {c.published:.0%}"
    return c.published if isinstance(c.published, str) else f"{c.published:g}"


def _simulated(c: Cell) -> str:
    if c.refused:
        return "OOM (refused)"
    if c.simulated is None:
        return f"stopped: {c.stopped}" if c.stopped else "none"
    text = f"{c.simulated:.1%}" if c.metric == "goodput" else f"{c.simulated:.3g}"
    return text + (" (stopped)" if c.stopped else "")


def _ratio(c: Cell, cells: list[Cell]) -> str:
    if published_collapse(cells, c):
        return "collapse " + ("reproduced" if collapsed(cells, c) else "MISSED")
    if not isinstance(c.published, float) or c.simulated is None:
        return ""
    return f"{c.simulated / c.published:.3f}" + (" (fitted)" if c.fitted else "")


TITLES = {
    "table2": ("Oobleck's Table 2: samples/s under a node failure every 6 h, 1 h, 10 min",
               "Calibrated per model on its Oobleck 6h cell (fitted, left out of max_cell_error); Varuna's column is "
               "the varuna policy; rows without a published figure are the other policies of the same roles."),
    "figure10": ("Oobleck's Figure 10: samples/s over 12 h of the P3 and GCP spot traces",
                 "The paper publishes orderings only (Oobleck ahead of Varuna ahead of Bamboo) and collapses (Bamboo's "
                 "OOM on GPT-3, Varuna's lack of progress on GPT-3 6.7B)."),
    "recycle": ("ReCycle's Table 1: samples/s over 6 h with a GPU failing every 6 h, 2 h, 30 min",
                "Calibrated per model on the fault-free DeepSpeed figure, run as ReCycle's plan with no failure "
                "(policy=recycle); gpt3-3.35b is GPT-3's 32 blocks at the width that gives 3.35B."),
    "reft": ("REFT: restore from NFS and from host memory (Figure 12), snapshot overhead (Table 3)",
             "Restore: the slowest worker's load, seconds. Iteration: seconds per iteration without and with a "
             "snapshot every iteration."),
    "llama3": ("Llama 3 405B pre-training: effective training time", ""),
    "sweep": ("Goodput of llama2-6.7b against cluster size at published failure rates", ""),
}


def calibration_rows(cells: list[Cell]) -> list[dict[str, Any]]:
    """The efficiency each model ran at, and the published figure it was solved for (the calibrations are cached)."""
    rows = []
    for model in dict.fromkeys(c.model for c in cells if c.study in ("table2", "figure10")):
        rows.append({"model": model, "cluster": "a40-30x1", "calibrated on": f"Oobleck's {CALIBRATION_TRACE} cell",
                     "cluster.device_efficiency": f"{oobleck_efficiency(model):.4g}"})  # fmt: skip
    for model in dict.fromkeys(c.model for c in cells if c.study == "recycle"):
        rows.append({"model": model, "cluster": "azure-a100-4x8",
                     "calibrated on": "fault-free DeepSpeed, as ReCycle's plan",
                     "cluster.device_efficiency": f"{recycle_efficiency(model):.4g}"})  # fmt: skip
    return rows


def _figure(name: str, value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.1%}" if name.endswith("overhead") else f"{value:.3g}"


def write_docs(cells: list[Cell], summary: dict[str, Any], path: Path, argv: list[str]) -> None:
    from ftlab.experiments import results_doc

    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# Published figures against the simulator\n\nWritten by `experiments/sim_paper.py`, whose "
                        "docstring says how each study is set up and calibrated; each cell's command prints it again.\n")  # fmt: skip
    for study, (title, note) in TITLES.items():
        if any(c.study == study for c in cells):
            text = render(cells, study)
            if study == "reft":
                text += "\n| ratio | published | simulated |\n|---|---|---|\n" + "".join(
                    f"| {name} | {paper} | {_figure(name, got)} |\n" for name, (paper, got) in reft_figures(cells).items())
            results_doc.write_section(f"sim_paper_{study}", title, text, argv, module="sim_paper", note=note, path=path)
    calibrations = calibration_rows(cells)
    if calibrations:
        results_doc.write_section("sim_paper_calibration", "Calibration: one device efficiency per model and cluster",
                                  {"": calibrations}, argv, module="sim_paper", path=path)  # fmt: skip
    found = orderings(cells)
    if found:
        rows = "".join(f"| {o.where} | {o.ahead} {'level with' if o.level else 'ahead of'} {o.behind} "
                       f"| {'yes' if o.reproduced else 'NO'} |\n" for o in found)  # fmt: skip
        results_doc.write_section("sim_paper_orderings", "Orderings the papers report, and whether the simulation has them",
                                  "| cell | published | reproduced |\n|---|---|---|\n" + rows, argv, module="sim_paper",
                                  note=f"Level: within {LEVEL:.0%} of each other; a collapse ranks last.", path=path)  # fmt: skip
    results_doc.write_section("sim_paper_summary", "Summary: the study's JSON line", {"": summary}, argv,
                              module="sim_paper", path=path)  # fmt: skip


# -- the MTBF sweep ------------------------------------------------------------------------------------------------
PROTECTION_SETTINGS = {
    "storage": ["protection.every=50"],
    "reft": ["protection.interval=1", "protection.flush_every=50", *HOST_MEMORY],
}
"""The MTBF sweep's protections: a checkpoint every 50 steps; a snapshot after every step, flushed every 50."""
LLAMA3_GPU_S = LLAMA3_DAYS * 24 * 3600 * 16384 / LLAMA3_INTERRUPTIONS
META_MTTF = ((1024, 7.9 * 3600), (16384, 1.8 * 3600))
"""Meta's research clusters (Kokolis et al. 2024): projected job MTTF at 1,024 and 16,384 GPUs."""


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


def cluster_mtbf_s(source: str, gpus: int) -> float:
    """Seconds between failures of a cluster of ``gpus`` GPUs: Llama 3's rate per GPU, or Meta's MTTF interpolated
    on a log-log line."""
    if source == "llama3":
        return LLAMA3_GPU_S / gpus
    (g0, t0), (g1, t1) = META_MTTF
    slope = math.log(t1 / t0) / math.log(g1 / g0)
    return t0 * (gpus / g0) ** slope


def sweep_cells(sizes: list[int], hours: float) -> list[Cell]:
    cells = []
    for source in ("llama3", "meta"):
        for nodes in sizes:
            gpus = 8 * nodes
            faults = ["faults=exponential", "faults.mtbf_steps=null", f"faults.mtbf_s={cluster_mtbf_s(source, gpus):.6g}",
                      "faults.max_failures=null", f"faults.horizon_s={hours * 3600:g}", "faults.replace_after_s=3600",
                      "faults.seed=0"]  # fmt: skip
            for combination, settings in combinations().items():
                job = ["model=llama2-6.7b", "cluster=a100-125x8", f"cluster.nodes={nodes}", "train.precision=bf16",
                       "train.activation_checkpointing=true", f"train.global_batch={gpus}", "train.micro_batch=1",
                       "train.steps=100000000", f"sim.horizon_s={hours * 3600:g}", *STORAGE, *SNAPSHOTS, *settings,
                       *faults]  # fmt: skip
                cells.append(Cell("sweep", f"{gpus} GPUs", source, combination, None, job, metric="goodput"))
    return cells


# -- the study -----------------------------------------------------------------------------------------------------
STUDIES = ("table2", "figure10", "recycle", "reft", "llama3")


def study_cells(studies: list[str], smoke: bool, by_role: bool) -> list[Cell]:
    """Every cell of the studies named (with ``smoke``, a few of each); calibrations run here, as the cells need
    them."""
    full = {
        "table2": lambda: table2_cells(list(OOBLECK_MODELS), list(TABLE2_TRACES), by_role),
        "figure10": lambda: figure10_cells(list(OOBLECK_MODELS), list(FIGURE10_TRACES)),
        "recycle": lambda: recycle_cells(list(RECYCLE_MODELS), list(RECYCLE_PERIODS_S)),
        "reft": reft_cells,
        "llama3": lambda: [llama3_cell(LLAMA3_DAYS)],
        "sweep": lambda: sweep_cells([16, 32, 64, 128, 256, 512], 24.0),
    }
    small = {
        "table2": lambda: table2_cells(["bert-large"], ["10m"], by_role),
        "figure10": lambda: figure10_cells(["gpt3-6.7b"], ["scale_gcp"]),
        "recycle": lambda: recycle_cells(["gpt3-medium"], ["30m"]),
        "reft": reft_cells,
        "llama3": lambda: [llama3_cell(1.0)],
        "sweep": lambda: sweep_cells([16], 2.0),
    }
    return [cell for study in studies for cell in (small if smoke else full)[study]()]


def find_cell(cell_id: str) -> Cell:
    """The cell of that id, built with only the calibration it needs."""
    study, model, setting, system = cell_id.split("/")
    builders: dict[str, Callable[[], list[Cell]]] = {
        "table2": lambda: table2_cells([model], [setting], by_role=True),
        "figure10": lambda: figure10_cells([model], [setting]),
        "recycle": lambda: recycle_cells([model], [setting]),
        "reft": reft_cells,
        "llama3": lambda: [llama3_cell(float(setting.rstrip("d")))],
    }
    found = [c for c in builders[study]() if c.id == cell_id]
    if not found:
        raise SystemExit(f"no cell {cell_id!r}: ids are study/model/setting/system, as the docs table gives them")
    return found[0]


def show(cell: Cell) -> None:
    shown = f"refused: {cell.refused}" if cell.refused else _simulated(cell)
    print(f"[{cell.study}] {cell.model} {cell.setting} {cell.system}: {shown} (published {_published(cell) or '-'}), "
          f"{cell.failures} failures, {cell.wall_s:.1f} s", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few cells of each study, one day of Llama 3")
    parser.add_argument("--cell", help="run one cell, by the id the docs table gives, and print it")
    parser.add_argument("--studies", default=",".join(STUDIES), help=f"comma-separated, of {', '.join(STUDIES)}, sweep")
    parser.add_argument("--by-role", action="store_true", help="Table 2 with every policy of the paper's systems' roles")
    parser.add_argument("--docs", type=Path, default=DOCS, help="the markdown file the tables are written into")
    parser.add_argument("--tracking-uri", default=f"sqlite:///{REPO / 'mlflow.db'}")
    args = parser.parse_args(argv)
    if args.cell:
        show(measure(find_cell(args.cell)))
        return
    from ftlab.runtime.core.config import TrackingConfig
    from ftlab.runtime.reporting.tracking import Tracker

    tracker = Tracker(TrackingConfig(uri=args.tracking_uri, experiment="ftlab-sim", run_name="paper-scale"))
    studies = args.studies.split(",")
    tracker.start({"smoke": args.smoke, "studies": studies, "by_role": args.by_role},
                  {"backend": "sim", "study": "paper-scale"}, "")  # fmt: skip
    try:
        cells = study_cells(studies, args.smoke, args.by_role)
        for cell in cells:
            show(measure(cell))
        summary = score(cells)
        for study in dict.fromkeys(c.study for c in cells):
            tracker.log_text(f"{study}.md", render(cells, study))
        tracker.log_text("cells.json", json.dumps([asdict(c) for c in cells], indent=1, default=str))
        tracker.log_metrics({k: float(v) for k, v in summary.items() if v is not None}, 0)
        tracker.finish()
    except BaseException as exc:
        tracker.finish(failure=f"{type(exc).__name__}: {exc}")
        raise
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "paper.json").write_text(json.dumps([asdict(c) for c in cells], default=str))
    write_docs(cells, summary, args.docs, list(sys.argv[1:] if argv is None else argv))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
