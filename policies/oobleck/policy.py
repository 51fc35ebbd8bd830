"""Oobleck on the runtime: pipeline templates, f+1 heterogeneous pipelines, in-place reconfiguration.

Start: templates are generated from the job's profile for every node count the job can reach with
``fault_threshold`` failures, the best combination is instantiated and the batch distributed (``layout``, which plan
mode reports too). A failure reconfigures in place from the templates (reinstantiate, borrow, merge): surviving
workers keep running, missing layers are copied with their optimizer state from surviving replicas, the global
batch stays the same, and training resumes at the next step. A join re-instantiates all nodes from the templates.

Choices the paper leaves open:
- The reconfiguration starts from the pipelines of the last plan every worker was configured for (``Change.plan``;
  the pipelines of each plan this policy proposed are kept by generation), and every node of those that is not
  whole now counts as lost. A failure during a reconfiguration therefore plans again from the layout whose layers
  every survivor still holds (workers keep stale layers until the next step runs).
- A node whose worker process died counts as a lost node: in-place recovery restarts no process.
- Under ``policy=adaptive`` the running plan may be another policy's (``Change.plan`` is not one this policy
  proposed): then every whole live node is re-instantiated from the templates (Section 4.2) and each layer a GPU
  lacks is copied from a survivor that holds it (``Change.holdings``); a layer with no live holder means a restart.
- When recovery in place is impossible (a layer lost every replica, or fewer than (f + 1) n0 nodes are left), the
  policy restarts every worker on the templates re-instantiated over the live nodes from the protection's newest
  saved state, if the protection has one and the nodes still hold f + 1 pipelines; otherwise it stops (the
  coordinator then saves the survivors' state if they hold every layer, and says how to resume).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ftlab.policies.oobleck.batch import BatchError, BatchSplit, distribute_batch
from ftlab.policies.oobleck.instantiate import InstantiationError, PipelineInstance, assign_nodes, instantiate
from ftlab.policies.oobleck.reconfigure import Impossible, Reconfigured, Slot, on_failure, on_join, reinstantiate
from ftlab.policies.oobleck.templates import TemplateSet, generate_templates
from ftlab.policies.oobleck.to_plan import KeptPipelines, to_plan, worker_transfers
from ftlab.runtime.core.contract import Change, Decision, Job, Outcome, Policy, Protection, Roles, Source, Stop
from ftlab.runtime.core.plan import Plan, PlanError
from ftlab.runtime.core.scheduler import one_f_one_b


@dataclass(frozen=True)
class Layout:
    """What Oobleck's planner chose for a set of nodes: its templates, how many pipelines of each, where, and how
    many micro-batches each runs."""

    templates: TemplateSet
    counts: dict[int, int]
    """Template size (nodes) -> pipelines of it."""
    pipelines: tuple[PipelineInstance, ...]
    split: BatchSplit


class Oobleck(Policy):
    roles = Roles(in_place=True, candidate="reconfigure")
    moves_layers = True
    plans_own_depth = True  # its templates' depths

    def __init__(self, settings: object) -> None:
        super().__init__(settings)
        self.templates: TemplateSet | None = None
        self._pipelines: dict[int, tuple[PipelineInstance, ...]] = {}
        """The pipelines of every plan this policy proposed, by generation."""
        self._proposed: dict[int, Plan] = {}
        """The plan this policy proposed for every generation: tells its own running plan from another policy's."""
        self._kept = KeptPipelines()
        """The last plan's runtime pipelines: the next plan reuses those it shares with it."""

    # -- the first plan ----------------------------------------------------------------------------------------
    def layout(self, job: Job, tensor_parallel: bool = False) -> Layout:
        """Templates for the job's nodes, the instantiation and the batch split (Sections 4.1, 4.2 and Eq. 6).

        ``tensor_parallel``: templates may split a stage over several GPUs of a node (plan mode reports such
        layouts for GPU clusters); the runtime runs one worker per stage, so training plans without it.
        """
        f = self.settings.fault_threshold
        nodes = sorted(job.slots_of_node)
        t = job.train
        microbatches = t.global_batch // t.micro_batch
        if f < 0:
            raise PlanError(f"policy.fault_threshold={f}: use 0 or more")
        if len(nodes) < f + 1:
            raise PlanError(
                f"{len(nodes)} nodes cannot hold f + 1 = {f + 1} pipelines: lower policy.fault_threshold to at most "
                f"{len(nodes) - 1} or raise cluster.nodes to at least {f + 1}"
            )
        fewest = self.settings.min_nodes  # type: ignore[attr-defined]
        if not 1 <= fewest <= len(nodes) // (f + 1):
            raise PlanError(
                f"policy.min_nodes={fewest}: with {len(nodes)} nodes and f + 1 = {f + 1} pipelines, a pipeline template "
                f"has between 1 and {len(nodes) // (f + 1)} nodes; set policy.min_nodes in that range"
            )
        if microbatches < f + 1:
            raise PlanError(
                f"{microbatches} micro-batches cannot feed f + 1 = {f + 1} pipelines: raise train.global_batch to at "
                f"least {(f + 1) * t.micro_batch} or lower policy.fault_threshold"
            )
        profile = dataclasses.replace(job.profile(), device_memory_bytes=job.device_memory_bytes)
        try:
            templates = generate_templates(profile, len(nodes), f, job.workers_per_node, tensor_parallel, fewest)
        except ValueError as exc:
            raise PlanError(f"policy=oobleck cannot plan {job.model.name} on {len(nodes)} nodes: {exc}") from exc
        try:
            counts = instantiate(templates, len(nodes), max_pipelines=microbatches)
        except InstantiationError as exc:
            raise PlanError(
                f"policy=oobleck cannot instantiate pipelines: {exc}; change cluster.nodes, policy.fault_threshold "
                f"or train.global_batch"
            ) from exc
        pipelines = tuple(assign_nodes(templates, counts, nodes))
        return Layout(templates, counts, pipelines, self._split(pipelines, job))

    def plan(self, job: Job, protection: Protection) -> Decision:
        layout = self.layout(job)
        self.templates = layout.templates
        plan = self._plan(layout.pipelines, job.slots_of_node, job, generation=0, step=job.start_step)
        return self._decision(plan, layout.pipelines, f"templates of {layout.templates.sizes.start}.."
                              f"{layout.templates.sizes.stop - 1} nodes, pipelines {_sizes(layout.pipelines)}",
                              restore=job.start)  # fmt: skip

    @staticmethod
    def _split(pipelines: tuple[PipelineInstance, ...], job: Job) -> BatchSplit:
        try:
            return distribute_batch([p.template for p in pipelines], job.train.global_batch, job.train.micro_batch)
        except BatchError as exc:
            raise PlanError(f"{exc}: set train.global_batch={exc.suggested}") from exc

    def _plan(
        self, pipelines: tuple[PipelineInstance, ...], workers_of_node: Mapping[int, tuple[int, ...]], job: Job,
        generation: int, step: int,
    ) -> Plan:  # fmt: skip
        split = self._split(pipelines, job)
        t = job.train
        return to_plan(
            pipelines, split.microbatches, workers_of_node, t.global_batch, t.micro_batch, generation, step, self._kept
        )

    def _decision(self, plan: Plan, pipelines: tuple[PipelineInstance, ...], reason: str, **kwargs: object) -> Decision:
        self._pipelines[plan.generation] = pipelines
        self._proposed[plan.generation] = plan
        details = {"pipelines": _sizes(pipelines)}
        return Decision(plan, one_f_one_b(plan), reason=reason, details=details, **kwargs)  # type: ignore[arg-type]

    # -- changes -----------------------------------------------------------------------------------------------
    def on_change(self, change: Change, job: Job, protection: Protection) -> Outcome:
        assert self.templates is not None, "on_change before plan"
        whole = {n for n, ws in job.workers_of_node.items() if len(ws) == len(job.slots_of_node[n])}
        microbatches = job.train.global_batch // job.train.micro_batch
        result: Reconfigured | Impossible
        if self._proposed.get(change.plan.generation) != change.plan:
            held = _held_slots(change.holdings, {n: job.workers_of_node[n] for n in whole})
            why = "the running plan is another policy's"
            result = reinstantiate(sorted(whole), held, self.templates, microbatches, why)
        else:
            confirmed = self._pipelines[change.plan.generation]
            lost = {n for p in confirmed for n in p.nodes} - whole
            if lost:
                result = on_failure(confirmed, lost, self.templates, microbatches)
            else:
                result = on_join(confirmed, sorted(whole - {n for p in confirmed for n in p.nodes}), self.templates,
                                 microbatches)  # fmt: skip
        generation = change.generation
        if isinstance(result, Impossible):
            return self._restart(change, job, protection, generation, f"cannot recover in place: {result.reason}")
        survivors = {n: job.workers_of_node[n] for n in whole}
        plan = self._plan(result.pipelines, survivors, job, generation, change.step)
        transfers = tuple(worker_transfers(result.copies, survivors))
        return self._decision(plan, result.pipelines, f"{change.describe()}: " + "; ".join(result.actions),
                              transfers=transfers)  # fmt: skip

    def _restart(self, change: Change, job: Job, protection: Protection, generation: int, why: str) -> Outcome:
        """Restart from the protection's newest state; from scratch where it keeps state but has saved none yet (the
        steps lost are fewer than its interval), never where it keeps none and steps were committed."""
        source: Source | None = protection.restore_source(change)
        if source is None and change.step > 0 and not protection.keeps_state:
            return Stop(f"Oobleck {why}, and protection={protection.name} keeps no saved state to restart from")
        nodes = sorted(job.slots_of_node)
        step = source.step if source else 0
        try:
            counts = instantiate(self.templates, len(nodes), max_pipelines=job.train.global_batch // job.train.micro_batch)
            pipelines = tuple(assign_nodes(self.templates, counts, nodes))
            plan = self._plan(pipelines, job.slots_of_node, job, generation, step)
        except (InstantiationError, PlanError) as exc:
            return Stop(f"Oobleck {why}, and the {len(nodes)} live nodes cannot restart either: {exc}")
        where = f"{source.kind} of step {step}" if source else "scratch (nothing saved yet)"
        reason = f"{change.describe()}: {why}; restart on {len(nodes)} nodes from {where}"
        return self._decision(plan, pipelines, reason, restart=True, restore=source)


def _held_slots(
    holdings: Mapping[int, tuple[int, ...]], workers_of_node: Mapping[int, tuple[int, ...]]
) -> dict[Slot, range]:
    """The layers each GPU of ``workers_of_node`` holds, as Oobleck's slots (node, local GPU); a worker whose layers
    are not one contiguous run (none here: every plan gives a worker one stage) counts as holding nothing."""
    held: dict[Slot, range] = {}
    for node, workers in workers_of_node.items():
        for gpu, worker in enumerate(workers):
            layers = holdings.get(worker, ())
            if layers and list(layers) == list(range(layers[0], layers[-1] + 1)):
                held[(node, gpu)] = range(layers[0], layers[-1] + 1)
    return held


def _sizes(pipelines: tuple[PipelineInstance, ...]) -> list[int]:
    return [p.template.num_nodes for p in pipelines]
