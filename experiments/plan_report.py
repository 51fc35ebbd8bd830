"""``ftlab mode=plan``: what a job would run, and how fast, without starting a worker.

For any model and cluster config the report shows the policy's first plan and a predicted iteration time:

- ``policy=oobleck``: the pipeline templates (nodes, stages with their layers and GPUs, time per micro-batch), the
  pipelines instantiated from them (how many of each template, on which nodes), the micro-batches each pipeline
  runs, and the predicted iteration time (the slowest pipeline) and throughput, exactly as the planner computes
  them: the report calls the policy's own ``Oobleck.layout``, which its first plan comes from.
- any other policy: its first plan, from the policy's own ``plan`` (for ``none`` and ``checkpoint_restart``, the
  PP x DP grid of ``train.stages``).

Every policy's first plan, where the runtime can run it, is also timed by executing its programs on
``runtime.core.program_check``'s abstract machine with ``runtime.core.costs.CostModel.durations``: compute, activation
transfers, the gradient all-reduce and the optimizer step.

Where the costs come from (``cluster.device``):

- ``cpu`` (the default) or ``cuda``: the model is measured on this machine (``runtime.processes.profiler.measure_profile``,
  cached under ``<train.cache_dir>/profiles``: the very profile the Oobleck policy plans training with). Templates
  put one worker on each stage, as the runtime does. Measuring runs every layer forward and backward several times,
  so it is refused for models too large for this machine (``experiments.job.MEASURE_FLOPS_LIMIT``).
- a GPU type of ``runtime.core.devices`` (``A40``, ``A100-80GB``, ...): the analytic profile from FLOPs and datasheet
  figures, which takes milliseconds at any size, and templates may use tensor parallelism inside a node. A paper
  scale job (GPT-3 6.7B on 16 x 8 A100) plans in well under a second.

Memory per device is ``cluster.device_memory_gb`` in both cases (a GPU's datasheet memory is only mentioned).
Oobleck's own predicted times count pipeline compute and activation transfers, as in its paper; the program
timing adds the rest. Impossible settings raise ``ConfigError`` saying which setting to change.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ftlab.experiments.config import JobConfig
from ftlab.experiments.deepspeed_config import apply as apply_deepspeed_config
from ftlab.experiments.job import (
    REFUSALS, check_device, check_memory, check_settings, components, everyone, job_factory, job_profile, refusal,
    run_tags, describe, run_name,
)  # fmt: skip
from ftlab.policies.oobleck.policy import Oobleck
from ftlab.policies.oobleck.templates import PipelineTemplate
from ftlab.runtime.core.contract import ConfigError, Decision, Job, Protection
from ftlab.runtime.core.costs import ModelProfile
from ftlab.runtime.core.devices import DEVICES
from ftlab.runtime.core.plan import Plan, PlanError
from ftlab.runtime.core.program_check import simulate
from ftlab.runtime.reporting.tracking import Tracker

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class PlanReport:
    text: str
    data: dict[str, Any]
    """Everything the text says, JSON-serialisable (``plan.json``)."""
    plan: Plan | None = None
    """The runtime Plan, where one exists (not for tensor-parallel templates)."""
    run_id: str | None = None

    @property
    def metrics(self) -> dict[str, float]:
        d = self.data
        return {
            "plan/iteration_s": d["iteration_s"],
            "plan/samples_per_s": d["samples_per_s"],
            "plan/tokens_per_s": d["tokens_per_s"],
            "plan/pipelines": float(len(d["pipelines"])),
            "plan/planning_s": d["planning_s"],
        }


# ------------------------------------------------------------------------------------------------------ entry points


def plan_job(dict_cfg: DictConfig, defer_refusal: bool = False) -> PlanReport:
    """``ftlab mode=plan``: one MLflow run holding the report; FAILED with the reason when the job cannot plan.
    Settings wrong whatever the plan are refused before MLflow loads (``job.tracked`` says how)."""
    try:
        dict_cfg, deepspeed = apply_deepspeed_config(dict_cfg)
        cfg: JobConfig = OmegaConf.to_object(dict_cfg)
        _check_shape(cfg)
    except REFUSALS as exc:
        raise refusal(dict_cfg, exc, defer_refusal, {"mode": "plan"})  # noqa: B904 - the refusal is the error
    tracker = Tracker(cfg.tracking)
    tags = {**run_tags(cfg), "mode": "plan", "device": cfg.cluster.device}
    run_id = tracker.start(
        {**OmegaConf.to_container(dict_cfg, resolve=True), **deepspeed}, tags, OmegaConf.to_yaml(dict_cfg),
        f"plan-{run_name(cfg)}",
        describe(cfg),
    )  # fmt: skip
    try:
        report = plan_report(cfg, tracker)
    except BaseException as exc:
        tracker.finish(failure=f"{type(exc).__name__}: {exc}")
        raise
    tracker.finish()
    return dataclasses.replace(report, run_id=run_id)


def plan_report(cfg: JobConfig, tracker: Tracker | None = None) -> PlanReport:
    """Build the report and, given a tracker with an open run, log it there."""
    report = build_report(cfg)
    if tracker is not None:
        tracker.log_text("plan.txt", report.text)
        tracker.log_text("plan.json", json.dumps(report.data, indent=1))
        if report.data["kind"] == "oobleck":
            tracker.log_text("templates.txt", render_templates(report.data))
        if report.plan is not None:
            tracker.log_text(f"plans/generation-{report.plan.generation:03d}.json", report.plan.to_json())
        tracker.log_metrics(report.metrics, 0)
    return report


def build_report(cfg: JobConfig) -> PlanReport:
    _check_shape(cfg)
    began = time.perf_counter()
    profile, source = _profile(cfg)
    profiled_s = time.perf_counter() - began
    policy, protection = components(cfg)
    job = job_factory(cfg, start=None)(everyone(cfg))
    began = time.perf_counter()
    try:
        protection.check(job)
        policy.check(protection)
        if isinstance(policy, Oobleck):
            data, plan = _oobleck(cfg, job, policy, protection, tensor_parallel=cfg.cluster.device in DEVICES)
        else:
            data, plan = _generic(cfg, job, policy.plan(job, protection))
    except PlanError as exc:
        advice = f" {_fit_advice(cfg, profile)}" if isinstance(policy, Oobleck) and "cannot plan" in str(exc) else ""
        raise ConfigError(f"{exc}{advice}") from exc
    data["planning_s"] = time.perf_counter() - began
    data["profile"] = {**source, "seconds": profiled_s}
    data = {**_header(cfg, profile), **data}
    data["samples_per_s"] = cfg.train.global_batch / data["iteration_s"]
    data["tokens_per_s"] = data["samples_per_s"] * cfg.model.seq_len
    return PlanReport(render(data), data, plan)


# ---------------------------------------------------------------------------------------------------- the inputs


def _check_shape(cfg: JobConfig) -> None:
    check_settings(cfg)
    check_device(cfg)


def _profile(cfg: JobConfig) -> tuple[ModelProfile, dict[str, Any]]:
    """The job's profile (the one its policy plans with), its memory the configured ``cluster.device_memory_gb``."""
    profile, source = job_profile(cfg)
    if source["kind"] == "analytic":
        source["device_efficiency"] = cfg.cluster.device_efficiency
        source["precision"] = cfg.train.precision
    return dataclasses.replace(profile, device_memory_bytes=int(cfg.cluster.device_memory_gb * GIB)), source


def _header(cfg: JobConfig, profile: ModelProfile) -> dict[str, Any]:
    c, t = cfg.cluster, cfg.train
    device = cfg.cluster.device
    return {
        "model": {
            "name": cfg.model.name, "layers": profile.num_layers, "seq_len": cfg.model.seq_len,
            "parameters": sum(layer.param_bytes for layer in profile.layers) // 4,
        },
        "cluster": {
            "name": c.name, "nodes": c.nodes, "workers_per_node": c.workers_per_node, "device": device,
            "device_memory_gb": c.device_memory_gb,
            "datasheet_memory_gb": DEVICES[device].memory_bytes / GIB if device in DEVICES else None,
        },
        "policy": {"name": cfg.policy.name, "fault_threshold": getattr(cfg.policy, "fault_threshold", None)},
        "batch": {"global": t.global_batch, "micro": t.micro_batch, "microbatches": t.global_batch // t.micro_batch},
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------------- Oobleck


def _oobleck(
    cfg: JobConfig, job: Job, policy: Oobleck, protection: Protection, tensor_parallel: bool
) -> tuple[dict, Plan | None]:
    """The policy's own layout (templates, instantiation, batch split) and, with one worker per stage, its first
    plan: exactly what training starts from."""
    layout = policy.layout(job, tensor_parallel=tensor_parallel)
    data: dict[str, Any] = {
        "kind": "oobleck",
        "tensor_parallel": tensor_parallel,
        "templates": [_template_data(tpl) for tpl in layout.templates.templates],
        "counts": {str(n): c for n, c in sorted(layout.counts.items())},
        "pipelines": [
            {"template_nodes": p.template.num_nodes, "nodes": list(p.nodes), "microbatches": n,
             "iteration_s": p.template.iteration_time(n)}
            for p, n in zip(layout.pipelines, layout.split.microbatches)
        ],  # fmt: skip
        "iteration_s": layout.split.iteration_s,
    }
    if tensor_parallel:  # stages on several GPUs: the runtime has no plan for them
        return data, None
    decision = policy.plan(job, protection)
    check_memory(decision.plan, job)
    data["simulated_s"] = _time_programs(decision, job)
    return data, decision.plan


def _template_data(tpl: PipelineTemplate) -> dict[str, Any]:
    n = tpl.planning_microbatches
    return {
        "nodes": tpl.num_nodes,
        "stages": [
            {"layers": [s.start, s.stop], "node": s.node, "gpus": list(s.gpus), "time_s": s.time_s,
             "memory_gib": s.memory_bytes / GIB}
            for s in tpl.stages
        ],  # fmt: skip
        "per_microbatch_s": tpl.per_microbatch_s,
        "fixed_s": tpl.fixed_s,
        "planning_microbatches": n,
        "planning_iteration_s": tpl.iteration_time(n),
        "microbatches_per_s": tpl.rate,
    }


def _fit_advice(cfg: JobConfig, profile: ModelProfile) -> str:
    """What the model needs against what the cluster has, and which settings move either."""
    c, f = cfg.cluster, cfg.policy.fault_threshold
    state = sum(layer.param_bytes + layer.optimizer_bytes for layer in profile.layers) / GIB
    have = c.nodes * c.workers_per_node * c.device_memory_gb
    lines = [
        f"The model's weights and optimizer state take {state:.3g} GiB, f + 1 = {f + 1} replicas at least "
        f"{(f + 1) * state:.3g} GiB before activations; the cluster has {c.nodes} x {c.workers_per_node} x "
        f"{c.device_memory_gb:g} GiB = {have:.3g} GiB. Change cluster.nodes, cluster.workers_per_node, "
        f"cluster.device_memory_gb, policy.fault_threshold or train.micro_batch."
    ]
    device = cfg.cluster.device
    if device in DEVICES and c.device_memory_gb < DEVICES[device].memory_bytes / GIB:
        lines.append(
            f"Note: cluster.device_memory_gb={c.device_memory_gb:g} but an {device} has "
            f"{DEVICES[device].memory_bytes / GIB:g} GiB; an experiment preset (the default quickstart sets 0.04) "
            f"may have lowered it: add experiment=plain or cluster.device_memory_gb="
            f"{DEVICES[device].memory_bytes / GIB:g}."
        )
    return " ".join(lines)


# ---------------------------------------------------------------------------------------------- any other policy


def _generic(cfg: JobConfig, job: Job, decision: Decision) -> tuple[dict, Plan]:
    """The policy's first plan, timed by executing its programs with the job's costs."""
    plan = decision.plan
    plan.validate()
    check_memory(plan, job)
    wpn = cfg.cluster.workers_per_node
    data = {
        "kind": "plan",
        "pipelines": [
            {"stages": [{"worker": s.worker, "node": s.worker // wpn, "layers": [s.start, s.stop]} for s in p.stages],
             "microbatches": len(p.microbatches)}
            for p in plan.pipelines
        ],  # fmt: skip
        "iteration_s": _time_programs(decision, job),
    }
    return data, plan


def _time_programs(decision: Decision, job: Job) -> float:
    """The makespan of the decision's programs on the abstract machine, with the one cost model's durations."""
    return simulate(decision.programs, job.costs.durations(decision.plan), decision.plan)


# ---------------------------------------------------------------------------------------------------------- text


def _span(values: Sequence[int]) -> str:
    """Sorted integers as ranges: [0, 1, 2, 5] -> '0-2,5'."""
    out, values = [], sorted(values)
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out)


def render(d: dict[str, Any]) -> str:
    m, c, p, b = d["model"], d["cluster"], d["policy"], d["batch"]
    src = d["profile"]
    if src["kind"] == "analytic":
        source = (f"analytic: {src['device']} datasheet figures, {src['precision']} at {src['device_efficiency']:.0%} "
                  f"of peak")  # fmt: skip
    else:
        when = "from the cache" if src["seconds"] < 0.5 else f"in {src['seconds']:.1f} s, now cached"
        source = f"measured on {src['device']} ({when})"
    memory = f"{c['device_memory_gb']:g} GiB each"
    if c["datasheet_memory_gb"] is not None and c["datasheet_memory_gb"] != c["device_memory_gb"]:
        memory += f" (cluster.device_memory_gb; an {c['device']} has {c['datasheet_memory_gb']:g})"
    policy = p["name"] + (f", fault threshold f = {p['fault_threshold']}" if d["kind"] == "oobleck" else "")
    lines = [
        f"ftlab plan: {m['name']} on {c['name']}, policy {p['name']}",
        f"  model     {m['layers']} layers, {m['parameters'] / 1e9:.3g} B parameters, {m['seq_len']} tokens a sample",
        f"  cluster   {c['nodes']} nodes x {c['workers_per_node']} {c['device']} = "
        f"{c['nodes'] * c['workers_per_node']} workers, {memory}",
        f"  profile   {source}",
        f"  batch     {b['global']} samples = {b['microbatches']} micro-batches of {b['micro']}",
        f"  policy    {policy}",
        "",
    ]
    lines += _render_oobleck(d) if d["kind"] == "oobleck" else _render_plan(d)
    lines += [
        "",
        f"Predicted iteration: {d['iteration_s']:.4g} s, {d['samples_per_s']:.4g} samples/s, "
        f"{d['tokens_per_s']:,.0f} tokens/s",
    ]
    if d["kind"] == "oobleck":
        lines.append("  (Oobleck's model: pipeline compute and activation transfers)")
    if "simulated_s" in d:
        lines.append(
            f"  1F1B programs of this plan on the abstract machine: {d['simulated_s']:.4g} s (with the gradient "
            "all-reduce and the optimizer step)"
        )
    lines.append(f"Planned in {d['planning_s']:.3f} s.")
    return "\n".join(lines) + "\n"


def _render_oobleck(d: dict[str, Any], every_template: bool = False) -> list[str]:
    templates = d["templates"]
    sizes = f"{templates[0]['nodes']}..{templates[-1]['nodes']}"
    tp = "tensor parallel inside a node" if d["tensor_parallel"] else "one worker per stage"
    lines = [
        f"Pipeline templates ({len(templates)}, for {sizes} nodes; {tp})",
        f"  {'nodes':>5} {'stages':>6} {'s/micro-batch':>14} {'fixed s':>9} {'Nb':>4} {'iteration s':>12}"
        f" {'micro-batches/s':>16}",
    ]
    for t in templates:
        lines.append(
            f"  {t['nodes']:>5} {len(t['stages']):>6} {t['per_microbatch_s']:>14.4g} {t['fixed_s']:>9.4g}"
            f" {t['planning_microbatches']:>4} {t['planning_iteration_s']:>12.4g} {t['microbatches_per_s']:>16.4g}"
        )
    lines.append("  (iteration time = fixed + Nb x s/micro-batch at Oobleck's planning batch Nb = 4 x stages)")
    used = {p["template_nodes"] for p in d["pipelines"]}
    for t in templates:
        if every_template or t["nodes"] in used:
            lines += ["", *_render_stages(t)]
    if not every_template and len(used) < len(templates):
        lines += ["", "(stages of the other templates: templates.txt and plan.json)"]
    counts = ", ".join(f"{c} x {n} node{'s' if int(n) > 1 else ''}" for n, c in d["counts"].items())
    lines += [
        "",
        f"Chosen pipelines: {len(d['pipelines'])} ({counts})",
        f"  {'pipeline':>8} {'template':>8} {'nodes':>12} {'micro-batches':>13} {'iteration s':>12}",
    ]
    for i, p in enumerate(d["pipelines"]):
        lines.append(
            f"  {i:>8} {p['template_nodes']:>8} {_span(p['nodes']):>12} {p['microbatches']:>13}"
            f" {p['iteration_s']:>12.4g}"
        )
    return lines


def _render_stages(t: dict[str, Any]) -> list[str]:
    lines = [
        f"Template of {t['nodes']} node{'s' if t['nodes'] > 1 else ''}:",
        f"  {'stage':>5} {'layers':>9} {'node':>4} {'GPUs':>6} {'s/micro-batch':>14} {'GiB/GPU':>8}",
    ]
    for i, s in enumerate(t["stages"]):
        layers = f"{s['layers'][0]}..{s['layers'][1] - 1}"
        lines.append(
            f"  {i:>5} {layers:>9} {s['node']:>4} {_span(s['gpus']):>6} {s['time_s']:>14.4g} {s['memory_gib']:>8.3g}"
        )
    return lines


def render_templates(d: dict[str, Any]) -> str:
    """Every template with its stages (``templates.txt``); the report itself details the templates in use."""
    lines: list[str] = []
    for t in d["templates"]:
        lines += [*_render_stages(t), ""]
    return "\n".join(lines)


def _render_plan(d: dict[str, Any]) -> list[str]:
    pipelines = d["pipelines"]
    stages = {len(p["stages"]) for p in pipelines}
    shape = f"{stages.pop()} stages x {len(pipelines)} pipelines" if len(stages) == 1 else f"{len(pipelines)} pipelines"
    lines = [f"Plan: {shape}", f"  {'pipeline':>8} {'micro-batches':>13}  stages (worker@node: layers)"]
    for i, p in enumerate(pipelines):
        parts = "  ".join(f"{s['worker']}@{s['node']}: {s['layers'][0]}..{s['layers'][1] - 1}" for s in p["stages"])
        lines.append(f"  {i:>8} {p['microbatches']:>13}  {parts}")
    lines.append(
        "  (iteration time: the policy's programs executed with the profile's costs, gradient all-reduce and "
        "optimizer step included)"
    )
    return lines


def main(argv: list[str] | None = None) -> None:
    """``python -m ftlab.experiments.plan_report OVERRIDES...``: the plan of ``ftlab mode=plan OVERRIDES...``."""
    from ftlab.experiments.job import compose_config

    overrides = sys.argv[1:] if argv is None else argv
    try:
        report = plan_job(compose_config(["mode=plan", *overrides]))
    except ConfigError as exc:
        print(f"ftlab: {exc}", file=sys.stderr)
        sys.exit(1)
    print(report.text, end="")
    print(f"MLflow run {report.run_id}")


if __name__ == "__main__":
    main()
