"""Oobleck on the runtime: pipeline templates, f+1 heterogeneous pipelines, in-place reconfiguration.

Start: the model is profiled on this machine (cached), templates are generated for every node count the job can
reach with ``fault_threshold`` failures, the best combination is instantiated and the batch distributed. A failure
reconfigures in place from the templates (reinstantiate, borrow, merge): surviving workers keep running, missing
layers are copied with their optimizer state from surviving replicas, the global batch stays the same, and training
resumes at the next step. A join re-instantiates all nodes from the templates.

Choices the paper leaves open:
- The reconfiguration starts from the last *confirmed* pipelines (every worker configured), and every node of
  those that is not whole now counts as lost. A failure during a reconfiguration therefore plans again from the
  layout whose layers every survivor still holds (workers keep stale layers until the next step runs).
- A node whose worker process died counts as a lost node: in-place recovery restarts no process.
- When recovery in place is impossible the policy stops; the trainer then writes a checkpoint of the last committed
  step if every layer still has a live replica, and says how to resume (``train.resume_from``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from policies.base import Change, InPlace, Job, Policy, Recovery, Stop
from policies.oobleck.batch import BatchError, distribute_batch
from policies.oobleck.instantiate import InstantiationError, PipelineInstance, assign_nodes, instantiate
from policies.oobleck.reconfigure import Impossible, on_failure, on_join
from policies.oobleck.templates import TemplateSet, generate_templates
from policies.oobleck.to_plan import to_plan, worker_transfers
from runtime.plan import Plan, PlanError
from runtime.profiler import ModelProfile, measure_profile


@dataclass
class Oobleck(Policy):
    templates: TemplateSet | None = field(default=None, init=False)
    confirmed: tuple[PipelineInstance, ...] = field(default=(), init=False)
    """The pipelines of the last plan every worker was configured for."""
    _proposed: tuple[PipelineInstance, ...] = field(default=(), init=False)

    # -- the first plan ----------------------------------------------------------------------------------------
    def plan(self, job: Job, generation: int = 0, step: int = 0) -> Plan:
        f = self.settings.fault_threshold
        nodes = sorted(job.workers_of_node)
        if f < 0:
            raise PlanError(f"policy.fault_threshold={f}: use 0 or more")
        if len(nodes) < f + 1:
            raise PlanError(
                f"{len(nodes)} nodes cannot hold f + 1 = {f + 1} pipelines: lower policy.fault_threshold to at most "
                f"{len(nodes) - 1} or use a cluster with more nodes"
            )
        wpn = len(next(iter(job.slots_of_node.values())))
        try:
            self.templates = generate_templates(self._profile(job, wpn), len(nodes), f, wpn, tensor_parallel=False)
            counts = instantiate(self.templates, len(nodes), max_pipelines=self._microbatches(job))
        except (ValueError, InstantiationError) as exc:
            raise PlanError(f"policy=oobleck cannot plan this job: {exc}") from exc
        return self._plan(tuple(assign_nodes(self.templates, counts, nodes)), job, generation, step)

    def _profile(self, job: Job, workers_per_node: int) -> ModelProfile:
        profile = measure_profile(
            job.model, job.train.micro_batch, workers_per_node=workers_per_node,
            cache_dir=Path(job.train.cache_dir) / "profiles",
        )  # fmt: skip
        # The planner must respect the memory the cluster config grants a device, not what this host has.
        return dataclasses.replace(profile, device_memory_bytes=job.device_memory_bytes)

    @staticmethod
    def _microbatches(job: Job) -> int:
        return job.train.global_batch // job.train.micro_batch

    def _plan(self, pipelines: tuple[PipelineInstance, ...], job: Job, generation: int, step: int) -> Plan:
        try:
            split = distribute_batch([p.template for p in pipelines], job.train.global_batch, job.train.micro_batch)
        except BatchError as exc:
            raise PlanError(f"{exc}: set train.global_batch={exc.suggested}") from exc
        plan = to_plan(
            pipelines, split.microbatches, job.workers_of_node, job.train.global_batch, job.train.micro_batch,
            generation, step,
        )  # fmt: skip
        self._proposed = pipelines
        return plan

    def configured(self, plan: Plan) -> None:
        self.confirmed = self._proposed

    # -- changes -----------------------------------------------------------------------------------------------
    def on_change(self, change: Change, job: Job) -> Recovery:
        assert self.templates is not None, "on_change before plan"
        whole = {n for n, ws in job.workers_of_node.items() if len(ws) == len(job.slots_of_node[n])}
        held = {n for p in self.confirmed for n in p.nodes}
        lost = held - whole
        if lost:
            result = on_failure(self.confirmed, lost, self.templates, self._microbatches(job))
        else:
            result = on_join(self.confirmed, sorted(whole - held), self.templates, self._microbatches(job))
        if isinstance(result, Impossible):
            return Stop(f"Oobleck cannot recover in place: {result.reason}")
        survivors = {n: job.workers_of_node[n] for n in whole}
        plan = self._plan(result.pipelines, dataclasses.replace(job, workers_of_node=survivors), change.plan.generation + 1, change.step)
        return InPlace(plan, tuple(worker_transfers(result.copies, survivors)))
