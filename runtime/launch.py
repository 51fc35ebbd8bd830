"""One job from a composed config: pre-flight checks, the MLflow run, the cluster, the trainer, the summary.

Everything that can be checked without a worker is checked before the first process starts, and every way out of
the job closes the MLflow run: FINISHED, or FAILED with the reason.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from faults.injector import Injector
from faults.schedules import ClusterShape, FaultEvent, build_schedule
from policies.base import Job, Policy
from runtime import checkpoint
from runtime.cluster import LocalCluster
from runtime.config import JobConfig, register
from runtime.data import load_tokens, tokenize_corpus
from runtime.fault_ledger import FaultLedger, FaultRecord
from runtime.model import layer_specs, training_memory_bytes
from runtime.optim import OptimSettings
from runtime.plan import Plan, PlanError
from runtime.progress import ProgressLine
from runtime.timeline import plot_timeline
from runtime.tracking import Tracker
from runtime.trainer import Hooks, StepRecord, Trainer

CONF_DIR = Path(__file__).parents[1] / "conf"


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The job config that ``ftlab OVERRIDES...`` would run, for tests, benchmarks and notebooks."""
    register()
    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra.compose("config", overrides=overrides or [])


class ConfigError(ValueError):
    """A job that cannot work as configured; the message says what to change."""


@dataclass
class JobResult:
    run_id: str
    steps: list[StepRecord]
    plans: list[Plan]
    summary: dict[str, float]
    faults: list[FaultRecord]
    worker_pids: dict[int, list[int]]
    checkpoint_dir: str = ""


def resolve_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in ("gloo", "nccl"):
        raise ConfigError(f"cluster.backend={requested!r}: use auto, gloo or nccl")
    if requested == "nccl" and not torch.cuda.is_available():
        raise ConfigError("cluster.backend=nccl needs CUDA, which this machine lacks: use cluster.backend=gloo")
    return requested


def check_memory(plan: Plan, job: Job) -> None:
    """Refuse a plan whose stage would not fit the configured device memory."""
    seq_len = job.model.seq_len
    for p, s, stage in plan.stages():
        stages = len(plan.pipelines[p].stages)
        need = training_memory_bytes(list(job.specs), stage.start, stage.stop, plan.micro_batch, seq_len, stages - s)
        if need > job.device_memory_bytes:
            raise ConfigError(
                f"stage {s} of pipeline {p} (layers {stage.start}..{stage.stop - 1} of {job.model.name}) needs "
                f"{need / 2**30:.2f} GiB but a device has {job.device_memory_bytes / 2**30:.2f} GiB: use more "
                f"pipeline stages (train.stages), a smaller train.micro_batch, or raise cluster.device_memory_gb"
            )


JobFactory = Callable[[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]], Job]


def _job_factory(cfg: JobConfig) -> JobFactory:
    specs = tuple(layer_specs(cfg.model))
    memory = int(cfg.cluster.device_memory_gb * 2**30)

    def make(workers_of_node: dict[int, tuple[int, ...]], slots_of_node: dict[int, tuple[int, ...]]) -> Job:
        return Job(cfg.model, specs, cfg.train, workers_of_node, slots_of_node, memory)

    return make


@dataclass
class Preflight:
    policy: Policy
    plan: Plan
    faults: list[FaultEvent]
    backend: str
    tokens: Path
    make_job: JobFactory
    restore: str | None
    """The checkpoint directory the first plan starts from (train.resume_from), if any."""


def preflight(cfg: JobConfig) -> Preflight:
    """Everything checkable before a worker starts. Raises ConfigError with what to change."""
    backend = resolve_backend(cfg.cluster.backend)
    if cfg.cluster.nodes < 1 or cfg.cluster.workers_per_node < 1:
        raise ConfigError("cluster.nodes and cluster.workers_per_node must be at least 1")
    if cfg.train.steps < 1:
        raise ConfigError(f"train.steps={cfg.train.steps}: train for at least one step")
    make_job = _job_factory(cfg)
    wpn = cfg.cluster.workers_per_node
    everyone = {n: tuple(range(n * wpn, (n + 1) * wpn)) for n in range(cfg.cluster.nodes)}
    job = make_job(everyone, everyone)
    try:
        policy: Policy = hydra.utils.instantiate(OmegaConf.structured(cfg.policy), _convert_="all")
    except Exception as exc:  # noqa: BLE001 - Hydra wraps the real cause
        raise ConfigError(f"policy {cfg.policy.name!r} cannot be built from its config: {exc}") from exc
    resume_step, restore = _resume_point(cfg)
    try:
        plan = policy.plan(job, step=resume_step)
        plan.validate()
    except PlanError as exc:
        raise ConfigError(str(exc)) from exc
    check_memory(plan, job)
    faults = build_schedule(cfg.faults, ClusterShape(cfg.cluster.nodes, wpn))
    tokens = tokenize_corpus(cfg.train.data, cfg.model.vocab_size, Path(cfg.train.cache_dir))
    if len(load_tokens(tokens)) <= cfg.model.seq_len:
        raise ConfigError(
            f"train.data={cfg.train.data} holds {len(load_tokens(tokens))} tokens, fewer than one sample of "
            f"{cfg.model.seq_len + 1}: use a longer text or a model with a shorter seq_len"
        )
    return Preflight(policy, plan, faults, backend, tokens, make_job, restore)


def _resume_point(cfg: JobConfig) -> tuple[int, str | None]:
    if cfg.train.resume_from is None:
        return 0, None
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
    return step, str(directory)


def run_job(dict_cfg: DictConfig) -> JobResult:
    cfg: JobConfig = OmegaConf.to_object(dict_cfg)
    tracker = Tracker(cfg.tracking)
    tags = {
        "policy": cfg.policy.name,
        "model": cfg.model.name,
        "cluster": cfg.cluster.name,
        "faults": cfg.faults.schedule,
    }
    resolved = OmegaConf.to_container(dict_cfg, resolve=True)
    run_id = tracker.start(resolved, tags, OmegaConf.to_yaml(dict_cfg))
    progress: ProgressLine | None = None
    cluster: LocalCluster | None = None
    try:
        cfg.policy.checkpoint_dir = str(Path(cfg.policy.checkpoint_dir) / run_id)
        checked = preflight(cfg)
        progress = ProgressLine(cfg.train.steps, enabled=cfg.progress)
        cluster = LocalCluster(
            cfg.cluster.nodes, cfg.cluster.workers_per_node, cfg.cluster.heartbeat_s, cfg.cluster.threads_per_worker
        )
        cluster.start(cfg.cluster.start_timeout_s)
        result = _train(cfg, tracker, progress, cluster, checked)
        result.run_id = run_id
        result.checkpoint_dir = cfg.policy.checkpoint_dir
        tracker.finish()
        return result
    except BaseException as exc:
        tracker.finish(failure=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if progress is not None:
            progress.close()
        if cluster is not None:
            cluster.shutdown()


def _train(
    cfg: JobConfig,
    tracker: Tracker,
    progress: ProgressLine,
    cluster: LocalCluster,
    checked: Preflight,
) -> JobResult:
    t = cfg.train
    setup = {
        "model": cfg.model,
        "optim": OptimSettings(t.lr, t.min_lr, t.warmup_steps, t.steps, t.weight_decay, t.beta1, t.beta2),
        "seed": t.seed,
        "tokens_path": str(checked.tokens),
        "backend": checked.backend,
        "comm_timeout_s": cfg.cluster.comm_timeout_s,
    }
    plans: list[Plan] = []
    ledger = FaultLedger()
    injector = Injector(
        checked.faults, cluster, tracker.event, lambda fired: ledger.fired(fired.event.kind, fired.workers, fired.at)
    )
    clock: dict[str, float] = {}

    def before_step(step: int) -> None:
        if "start" not in clock:
            clock["start"] = time.monotonic()
            injector.start()
        injector.before_step(step)

    def on_step(record: StepRecord, current: Plan) -> None:
        samples = current.global_batch / record.iter_s
        alive = len(cluster.alive_nodes())
        tracker.log_metrics(
            {
                "train/loss": record.loss,
                "perf/iter_s": record.iter_s,
                "perf/samples_per_s": samples,
                "perf/tokens_per_s": samples * cfg.model.seq_len,
                "cluster/alive_nodes": alive,
                "cluster/pipelines": len(current.pipelines),
            },
            record.step,
        )
        progress.update(record.step, record.loss, samples, alive)

    def on_plan(current: Plan) -> None:
        plans.append(current)
        tracker.log_text(f"plans/generation-{current.generation:03d}.json", current.to_json())
        tracker.event("plan", generation=current.generation, step=current.step, pipelines=len(current.pipelines))

    def on_event(kind: str, **fields: Any) -> None:
        tracker.event(kind, **fields)
        if kind == "failure_detected":
            progress.announce(f"failure: nodes {fields['nodes']} workers {fields['workers']} at step {fields['step']}")
        elif kind == "hang_detected":
            progress.announce(f"worker {fields['worker']} hung: fenced")
        elif kind == "nodes_joined":
            progress.announce(f"nodes {fields['nodes']} joined")

    def on_recovered(records: list[FaultRecord]) -> None:
        for record in records:
            index = ledger.records.index(record)
            metrics = {
                "ft/detect_s": record.detect_s,
                "ft/recover_s": record.recover_s,
                "ft/lost_steps": record.lost_steps,
                "ft/transfer_bytes": record.transfer_bytes,
            }
            tracker.log_metrics({k: v for k, v in metrics.items() if v is not None}, index)
            tracker.event("recovered", fault=index, fault_kind=record.kind, **{k.split("/")[1]: v for k, v in metrics.items()})
            progress.announce(f"recovered in {record.recover_s:.2f} s, {record.lost_steps} committed steps lost")

    hooks = Hooks(
        on_step=on_step,
        on_event=on_event,
        on_plan=on_plan,
        on_recovered=on_recovered,
        before_step=before_step,
        after_configure=injector.arm,
        on_at_phase=injector.at_phase,
    )
    trainer = Trainer(
        cluster, checked.policy, checked.make_job, setup, t.steps, cfg.cluster.heartbeat_timeout_s, hooks, ledger
    )
    try:
        records = trainer.run(checked.plan, checked.restore)
    finally:
        injector.stop()
    summary = summarise(records, ledger, checked.plan, clock["start"])
    tracker.log_metrics(summary, t.steps)
    _log_timeline(tracker, records, ledger, clock["start"], checked.plan, f"{cfg.policy.name} | {cfg.faults.schedule}")
    return JobResult("", records, plans, summary, list(ledger.records), dict(cluster.worker_pids))


def summarise(records: list[StepRecord], ledger: FaultLedger, first: Plan, started: float) -> dict[str, float]:
    """Run figures. Goodput compares useful samples per second (each committed step once, over the whole training
    time) with the fault-free rate of the same job, taken as the median iteration of the first plan."""
    wall = records[-1].ended_at - started
    useful = len({r.step for r in records}) * first.global_batch
    fault_free_iter = statistics.median(r.iter_s for r in records if r.generation == first.generation)
    recovered = [r.recover_s for r in ledger.records if r.recover_s is not None]
    return {
        "summary/samples_per_s": useful / wall,
        "summary/goodput_ratio": (useful / wall) / (first.global_batch / fault_free_iter),
        "summary/recovery_s_total": sum(recovered),
        "summary/failures": float(len([r for r in ledger.records if r.noticed_at is not None])),
        "summary/median_iter_s": fault_free_iter,
        "summary/final_loss": records[-1].loss,
        "summary/steps": float(len({r.step for r in records})),
    }


def _log_timeline(
    tracker: Tracker, records: list[StepRecord], ledger: FaultLedger, started: float, plan: Plan, title: str
) -> None:
    path = plot_timeline(
        [(r.ended_at - r.iter_s - started, r.ended_at - started, plan.global_batch / r.iter_s) for r in records],
        [r.fired_at - started for r in ledger.records if r.fired_at is not None],
        [r.recovered_at - started for r in ledger.records if r.recovered_at is not None],
        tracker.local / "timeline.png",
        title,
    )
    tracker.log_file(path)
