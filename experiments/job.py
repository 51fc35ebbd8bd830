"""One job from a composed config: pre-flight checks, the MLflow run, the backend, the coordinator, the summary.

The composition root: here the config becomes a policy, a protection, a first decision, a fault schedule and a
backend, and the job's event stream is wired to its subscribers (MLflow, the progress line, the fault ledger, the
injector). Everything that can be checked without a worker is checked before the first process starts, and before
torch is imported, so a bad input is answered in seconds; every way out of the job closes the MLflow run: FINISHED,
or FAILED with the reason (a job the policy stopped keeps its summary of the steps it committed).

The simulator (``experiments.simulate``) shares all of it but the backend: the same checks (``check_job``), the
same run and tags (``tracked``), the same subscribers (``observe``) and the same summary and timeline
(``conclude``), so a simulated run and a real one read alike in MLflow.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from ftlab.experiments.config import JobConfig, build, register
from ftlab.experiments.deepspeed_config import apply as apply_deepspeed_config
from ftlab.faults.injector import Injector
from ftlab.faults.schedules import (
    ClusterShape, FaultConfigError, FaultEvent, beyond_job, build_schedule, check_reach, failure_rate, rate_label,
)
from ftlab.runtime.state import checkpoint, shm
from ftlab.runtime.control import events as ev
from ftlab.runtime.control.backend import Membership
from ftlab.runtime.core.config import LR_SCHEDULES, OPTIMIZERS, WARMUP_TYPES, ClusterConfig, SimConfig, TrainConfig
from ftlab.runtime.core.contract import ConfigError, Decision, Job, Policy, Protection, StorageSource
from ftlab.runtime.core.costs import CostModel, ModelProfile, stage_footprint, with_precision
from ftlab.runtime.control.coordinator import JobStopped
from ftlab.runtime.training.data import load_tokens, text_file, tokenize_corpus
from ftlab.runtime.core.devices import DEVICES, node_spec
from ftlab.runtime.core.failed_saves import MIB, checkpoint_bytes
from ftlab.runtime.core.precision import needs_norms, numerics_problems
from ftlab.runtime.control.update import UpdateRule, scaler_from_manifest
from ftlab.runtime.reporting.fault_ledger import FaultLedger, FaultRecord
from ftlab.runtime.processes.launchers import launch_problems, make_launcher
from ftlab.runtime.processes.placement import choose_backend
from ftlab.runtime.core.memory_fit import first_overfull, layer_memory
from ftlab.runtime.core.model_spec import layer_specs, num_layers
from ftlab.runtime.core.plan import Plan, PlanError
from ftlab.runtime.processes.profiler import analytic_profile, measure_profile
from ftlab.runtime.reporting.tracking import RunRecorder, Tracker
from ftlab.runtime.sim.machines import machine_for

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).parents[1] / "conf"
GIB = 2**30
MEASURED_DEVICES = ("cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")
MEASURE_FLOPS_LIMIT = 5e10
"""Forward FLOPs of one micro-batch through the whole model above which measuring is refused: the profiler runs
each layer about 40 forward-equivalents, and a CPU core pair manages some 10-50 GFLOP/s, so this keeps a first
(uncached) measurement under a minute or two. gpt2-tiny at micro-batch 2 needs 6e8, gpt2-small 6e11."""


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The job config that ``ftlab OVERRIDES...`` would run, for tests, benchmarks and notebooks."""
    register()
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra.compose("config", overrides=overrides or [])


@dataclass
class JobResult:
    run_id: str
    steps: list[ev.StepCommitted]
    """Every executed step in order, re-executed ones too."""
    plans: list[Plan]
    summary: dict[str, float]
    faults: list[FaultRecord]
    worker_pids: dict[int, list[int]]
    checkpoint_dir: str = ""
    events: list[ev.Event] = field(default_factory=list)
    """Everything that happened but the steps, in order."""
    stopped: str | None = None
    """Why the policy stopped the job before train.steps, if it did."""

    @property
    def unfired(self) -> list[str]:
        """The scheduled faults the job did not fire (skipped, never reached, or whose target never entered their
        phase), each with the reason: a bench whose faults did not all fire did not test what it claims to."""
        missed = [e for e in self.events if isinstance(e, (ev.FaultUnfired, ev.FaultSkipped))]
        return [f"{e.fault.get('kind')} fault at step {e.fault.get('at_step')}: {e.reason}" for e in missed]


# -- the costs a job plans with ------------------------------------------------------------------------------------
def job_profile(cfg: JobConfig, again: bool = False) -> tuple[ModelProfile, dict[str, Any]]:
    """The per-layer costs of the job's model on its devices, and where they come from: an analytic profile for a
    GPU type of ``runtime.core.devices``, else measured on this machine (cached under ``<train.cache_dir>/profiles``;
    ``again``: measured once more, the fastest of both cached, ``profiler.measure_profile``)."""
    device = cfg.cluster.device
    model, micro_batch = cfg.model, cfg.train.micro_batch
    checkpointing = cfg.train.activation_checkpointing
    if device in DEVICES:
        profile = analytic_profile(model, node_spec(cfg.cluster), micro_batch, model.seq_len, cfg.train.precision)
        return replace(profile, activation_checkpointing=checkpointing), {"kind": "analytic", "device": device}
    writable_dir(Path(cfg.train.cache_dir), "train.cache_dir")  # before measuring (seconds to minutes), not after
    profile = measure_profile(
        model, micro_batch, device=device, workers_per_node=cfg.cluster.workers_per_node,
        cache_dir=Path(cfg.train.cache_dir) / "profiles", threads=cfg.cluster.threads_per_worker, again=again,
    )  # fmt: skip
    profile = with_precision(replace(profile, activation_checkpointing=checkpointing), cfg.train.precision)
    return profile, {"kind": "measured", "device": profile.device}


def job_factory(cfg: JobConfig, start: StorageSource | None) -> Callable[[Membership], Job]:
    """Jobs of this config for any membership; the profile is measured (or read from the cache) at most once, and
    only if a policy asks for it."""
    specs = tuple(layer_specs(cfg.model))
    memory = int(cfg.cluster.device_memory_gb * GIB)
    profile = cache(lambda: job_profile(cfg)[0])
    machine = cache(lambda: machine_for(cfg.cluster, cfg.sim, CostModel(profile())))
    rate = failure_rate(cfg.faults)

    def make(membership: Membership) -> Job:
        return Job(cfg.model, specs, cfg.train, membership.workers_of_node, membership.slots_of_node, memory,
                   profile, machine, start, rate)  # fmt: skip

    return make


def everyone(cfg: JobConfig) -> Membership:
    """The cluster as configured, every node and worker alive."""
    wpn = cfg.cluster.workers_per_node
    nodes = {n: tuple(range(n * wpn, (n + 1) * wpn)) for n in range(cfg.cluster.nodes)}
    return Membership(nodes, nodes)


# -- checks before any worker starts -------------------------------------------------------------------------------
def check_layers_fit(job: Job) -> None:
    """Refuse a job with a layer that no plan can place: what any stage holding it needs at least (the layer's state,
    and its activations for one micro-batch) is more than a device has. Checked before a policy plans, which may
    first measure every layer on this machine (minutes for a large model) only to find no plan that fits."""
    t, layers = job.train, layer_memory(job)
    # A checkpointed stage keeps its first layer's input per micro-batch in flight, which depends on where it
    # starts: left out, so that this is a lower bound for every stage holding the layer.
    in_flight = 0 if t.activation_checkpointing else 1
    for index in range(len(layers)):
        need = stage_footprint(layers, index, index + 1, in_flight, t.activation_checkpointing, t.precision)
        if need > job.device_memory_bytes:
            raise ConfigError(
                f"layer {index} of {job.model.name} needs at least {need / GIB:.2f} GiB on the device that holds it "
                f"(its state and one micro-batch of {t.micro_batch} samples of {job.model.seq_len} tokens), but a "
                f"device has {job.device_memory_bytes / GIB:.2f} GiB, so no plan can place it: raise "
                f"cluster.device_memory_gb, use a smaller train.micro_batch or model.seq_len, or "
                f"train.activation_checkpointing=true, or choose a smaller model"
            )


def check_memory(plan: Plan, job: Job) -> None:
    """Refuse a plan whose stage would not fit the configured device memory (``runtime.core.memory_fit``)."""
    overfull = first_overfull(plan, job)
    if overfull is not None:
        raise ConfigError(
            f"{overfull.describe(job.model.name)}: use more pipeline stages (train.stages), a smaller "
            f"train.micro_batch, train.activation_checkpointing=true, or raise cluster.device_memory_gb"
        )


def check_settings(cfg: JobConfig) -> None:
    """The settings that are wrong whatever else the job says."""
    c, t = cfg.cluster, cfg.train
    if c.nodes < 1 or c.workers_per_node < 1:
        raise ConfigError("cluster.nodes and cluster.workers_per_node must be at least 1")
    if c.threads_per_worker < 0:
        raise ConfigError(f"cluster.threads_per_worker={c.threads_per_worker}: use a count, or 0 for this job's share")
    if c.backend not in BACKENDS:
        raise ConfigError(f"cluster.backend={c.backend!r}: use auto, gloo or nccl")
    launch = launch_problems(c)
    if launch:
        raise ConfigError("; ".join(launch))
    if c.device_memory_gb <= 0:
        raise ConfigError(f"cluster.device_memory_gb={c.device_memory_gb}: give the memory of one device in GiB")
    if not 0 < c.device_efficiency <= 1:
        raise ConfigError(f"cluster.device_efficiency={c.device_efficiency}: give the fraction of the devices' peak "
                          f"that training reaches, above 0 and at most 1")  # fmt: skip
    for name, link in (("node_network_gbps", c.node_network_gbps), ("intra_node_gbps", c.intra_node_gbps)):
        if link is not None and not (link > 0 and math.isfinite(link)):
            raise ConfigError(f"cluster.{name}={link}: give the link's Gb/s in one direction, or null for the "
                              f"device's")  # fmt: skip
    if cfg.sim.calibrate_samples_per_s is not None and cfg.mode != "simulate":
        raise ConfigError(f"sim.calibrate_samples_per_s={cfg.sim.calibrate_samples_per_s} calibrates a simulation: "
                          f"use it with mode=simulate, or set cluster.device_efficiency")  # fmt: skip
    if c.heartbeat_s <= 0:
        raise ConfigError(f"cluster.heartbeat_s={c.heartbeat_s}: workers must heartbeat at a positive interval")
    if c.heartbeat_timeout_s < 2 * c.heartbeat_s:
        raise ConfigError(
            f"cluster.heartbeat_timeout_s={c.heartbeat_timeout_s} leaves no room for a heartbeat every "
            f"cluster.heartbeat_s={c.heartbeat_s} s: every worker would be declared hung; use at least "
            f"{2 * c.heartbeat_s:g} (the default is 10)"
        )
    if not c.start_timeout_s > 0:
        raise ConfigError(f"cluster.start_timeout_s={c.start_timeout_s}: give the seconds the nodes may take to "
                          f"start, > 0")  # fmt: skip
    if t.steps < 1:
        raise ConfigError(f"train.steps={t.steps}: train for at least one step")
    if not 0 <= t.seed < 2**63:
        raise ConfigError(f"train.seed={t.seed}: use a seed from 0 to 2**63 - 1 (numpy's and torch's range)")
    if t.micro_batch < 1 or t.global_batch < 1:
        raise ConfigError(f"train.global_batch={t.global_batch}, train.micro_batch={t.micro_batch}: both are counts "
                          f"of samples, at least 1")  # fmt: skip
    if t.global_batch < t.micro_batch or t.global_batch % t.micro_batch:
        raise ConfigError(
            f"train.global_batch={t.global_batch} does not split into micro-batches of train.micro_batch="
            f"{t.micro_batch}: set train.global_batch to a multiple of train.micro_batch"
        )
    if not t.lr > 0 or (t.lr_schedule == "cosine" and not 0 <= t.min_lr <= t.lr):  # DeepSpeed's read no min_lr
        raise ConfigError(
            f"train.lr={t.lr}, train.min_lr={t.min_lr}: the learning rate must be positive and the minimum between "
            f"0 and it"
        )
    if t.zero not in (0, 1):
        raise ConfigError(f"train.zero={t.zero}: use 0 (no optimizer sharding) or 1 (ZeRO-1)")
    numerics = numerics_problems(t, DEVICES.get(cfg.cluster.device))
    if numerics:
        raise ConfigError("; ".join(numerics))
    if t.warmup_steps < 0 or t.weight_decay < 0 or not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1):
        raise ConfigError(
            "train.warmup_steps and train.weight_decay must be >= 0, and train.beta1, train.beta2 in [0, 1)"
        )
    if t.optimizer not in OPTIMIZERS or t.lr_schedule not in LR_SCHEDULES or t.warmup_type not in WARMUP_TYPES:
        raise ConfigError(
            f"train.optimizer={t.optimizer}, train.lr_schedule={t.lr_schedule}, train.warmup_type={t.warmup_type}: "
            f"use one of {', '.join(OPTIMIZERS)}; {', '.join(LR_SCHEDULES)}; {', '.join(WARMUP_TYPES)}"
        )
    decay_steps = t.decay_steps if t.decay_steps is not None else 1
    if not t.eps > 0 or min(t.warmup_min_lr, t.warmup_min_ratio, t.cos_min_ratio) < 0 or decay_steps < 1:
        raise ConfigError(
            "train.eps must be > 0, train.warmup_min_lr, train.warmup_min_ratio and train.cos_min_ratio >= 0, and "
            "train.decay_steps at least 1 (or null: train.steps)"
        )
    if t.lr_schedule != "cosine" and t.warmup_steps < 1:
        raise ConfigError(
            f"train.warmup_steps={t.warmup_steps}: DeepSpeed's {t.lr_schedule} warms up over 1 step or more"
        )
    machinery = sim_problems(cfg.sim)
    if machinery:
        raise ConfigError(f"{', '.join(machinery)}: the simulator's constants (conf/sim) are durations of 0 s or "
                          f"more, rates above 0, host cores of 0 (not shared) or more, and cores' worth by load and "
                          f"layer speeds above 0 (of a host with cores)")  # fmt: skip
    check_model(cfg)
    speeds, layers = len(cfg.sim.host_layer_speed), num_layers(cfg.model)
    if speeds not in (0, layers):
        raise ConfigError(f"sim.host_layer_speed has {speeds} entries: give one for each of model {cfg.model.name}'s "
                          f"{layers} layers, or none")  # fmt: skip
    if cfg.model.vocab_size < 3:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} leaves no room for words beside the unknown-word and "
            "end-of-line tokens: use at least 3"
        )


def writable_dir(path: Path, setting: str) -> None:
    """``path`` exists (made now if need be) as a folder this process can write, else a ConfigError naming
    ``setting``: a job must not find out at its first checkpoint, its workers running."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as exc:
        raise ConfigError(f"{setting}={path}: cannot write there ({exc.strerror or exc}); give a folder this user "
                          f"can create and write") from None  # fmt: skip


def sim_problems(sim: SimConfig) -> list[str]:
    """The machinery constants no machine has (a real job's adaptive policy predicts with them too): each as
    ``sim.name=value``. ``sim.horizon_s`` and ``sim.calibrate_samples_per_s`` are the simulator's own to check."""
    bad = []
    for name in (f.name for f in fields(sim)):
        value = getattr(sim, name)
        if value is None:  # an optional constant left out (SimConfig says what stands in)
            continue
        if name in ("host_cores_by_load", "host_layer_speed"):
            if not all(worth > 0 and math.isfinite(worth) for worth in value) or (value and sim.host_cores <= 0):
                bad.append(f"sim.{name}={list(value)}")
            continue
        if name.endswith("bytes_per_s"):
            ok = value > 0
        elif (name.endswith("_s") and name not in ("horizon_s", "calibrate_samples_per_s")) or name == "host_cores":
            ok = value >= 0
        else:
            continue
        if not (ok and math.isfinite(value)):
            bad.append(f"sim.{name}={value}")
    return bad


def check_model(cfg: JobConfig) -> None:
    """The model's settings (``ModelConfig.check``), refused as a ConfigError."""
    try:
        cfg.model.check()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def check_device(cfg: JobConfig) -> None:
    """A device with a profile: a GPU type of ``runtime.core.devices`` (analytic), or this machine's cpu or cuda
    (measured), for a model small enough to measure here."""
    check_model(cfg)  # before its layers are sized
    device = cfg.cluster.device
    if device in DEVICES:
        return
    if cfg.model.attention == "eager_dropout":
        raise ConfigError(
            f"model.attention=eager_dropout is for a GPU type's analytic profile: workers train without dropout (every "
            f"layout computes the same gradient), so cluster.device={device} cannot run or measure it: use "
            f"model.attention=eager or fused, or a GPU type ({', '.join(DEVICES)})"
        )
    if device.split(":")[0] not in MEASURED_DEVICES:
        raise ConfigError(
            f"cluster.device={device!r} has no profile: use cpu (measured on this machine) or a GPU type with an "
            f"analytic profile: {', '.join(DEVICES)}"
        )
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"cluster.device={device} needs CUDA, which this machine lacks: use cpu or a GPU type")
        return
    flops = sum(s.fwd_flops_per_token for s in layer_specs(cfg.model)) * cfg.train.micro_batch * cfg.model.seq_len
    if flops > MEASURE_FLOPS_LIMIT:
        raise ConfigError(
            f"measuring {cfg.model.name} on this CPU would take too long ({flops:.1e} FLOPs per forward micro-batch, "
            f"the limit is {MEASURE_FLOPS_LIMIT:.0e}): plan it with a GPU profile (cluster.device=A100-80GB, or "
            f"a GPU cluster preset such as cluster=a100-16x8), or use a smaller model or train.micro_batch"
        )


def components(cfg: JobConfig) -> tuple[Policy, Protection]:
    built = []
    for group in ("policy", "protection"):
        settings = getattr(cfg, group)
        try:
            built.append(build(settings))
        except Exception as exc:  # noqa: BLE001 - a _target_ that cannot be imported or built
            raise ConfigError(f"{group} {settings.name!r} cannot be built from its config: {exc}") from exc
    return built[0], built[1]


def resumed_run(cfg: JobConfig) -> str | None:
    """The run whose checkpoint the job resumes from: a run's checkpoints lie under a folder named by its id
    (``tracked``), which the resumed job continues (``runtime.reporting.stale_runs``)."""
    found = checkpoint.find(cfg.train.resume_from) if cfg.train.resume_from is not None else None
    return found[1].parent.name if found is not None else None


def resume_point(cfg: JobConfig) -> StorageSource | None:
    if cfg.train.resume_from is None:
        return None
    found = checkpoint.find(cfg.train.resume_from)
    if found is None:
        raise ConfigError(
            f"train.resume_from={cfg.train.resume_from} holds no committed checkpoint (a step-NNNNNN directory with "
            f"a manifest.json): point it at one, or at the directory that holds them"
        )
    step, directory, layers = found
    model_layers = len(layer_specs(cfg.model))
    if layers != model_layers:
        raise ConfigError(
            f"the checkpoint in {directory} has {layers} layers but model {cfg.model.name} has {model_layers}: "
            "resume with the model it was trained with"
        )
    if step >= cfg.train.steps:
        raise ConfigError(f"the checkpoint is at step {step}, not before train.steps={cfg.train.steps}: raise train.steps")
    return StorageSource(step, str(directory.absolute()))  # an ssh agent starts in the home directory, not here


def first_decision(cfg: JobConfig, make_job: Callable[[Membership], Job]) -> tuple[Policy, Protection, Decision]:
    """The policy and protection of the job, checked against each other and the job, and the policy's first plan."""
    policy, protection = components(cfg)
    job = make_job(everyone(cfg))
    if cfg.train.zero and policy.moves_layers:
        raise ConfigError(
            f"policy={policy.name} copies layers with their optimizer state between workers, which train.zero=1 "
            f"splits across replicas: use train.zero=0, or a policy that restarts (checkpoint_restart)"
        )
    check_layers_fit(job)
    try:
        protection.check(job)
        policy.check(protection)
        decision = policy.plan(job, protection)
        decision.plan.validate()
        protection.check_plan(decision.plan, job)
    except PlanError as exc:
        raise ConfigError(str(exc)) from exc
    missing = set(decision.plan.workers) - set(decision.programs)
    if missing:
        raise ConfigError(f"policy {policy.name} gave no program to workers {sorted(missing)} of its plan")
    check_memory(decision.plan, job)
    return policy, protection, decision


def resolve_backend(cfg: JobConfig) -> tuple[str, str]:
    """(backend, why) where the nodes are this machine's processes (the only check that needs torch, so it comes
    last); with agents on other hosts, the requested backend, decided by ``backend_for`` once the agents have
    reported their GPUs."""
    c = cfg.cluster
    if c.launcher != "local":
        return c.backend, "decided when the agents report their GPUs"
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend, why = backend_for(cfg, c.backend, {n: gpus for n in range(c.nodes)}, shared_machine=True)
    if backend == "nccl" and cfg.train.precision == "bf16" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"train.precision=bf16: this machine's GPU ({torch.cuda.get_device_name()}) does not compute "
                          f"bf16; use train.precision=fp16 or fp32")  # fmt: skip
    if backend == "nccl" and cfg.train.precision == "tf32" and torch.cuda.get_device_capability() < (8, 0):
        raise ConfigError(f"train.precision=tf32: this machine's GPU ({torch.cuda.get_device_name()}) has no TF32 "
                          f"tensor cores (Ampere and later do); use train.precision=fp32 or fp16")  # fmt: skip
    return backend, why


def backend_for(cfg: JobConfig, requested: str, gpus_of_node: dict[int, int], shared_machine: bool) -> tuple[str, str]:
    try:
        backend, why = choose_backend(requested, gpus_of_node, cfg.cluster.workers_per_node, shared_machine)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if backend == "nccl" and (cfg.train.zero or cfg.protection.name == "reft"):
        raise ConfigError(
            f"train.zero={cfg.train.zero} and protection={cfg.protection.name} run on gloo only so far (their "
            f"buffers and snapshot copies are CPU tensors): use cluster.backend=gloo"
        )
    return backend, why


@dataclass
class Preflight:
    policy: Policy
    protection: Protection
    decision: Decision
    faults: list[FaultEvent]
    make_job: Callable[[Membership], Job]
    beyond: list[FaultEvent] = field(default_factory=list)
    """Faults at steps the job never runs (generated or replayed ones past its end, any before a resumed job's
    first step): warned of, not fired."""
    first_step: int = 0
    """The step the job starts at: 0, or a resumed job's checkpoint."""
    backend: str = ""
    """gloo or nccl (real processes only); with agents on other hosts, as requested (auto too) until they report
    their GPUs."""
    backend_why: str = ""
    tokens: Path | None = None
    """The tokenised corpus (real processes only)."""


def check_job(cfg: JobConfig) -> Preflight:
    """What every job is checked for, real or simulated: settings, the fault schedule, the policy and protection
    with their first plan, its memory. Raises ConfigError (or the fault schedule's error) with what to change."""
    check_settings(cfg)
    start = resume_point(cfg)
    # The schedule's errors are the config's alone: said before the first plan, which loads and runs the planner.
    scheduled = build_schedule(cfg.faults, ClusterShape(cfg.cluster.nodes, cfg.cluster.workers_per_node))
    make_job = job_factory(cfg, start)
    policy, protection, decision = first_decision(cfg, make_job)
    first_step = start.step if start is not None else 0
    faults = check_reach(cfg.faults, scheduled, first_step, cfg.train.steps)
    beyond = beyond_job(scheduled, first_step, cfg.train.steps)
    return Preflight(policy, protection, decision, faults, make_job, beyond, first_step=first_step)


def preflight(cfg: JobConfig) -> Preflight:
    """Everything checkable before a worker starts; a real job also needs its corpus and a torch backend."""
    checked = check_job(cfg)
    # The job's checkpoints go to <train.checkpoint_dir>/<run id> (``tracked``): the folder the user gave must take them.
    writable_dir(Path(cfg.train.checkpoint_dir).parent, "train.checkpoint_dir")
    writable_dir(Path(cfg.train.cache_dir), "train.cache_dir")
    tokens = tokenize_corpus(cfg.train.data, cfg.model.vocab_size, Path(cfg.train.cache_dir))
    if len(load_tokens(tokens)) <= cfg.model.seq_len:
        raise ConfigError(
            f"train.data={cfg.train.data} holds {len(load_tokens(tokens))} tokens, fewer than one sample of "
            f"{cfg.model.seq_len + 1}: use a longer text or a model with a shorter seq_len"
        )
    checked.tokens = tokens.absolute()  # an ssh agent starts in the home directory, not here
    checked.backend, checked.backend_why = resolve_backend(cfg)
    return checked


# -- the job ------------------------------------------------------------------------------------------------------
def run_tags(cfg: JobConfig) -> dict[str, str]:
    return {
        "policy": cfg.policy.name,
        "protection": cfg.protection.name,
        "model": cfg.model.name,
        "cluster": cfg.cluster.name,
        "faults": cfg.faults.schedule,
        "fault_rate": rate_label(cfg.faults),
        "seed": str(cfg.faults.seed),
    }


def run_name(cfg: JobConfig) -> str:
    """policy-protection-faults-seed: what tells the jobs of a sweep apart, readable in the runs table. The seed is
    the fault schedule's (the draw of faults a job saw); the faults part carries the rate (``exponential-10steps``)."""
    return f"{cfg.policy.name}-{cfg.protection.name}-{rate_label(cfg.faults)}-{cfg.faults.seed}"


def describe(cfg: JobConfig, summary: dict[str, float] | None = None) -> str:
    """The run's description (markdown): the job in one sentence, then its key figures once it has them."""
    c = cfg.cluster
    text = (
        f"{cfg.model.name} on {c.name} ({c.nodes} nodes x {c.workers_per_node} workers), policy "
        f"**{cfg.policy.name}**, protection **{cfg.protection.name}**, faults **{rate_label(cfg.faults)}** "
        f"(seed {cfg.faults.seed}), {cfg.train.steps} steps."
    )
    if summary is None:
        return text
    s = summary
    return text + (
        f" Goodput **{s['summary/goodput_ratio']:.2f}**; {int(s['summary/failures'])} failures, recovery "
        f"{s['summary/recovery_s_total']:.2f} s, {int(s['summary/lost_steps_total'])} steps lost; "
        f"{s['summary/samples_per_s']:.1f} samples/s; final loss {s['summary/final_loss']:.4f}."
    )


REFUSALS = (ConfigError, FaultConfigError, FileNotFoundError)
"""What a job's checks raise: their message says what to change."""


class Refused(Exception):
    """A job its checks refused before its MLflow run was opened: ``error`` says why. The caller shows the message,
    then records the FAILED run (``failed_run``), so a refusal does not wait for MLflow to load and open its store."""

    def __init__(self, error: Exception, tags: dict[str, str] | None = None) -> None:
        super().__init__(str(error))
        self.error = error
        self.tags = tags or {}
        """What the run would have been tagged beside the job's own tags (its backend or mode)."""


def refusal(dict_cfg: DictConfig, error: Exception, defer: bool, tags: dict[str, str]) -> Exception:
    """What to raise for a job refused before its run opened: ``Refused`` for a caller that says so first and then
    records it (``defer``), else ``error`` itself, its FAILED run (tagged ``tags`` too) recorded."""
    if defer:
        return Refused(error, tags)
    failed_run(dict_cfg, error, tags)
    return error


def run_job(dict_cfg: DictConfig, defer_refusal: bool = False) -> JobResult:
    return tracked(dict_cfg, _run, backend="local", check=check_real, defer_refusal=defer_refusal)


def check_real(cfg: JobConfig) -> None:
    """What a real job's config alone can be refused for, before MLflow, torch or a corpus load: ``check_job``, its
    training text, and the folders it writes, with room for what its protection keeps."""
    checked = check_job(cfg)
    if cfg.train.data is not None:
        text_file(cfg.train.data)
    writable_dir(Path(cfg.train.checkpoint_dir), "train.checkpoint_dir")
    writable_dir(Path(cfg.train.cache_dir), "train.cache_dir")
    check_space(cfg, checked.protection)


def check_space(cfg: JobConfig, protection: Protection) -> None:
    """Room for what the protection keeps: in the checkpoint folder, the checkpoints it keeps and the one it writes
    beside them; in this machine's memory for snapshots (``shm.ROOT``), every node's records where the nodes are
    this machine's processes. Else a ConfigError with the sizes (a warning with ``protection.allow_low_space=true``)."""
    kept, allowed = protection.storage_footprint()
    short = []
    if kept:
        one = checkpoint_bytes(layer_specs(cfg.model), cfg.model.seq_len)
        need, free = (kept + 1) * one, checkpoint.free_bytes(cfg.train.checkpoint_dir)
        if free < need:
            short.append(f"train.checkpoint_dir={cfg.train.checkpoint_dir} has {free / MIB:.1f} MiB free, but "
                         f"protection={protection.name} keeps {kept} checkpoints of {cfg.model.name} ({one / MIB:.1f} "
                         f"MiB each) and writes the next beside them: {need / MIB:.1f} MiB (lower protection.keep, or "
                         f"give train.checkpoint_dir on a larger disk)")  # fmt: skip
    memory = sum(protection.host_memory_footprint().values())
    if memory and cfg.cluster.launcher == "local":
        free = checkpoint.free_bytes(shm.ROOT)
        if free < memory:
            short.append(f"{shm.ROOT} has {free / MIB:.1f} MiB free, but the snapshot records of the "
                         f"{cfg.cluster.nodes} nodes on this machine take {memory / MIB:.1f} MiB")  # fmt: skip
    if not short:
        return
    text = "; ".join(short)
    if allowed:
        log.warning("%s; starting anyway (protection.allow_low_space=true): a save that finds no room is skipped", text)
        return
    raise ConfigError(f"{text}. Free space there, or set protection.allow_low_space=true to start anyway (a save that "
                      f"finds no room is skipped; protection.max_failed_saves of them in a row stop the job)")  # fmt: skip


def tracked(
    dict_cfg: DictConfig, body: Callable[[JobConfig, Tracker], JobResult], backend: str,
    check: Callable[[JobConfig], object], defer_refusal: bool = False,
) -> JobResult:  # fmt: skip
    """Check the job (``check``: before MLflow loads), then run ``body`` inside one MLflow run tagged ``backend``:
    FINISHED with its result, FAILED with the reason otherwise. A job the policy stopped is FAILED too, after its
    summary is logged. A job ``check`` refuses gets a FAILED run of its own, or with ``defer_refusal`` raises
    ``Refused`` for the caller to say so first and record it after. ``body`` checks the job again where its
    checkpoints go (``<train.checkpoint_dir>/<run id>``, known once the run is open): milliseconds for a job on this
    machine, under a second for a simulated thousand GPUs. A ``train.deepspeed_config`` becomes the job's
    ``train.*`` settings first (``experiments.deepspeed_config``; DeepSpeed's config code loads torch)."""
    try:
        dict_cfg, deepspeed = apply_deepspeed_config(dict_cfg)
        cfg: JobConfig = OmegaConf.to_object(dict_cfg)
        check(cfg)
    except REFUSALS as exc:
        raise refusal(dict_cfg, exc, defer_refusal, {"backend": backend})  # noqa: B904 - the refusal is the error
    tracker = Tracker(cfg.tracking)
    run_id = tracker.start(
        # the model's and cluster's settings as the job resolved them (model=hf takes its sizes from its
        # config.json; a calibrated simulation finds its cluster.device_efficiency)
        {**OmegaConf.to_container(dict_cfg, resolve=True), "model": asdict(cfg.model), "cluster": asdict(cfg.cluster),
         **deepspeed},
        {**run_tags(cfg), "backend": backend},
        OmegaConf.to_yaml(dict_cfg), run_name(cfg), describe(cfg), resumes=resumed_run(cfg),
    )  # fmt: skip
    try:
        # absolute: the resume path a stopped job prints works from any directory, and every node writes to the
        # same place (an ssh agent starts in the home directory, not here)
        cfg.train.checkpoint_dir = str(Path(cfg.train.checkpoint_dir).absolute() / run_id)
        result = body(cfg, tracker)
        result.run_id = run_id
        if result.stopped is not None:
            raise JobStopped(result.stopped)
        tracker.describe(describe(cfg, result.summary))
        tracker.finish()
        return result
    except BaseException as exc:
        tracker.describe(f"{describe(cfg)} **Failed**: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        tracker.finish(failure=f"{type(exc).__name__}: {exc}")
        raise


def failed_run(dict_cfg: DictConfig, error: Exception, tags: dict[str, str] | None = None) -> str:
    """A FAILED run for a job refused before it opened one (by its checks, or an unknown mode), so every job of a
    sweep has its run; its id. ``tags``: what the run would have been tagged beside the job's own (its backend)."""
    cfg: JobConfig = OmegaConf.to_object(dict_cfg)
    tracker = Tracker(cfg.tracking)
    run_id = tracker.start(
        OmegaConf.to_container(dict_cfg, resolve=True), {**run_tags(cfg), **(tags or {})}, OmegaConf.to_yaml(dict_cfg),
        run_name(cfg),
        f"{describe(cfg)} **Failed**: {str(error).splitlines()[0] if str(error) else type(error).__name__}",
    )  # fmt: skip
    tracker.finish(failure=f"{type(error).__name__}: {error}")
    return run_id


@dataclass
class Observers:
    """The job's event stream and what follows it: the collector of the result, MLflow, the ledger, progress."""

    bus: ev.EventBus
    collector: _Collector
    ledger: FaultLedger
    progress: Any
    recorder: RunRecorder | None


def observe(cfg: JobConfig, tracker: Tracker | None, clock_origin: float, repeats: bool = True) -> Observers:
    """Subscribe the job's observers; ``repeats=False`` logs a run of equal per-step metrics by its first and last
    step only (a simulated plan's steps are identical)."""
    from ftlab.runtime.reporting.progress import ProgressLine

    bus = ev.EventBus()
    collector = _Collector()
    bus.subscribe(collector)
    recorder = None
    if tracker is not None:
        recorder = RunRecorder(tracker, cfg.model.seq_len, clock_origin=clock_origin, repeats=repeats)
        bus.subscribe(recorder)
    ledger = FaultLedger(bus)
    progress = ProgressLine(cfg.train.steps, enabled=cfg.progress, plain_every=10 if repeats else max(10, cfg.train.steps // 20))
    bus.subscribe(progress)
    return Observers(bus, collector, ledger, progress, recorder)


def conclude(
    cfg: JobConfig, tracker: Tracker | None, seen: Observers, checked: Preflight, injector: Injector | None,
    stopped: JobStopped | None, worker_pids: dict[int, list[int]] | None = None,
) -> JobResult:  # fmt: skip
    """The job's result, its summary metrics and timeline.png; the faults that never fired are warned of."""
    seen.progress.close()
    reached = max((s.step for s in seen.collector.steps), default=-1)
    ended = [(fault, _unfired_reason(fault, reached)) for fault in injector.pending()] if injector else []
    _warn_unfired(seen.bus, ended, seen.collector.last_at)
    if seen.recorder is not None:
        seen.recorder.close()
    steps, plans = seen.collector.steps, seen.collector.plans
    summary: dict[str, float] = {}
    if steps and plans and seen.collector.started is not None:
        summary = summarise(steps, seen.ledger, plans[0].generation)
        summary["summary/faults_unfired"] = float(len(checked.beyond) + len(ended))
        if tracker is not None:
            tracker.log_metrics(summary, cfg.train.steps)
            title = f"{cfg.policy.name} | {cfg.faults.schedule}"
            _log_timeline(tracker, steps, seen.ledger, seen.collector.started, plans[0], title)
    return JobResult(
        "", steps, plans, summary, list(seen.ledger.records), worker_pids or {}, cfg.train.checkpoint_dir,
        seen.collector.events, None if stopped is None else str(stopped),
    )  # fmt: skip


def record_checks(cfg: JobConfig, tracker: Tracker | None, seen: Observers, checked: Preflight, at: float) -> None:
    """What the checks before the job found: the protection's choices as tags, faults beyond the job warned of, a
    ``train.stages`` the policy does not use."""
    if checked.policy.plans_own_depth and cfg.train.stages != TrainConfig.stages:
        depths = sorted({len(p.stages) for p in checked.decision.plan.pipelines})
        log.warning("train.stages=%d is not used: policy=%s chooses its pipelines' depth itself (its first plan: %s "
                    "stages)", cfg.train.stages, cfg.policy.name, " and ".join(map(str, depths)))  # fmt: skip
    if tracker is not None:
        for key, value in checked.protection.describe().items():
            tracker.set_tag(f"protection.{key}", value)
    _warn_unfired(seen.bus, [(fault, _beyond_reason(fault, checked.first_step, cfg.train.steps))
                             for fault in checked.beyond], at)  # fmt: skip


def _beyond_reason(fault: FaultEvent, first_step: int, steps: int) -> str:
    if (fault.at_step or 0) >= steps:
        return f"the job runs steps before {steps} only (train.steps)"
    return f"the job resumes at step {first_step} (train.resume_from): the job it resumes ran the steps before"


@dataclass
class _Collector:
    """What the job's result and summary need from the event stream."""

    steps: list[ev.StepCommitted] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    events: list[ev.Event] = field(default_factory=list)
    started: float | None = None
    last_at: float = 0.0
    """The time of the latest event (the job's clock: monotonic, or simulated)."""

    def __call__(self, event: ev.Event) -> None:
        self.last_at = max(self.last_at, event.at)
        match event:
            case ev.StepStarting() if self.started is None:
                self.started = event.at
            case ev.StepCommitted():
                self.steps.append(event)
            case ev.PlanConfigured():
                self.plans.append(event.plan)
        if event.logged:
            self.events.append(event)


def worker_setup(cfg: JobConfig, checked: Preflight) -> dict[str, Any]:
    """What every worker of the job is started with (``runtime.processes.worker``), less the cluster's memory root."""
    from ftlab.runtime.training.optim import OptimSettings

    t, c = cfg.train, cfg.cluster
    return {
        "model": cfg.model,
        "optim": OptimSettings.of(t),
        "seed": t.seed,
        "tokens_path": str(checked.tokens),
        "backend": checked.backend,
        "comm_timeout_s": c.comm_timeout_s,
        "activation_checkpointing": t.activation_checkpointing,
        "zero": t.zero,
        "precision": t.precision,
        "norms": needs_norms(t),
        "aor": False,
        **checked.protection.runtime_options(),
    }


def _run(cfg: JobConfig, tracker: Tracker) -> JobResult:
    checked = preflight(cfg)
    # Process code loads only now: the checks above ran without torch.
    from ftlab.runtime.processes.cluster import LocalCluster
    from ftlab.runtime.control.coordinator import Coordinator
    from ftlab.runtime.processes.local_backend import LocalBackend

    t, c = cfg.train, cfg.cluster
    seen = observe(cfg, tracker, clock_origin=time.monotonic())
    record_checks(cfg, tracker, seen, checked, time.monotonic())
    setup = worker_setup(cfg, checked)
    cluster = LocalCluster(
        c.nodes, c.workers_per_node, c.heartbeat_s, worker_threads(c), c.coordinator_addr, make_launcher(c),
        c.coordinator_port, c.store_port,
    )  # fmt: skip
    setup["memory_root"] = str(cluster.memory_root)
    injector: Injector | None = None
    stopped: JobStopped | None = None
    try:
        cluster.start(c.start_timeout_s)
        why = checked.backend_why
        if c.launcher != "local":
            setup["backend"], why = backend_for(cfg, checked.backend, cluster.gpus_of_node(), cluster.launcher.same_machine)
        log.info("communication backend: %s (%s)", setup["backend"], why)
        tracker.set_tag("comm_backend", setup["backend"])
        tracker.set_tag("comm_backend.why", why)
        backend = LocalBackend(cluster, seen.bus, setup, c.heartbeat_timeout_s)
        injector = Injector(checked.faults, backend, seen.bus)
        coordinator = Coordinator(
            backend, checked.policy, checked.protection, checked.make_job, seen.bus, t.steps, t.checkpoint_dir,
            update_rule(cfg, checked.decision),
        )
        coordinator.run(checked.decision)
    except JobStopped as exc:
        stopped = exc
    finally:
        if injector is not None:
            injector.stop()
        seen.progress.close()
        cluster.shutdown()
    return conclude(cfg, tracker, seen, checked, injector, stopped, dict(cluster.worker_pids))


def update_rule(cfg: JobConfig, first: Decision) -> UpdateRule:
    """The coordinator's rule for each update (clipping, fp16's loss scale), from the loss scaler a resumed
    checkpoint recorded if there is one."""
    start = None
    if cfg.train.resume_from is not None and isinstance(first.restore, StorageSource):
        start = scaler_from_manifest(json.loads((Path(first.restore.directory) / checkpoint.MANIFEST).read_text()))
    return UpdateRule(cfg.train, first.plan.step, start)


def worker_threads(c: ClusterConfig) -> int:
    """``cluster.threads_per_worker``, or with 0 the job's share of this machine's CPUs (split among the jobs that
    run at once, then among the job's workers), at least one."""
    if c.threads_per_worker > 0:
        return c.threads_per_worker
    cpus = len(os.sched_getaffinity(0))
    return max(1, cpus // max(1, c.parallel_jobs) // (c.nodes * c.workers_per_node))


PHASE_TAKERS = {
    "checkpoint": "a checkpoint is written by the first holder of each layer, at the steps the protection saves",
    "snapshot": "a snapshot is copied by its writers, at the steps protection=reft snapshots",
    "transfer": "layers are received only in an in-place reconfiguration that resumes at that step",
}
"""The phases only some workers enter, and which: the reason a phase fault armed on another one never fired."""


def _unfired_reason(fault: FaultEvent, reached: int) -> str:
    """Why ``fault`` never fired, the job's last committed step being ``reached``: a phase fault whose step the job
    ran had a target that never entered that phase (a worker that writes no checkpoint, for one), and says so."""
    if fault.phase is None or fault.at_step is None or reached < fault.at_step:
        return "the job ended before it fired"
    target = f"node {fault.node}" if fault.worker is None else f"worker {fault.worker} of node {fault.node}"
    why = PHASE_TAKERS.get(fault.phase, f"it had no {fault.phase} work in that step (not in its plan, or gone by then)")
    return f"the job ran step {fault.at_step}, but {target} never entered its {fault.phase} phase there: {why}"


def _warn_unfired(bus: ev.EventBus, unfired: list[tuple[FaultEvent, str]], at: float) -> None:
    """A scheduled fault that does not fire is a warning in the log and an event in the run (``events.jsonl``)."""
    for fault, reason in unfired:
        log.warning("fault not fired: the %s fault at %s: %s", fault.kind, fault.when, reason)
        bus.publish(ev.FaultUnfired(at=at, fault=fault.to_dict(), reason=reason))


WARMUP_STEPS = 2
"""Iterations that start a job (allocations, first gloo connections, cold caches): on local-4 here the first two
took 0.29-0.30 s against a median of 0.23 s. Goodput counts neither their time nor their samples."""


def summarise(steps: list[ev.StepCommitted], ledger: FaultLedger, first_generation: int) -> dict[str, float]:
    """Run figures, goodput defined once.

    Goodput ratio = useful samples per second / fault-free samples per second, both after start-up:

    - useful samples per second: each step committed after the warm-up counted once (a step executed again after a
      rollback is wasted time, not more samples), over the time from the end of the warm-up to the last commit.
      Everything a fault costs lies in that window: detection, recovery, lost steps, slower plans on fewer nodes,
      and so does every checkpoint a protection writes.
    - fault-free samples per second: the same job's own iterations of its first plan after the warm-up, taken as
      their total samples over their total time (a mean rate: a median iteration would ignore the occasional slow
      iteration that a fault-free run also has, and read a fault-free run below 1). Measured in the same run, so
      the machine's load at the time is in both. If a fault comes before any such iteration, the warm-up
      iterations of the first plan stand in, and the ratio is pessimistic; if the first plan committed no step at
      all (a fault in step 0), the first plan that did.

    A fault-free run without checkpoints therefore reads 1.0 up to the coordinator's gaps between iterations.
    """
    warm = min(WARMUP_STEPS, len(steps) - 1)
    after = steps[warm:]
    window_start = steps[warm - 1].at if warm > 0 else steps[0].at - steps[0].iter_s
    done_in_warmup = {s.step for s in steps[:warm]}
    useful = {s.step: s.samples for s in after if s.step not in done_in_warmup}
    rate = sum(useful.values()) / (steps[-1].at - window_start)
    if not any(s.generation == first_generation for s in steps):
        first_generation = steps[0].generation  # the first plan failed before committing: its successor stands in
    reference = [s for s in after if s.generation == first_generation] or [
        s for s in steps if s.generation == first_generation
    ]
    fault_free = sum(s.samples for s in reference) / sum(s.iter_s for s in reference)
    recovered = [r.recover_s for r in ledger.records if r.recover_s is not None]
    lost = [r.lost_steps for r in ledger.records if r.lost_steps is not None]
    skipped = steps[-1].numerics.skipped_steps if steps[-1].numerics is not None else None
    return {
        "summary/samples_per_s": rate,
        "summary/fault_free_samples_per_s": fault_free,
        "summary/goodput_ratio": rate / fault_free,
        "summary/recovery_s_total": sum(recovered),
        "summary/lost_steps_total": float(sum(lost)),
        "summary/failures": float(len([r for r in ledger.records if r.noticed_at is not None])),
        "summary/median_iter_s": statistics.median(s.iter_s for s in reference),
        "summary/final_loss": steps[-1].loss,
        "summary/steps": float(len({s.step for s in steps})),
        **({} if skipped is None else {"summary/skipped_steps": float(skipped)}),  # fp16's, since training began
    }


def _log_timeline(
    tracker: Tracker, steps: list[ev.StepCommitted], ledger: FaultLedger, started: float, plan: Plan, title: str
) -> None:
    from ftlab.runtime.reporting.timeline import merge_steps, plot_timeline

    path = plot_timeline(
        merge_steps([(s.at - s.iter_s - started, s.at - started, plan.global_batch / s.iter_s) for s in steps]),
        [r.fired_at - started for r in ledger.records if r.fired_at is not None],
        [r.recovered_at - started for r in ledger.records if r.recovered_at is not None],
        tracker.local / "timeline.png",
        title,
    )
    tracker.log_file(path)
