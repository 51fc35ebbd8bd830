"""ReCycle on the runtime: keep training through failures by rerouting micro-batches to data-parallel peers.

Start: the PP x DP grid of ``train.stages`` (``policies.grid``), the paper's fault-free baseline and its bound:
ReCycle's throughput after failures is never above it (Table 1, GPT-3 Medium: 27.58 fault-free, 27.27 / 25.42 /
22.27 with a failure every 6 h / 2 h / 30 min), since a reroute only adds work to the survivors. Its programs come
from the planner that schedules the reroutes, given no dead slot, or are DeepSpeed's 1F1B where that is predicted
faster: on uneven stages (GPT-3 3.35B's nine blocks on one of four) the list scheduler beats 1F1B by about 3%, and
a fault-free plan on 1F1B would credit the first failure with that gain. The grid is also the *layout*: the roles
(pipeline, stage) and the worker that fills each; it keeps its healthy shape for the whole job.

A failure (a node, a worker process, a fenced hang) restarts no process and copies no layer: the layout keeps the
dead workers in their slots, and the planner (``planner.plan_recycle``) sends every micro-batch that would pass
through a dead slot to a surviving peer of that stage, then schedules one iteration of the rerouted work with the
list scheduler (``policy.solver=list``) or the MILP (``milp``: warm-started from the list schedule, at most
``policy.milp_time_limit_s``). Programs use decoupled backward (``BackwardInput`` now, ``BackwardWeight`` later)
for the rerouted micro-batches alone (``problem``: "avoid decoupling Backward unless necessary"); every other
backward stays one pass, as in 1F1B, the absorbing peers' own micro-batches included. Decoupling more would fill
the bubbles of the healthy pipelines, or of the peers' own work, credit a failure with that gain and make the job
faster after it than before, above the bound (``tests/test_fault_free_bound.py``); the simulator reports any plan
that still is (``Simulated.faster_than_fault_free``) rather than hide it.
Schedules are cached per failure pattern (the layout and its dead slots), so a pattern seen again (a failure during
the reconfiguration it caused, a join followed by the same failure) is planned in no time.

Choices the paper leaves open:
- Failures accumulate: each failure plans from the layout with every dead slot so far, never from the rerouted plan.
- Failure normalization (``policy.normalize``, Algorithm 1) only moves survivors when several failures crowd one
  stage beyond what its peers' bubbles absorb; a moved worker receives its new stage's layers from the stage's
  survivors (the only layer copies ReCycle makes on a failure). With one failure, or failures in distinct stages,
  nothing moves.
- A stage that lost every replica cannot be rerouted: every worker restarts on the largest grid the live nodes allow
  from the protection's newest saved state (``protection=storage``; from scratch when nothing is saved yet), and with
  ``protection=none`` the job stops. The decision's reason says which stage was lost.
- A node that joins takes back dead slots (pipeline by pipeline, stage by stage): each of its workers receives that
  stage's layers with their optimizer state from the peers that hold them, and when no dead slot is left the plan
  is the fault-free grid again. A node that finds no dead slot waits (``Keep``).
- Under ``policy=adaptive`` the running plan may be another policy's (``Change.plan`` is not one this policy
  proposed): a PP x DP grid (a restart's) becomes the layout, its dead workers the dead slots; any other plan (an
  Oobleck reconfiguration's heterogeneous pipelines) has no data-parallel peers per stage to reroute to, and the
  answer is ``Stop`` (adaptive then takes another candidate's answer).
- The memory limit of the schedule (micro-batches a worker holds at once) is what the device memory allows, at most
  twice the number of stages (``policy.memory_limit`` overrides it).
- The staggered optimizer (``policy.staggered_optimizer``) steps before the coordinator's commit, which is where the
  global gradient norm comes back: with ``train.grad_clip`` or fp16 (whose commit may skip the step) it would have
  to wait for the commit and gain nothing, so the pair is refused, naming both ways out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ftlab.policies.grid import grid, restart_grid
from ftlab.policies.recycle.config import SOLVERS
from ftlab.policies.recycle.normalization import NormalizationError
from ftlab.policies.recycle.planner import ReCyclePlan, plan_recycle
from ftlab.policies.recycle.problem import ReCycleError, StageCosts, grid_shape
from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.contract import (
    Change,
    ConfigError,
    Decision,
    Job,
    Keep,
    LayerTransfer,
    Outcome,
    Policy,
    Protection,
    Roles,
    Source,
    Stop,
)
from ftlab.runtime.core.plan import Pipeline, Plan, PlanError, Stage
from ftlab.runtime.core.precision import needs_norms
from ftlab.runtime.core.program_check import simulate
from ftlab.runtime.core.scheduler import one_f_one_b

PatternKey = tuple[tuple[tuple[tuple[int, ...], tuple[int, ...]], ...], frozenset[int]]
FaultFreeSchedule = tuple[dict[int, ins.Program], float, str]
"""A grid's fault-free programs, their predicted iteration in seconds and the scheduler that made them."""


class ReCycle(Policy):
    roles = Roles(in_place=True, restarts=True, candidate="reroute")
    """Reroutes around dead workers; restarts from the protection's state once a stage has lost every replica."""
    moves_layers = True
    """A join takes a failed role back with its stage's layers and optimizer state from a peer; rerouted
    micro-batches also change which replicas reduce each gradient, which ZeRO-1's fixed shards cannot follow."""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self._layouts: dict[int, Plan] = {}
        """The layout of every plan this policy proposed, by generation."""
        self._schedules: dict[PatternKey, ReCyclePlan] = {}
        """Rerouted schedules by failure pattern."""
        self._fault_free_schedules: dict[PatternKey, FaultFreeSchedule] = {}
        """The fault-free programs of a layout and their predicted iteration, by layout (no dead slot): every reroute
        compares against them, and predicting them again takes seconds on a thousand workers."""
        self._proposed: dict[int, Plan] = {}
        """The plan this policy proposed for every generation: tells its own running plan from another policy's."""

    def check(self, protection: Protection) -> None:
        s = self.settings
        if s.solver not in SOLVERS:
            raise ConfigError(f"policy.solver={s.solver!r}: use one of {', '.join(SOLVERS)}")
        if s.milp_time_limit_s <= 0:
            raise ConfigError(f"policy.milp_time_limit_s={s.milp_time_limit_s}: give the MILP a positive time limit")
        if s.memory_limit < 0:
            raise ConfigError(f"policy.memory_limit={s.memory_limit}: use 0 (from device memory) or a positive count")

    # -- the first plan --------------------------------------------------------------------------------------------
    def plan(self, job: Job, protection: Protection) -> Decision:
        if self.settings.staggered_optimizer and needs_norms(job.train):
            raise ConfigError(
                f"policy.staggered_optimizer=true steps before the commit, which carries the global gradient norm "
                f"that train.grad_clip={job.train.grad_clip} with train.precision={job.train.precision} needs: use "
                f"policy.staggered_optimizer=false, or train.grad_clip=0 with bf16 or fp32"
            )
        layout = grid(job.workers, job, generation=0, step=job.start_step)
        # The costs are needed at the first failure; measuring them then would lengthen the recovery.
        StageCosts.of_grid(job.costs, layout)
        return self._fault_free(layout, job, "the PP x DP grid of train.stages", restore=job.start)

    # -- changes ---------------------------------------------------------------------------------------------------
    def on_change(self, change: Change, job: Job, protection: Protection) -> Outcome:
        confirmed = self._layout_of(change.plan)
        if confirmed is None:
            return Stop(
                f"ReCycle reroutes between the data-parallel peers of a PP x DP grid, and the running plan "
                f"(generation {change.plan.generation}, another policy's) splits its pipelines' layers differently"
            )
        layout = dataclasses.replace(confirmed, generation=change.generation, step=change.step)
        alive = set(job.workers)
        if change.is_failure:
            lost = _lost_stages(layout, alive)
            if lost:
                return self._restart(change, job, protection, lost)
            return self._reroute(layout, alive, job, change.describe())
        return self._join(layout, alive, change, job)

    def _layout_of(self, running: Plan) -> Plan | None:
        """The layout ``running`` was planned from: this policy's own, or ``running`` itself if another policy
        proposed it and it is a grid (None if it is not)."""
        if self._proposed.get(running.generation) == running:
            return self._layouts[running.generation]
        try:
            grid_shape(running)
        except ReCycleError:
            return None
        self._layouts[running.generation] = self._proposed[running.generation] = running
        return running

    def _reroute(
        self, layout: Plan, alive: Collection[int], job: Job, why: str, transfers: tuple[LayerTransfer, ...] = ()
    ) -> Decision:
        """The plan around the dead slots of ``layout`` (the fault-free grid when there is none)."""
        dead = frozenset(w for w in layout.workers if w not in alive)
        if not dead:
            return self._fault_free(layout, job, why, transfers=transfers)
        cached, result = self._scheduled(layout, dead, job)
        assert result.layout is not None
        stamp = {"generation": layout.generation, "step": layout.step}
        plan = dataclasses.replace(result.plan, **stamp)
        self._layouts[plan.generation] = dataclasses.replace(result.layout, **stamp)
        self._proposed[plan.generation] = plan
        _, fault_free, _ = self._fault_free_schedule(layout, job)
        predicted = self._predict(plan, result.programs, job)
        rerouted = _rerouted(layout, plan, dead)
        moved = sorted({t.destination for t in result.transfers})
        reason = (
            f"{why}: micro-batches of {sorted(dead)} rerouted to peers {sorted(rerouted)}"
            + (f", workers {moved} moved by failure normalization" if moved else "")
            + f"; {result.method} schedule{' (cached)' if cached else ''}, predicted iteration "
            f"{predicted:.3f} s (fault-free {fault_free:.3f} s)"
        )
        details = {
            "failed": sorted(dead),
            "rerouted": rerouted,
            "moved": moved,
            "method": result.method,
            "optimal": result.optimal,
            "cached": cached,
            "makespan": result.makespan,
            "lower_bound": result.lower_bound,
            "solve_s": 0.0 if cached else result.solve_s,
            "predicted_iter_s": predicted,
            "fault_free_iter_s": fault_free,
            "decoupled": _decoupled(result.programs),
        }
        return Decision(
            plan, self._finish(result.programs), transfers=transfers + result.transfers, reason=reason, details=details,
            predicted_iter_s=predicted,
        )

    def _scheduled(self, layout: Plan, dead: frozenset[int], job: Job) -> tuple[bool, ReCyclePlan]:
        """The schedule of ``layout`` around ``dead``, and whether it was cached."""
        key = _pattern(layout, dead)
        cached = key in self._schedules
        if not cached:
            try:
                self._schedules[key] = self._schedule(layout, dead, job)
            except (ReCycleError, NormalizationError) as exc:  # _lost_stages rules these out; say so if not
                raise AssertionError(f"ReCycle could not reroute around {sorted(dead)}: {exc}") from exc
        return cached, self._schedules[key]

    def _schedule(self, layout: Plan, dead: Collection[int], job: Job) -> ReCyclePlan:
        s = self.settings
        return plan_recycle(
            layout, dead, StageCosts.of_grid(job.costs, layout), memory_limit=self._memory_limit(layout, job),
            method="milp" if s.solver == "milp" else "heuristic", time_limit_s=s.milp_time_limit_s,
            normalize=s.normalize,
        )  # fmt: skip

    def _memory_limit(self, layout: Plan, job: Job) -> int:
        if self.settings.memory_limit:
            return self.settings.memory_limit
        bounds = grid_shape(layout)
        costs = job.costs
        # Room for micro-batches in flight: the device less what a stage holds with none (its state, autocast's
        # weight copy, a checkpointed stage's recomputation).
        fits = min(
            int((job.device_memory_bytes - costs.stage_memory(a, b, 0)) // max(1.0, costs.activation_bytes(a, b)))
            for a, b in bounds
        )
        return max(1, min(fits, 2 * len(bounds)))

    def _join(self, layout: Plan, alive: Collection[int], change: Change, job: Job) -> Outcome:
        joined = [w for n in sorted(change.joined_nodes) for w in job.workers_of_node.get(n, ())]
        # A node that comes back under its old id finds its workers' slots: they hold nothing now, so they are holes
        # too, each taken back by its own worker first.
        holes = [(p, s) for p, s, st in layout.stages() if st.worker not in alive or st.worker in joined]
        if not holes:
            return Keep(f"{change.describe()}: no failed role to take, so they wait")
        slots = [[st.worker for st in pipeline.stages] for pipeline in layout.pipelines]
        returning = [(p, s) for p, s in holes if slots[p][s] in joined]
        newcomers = [w for w in joined if w not in {slots[p][s] for p, s in returning}]
        filling = [((p, s), slots[p][s]) for p, s in returning]
        filling += list(zip([h for h in holes if h not in returning], newcomers))
        bounds = grid_shape(layout)
        transfers: list[LayerTransfer] = []
        for (p, s), worker in filling:
            slots[p][s] = worker
            for layer in range(*bounds[s]):
                holders = [w for w, layers in sorted(change.holdings.items()) if layer in layers]
                transfers.append(LayerTransfer(layer, holders[len(transfers) % len(holders)], worker))
        filled = _with_slots(layout, slots)
        taken = [worker for _, worker in filling]
        why = f"{change.describe()}: workers {taken} take back failed roles"
        return self._reroute(filled, set(alive) | set(taken), job, why, tuple(transfers))

    def _restart(self, change: Change, job: Job, protection: Protection, lost: list[int]) -> Outcome:
        layout = self._layout_of(change.plan)
        assert layout is not None
        bounds = grid_shape(layout)
        stages = ", ".join(f"stage {s} (layers {bounds[s][0]}..{bounds[s][1] - 1})" for s in lost)
        why = f"{change.describe()}: every worker of {stages} failed, so no data-parallel peer is left to reroute to"
        source: Source | None = protection.restore_source(change)
        if source is None and not protection.keeps_state:
            return Stop(
                f"ReCycle cannot recover: {why}, and protection={protection.name} keeps no saved state to restart "
                f"from (add protection=storage to restart from a checkpoint instead)"
            )
        try:
            plan, where = restart_grid(job, change.generation, source)
        except PlanError as exc:
            return Stop(f"ReCycle cannot recover: {why}, and no grid fits the live nodes: {exc}")
        reason = f"{why}; restart {len(plan.workers)} workers from {where}"
        return self._fault_free(plan, job, reason, restart=True, restore=source)

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _fault_free(self, layout: Plan, job: Job, reason: str, **kwargs: Any) -> Decision:
        self._layouts[layout.generation] = self._proposed[layout.generation] = layout
        programs, predicted, method = self._fault_free_schedule(layout, job)
        details = {"predicted_iter_s": predicted, "method": method}
        return Decision(layout, self._finish(programs), reason=reason, details=details, predicted_iter_s=predicted,
                        **kwargs)  # fmt: skip

    def _fault_free_schedule(self, layout: Plan, job: Job) -> FaultFreeSchedule:
        """The grid's programs, their predicted iteration and their scheduler: the planner's schedule of the grid
        with no dead slot (no reroute, so every backward is one pass), or DeepSpeed's 1F1B where that is predicted
        faster. A rerouted plan is scheduled by the same planner, so a failure is charged what it costs and never
        credited with a better schedule than the fault-free plan had (``runtime.sim.fault_free``)."""
        key = _pattern(layout, frozenset())
        if key not in self._fault_free_schedules:
            scheduled, method = self._pipelines_scheduled(layout, job)
            planned = self._predict(layout, scheduled, job)
            deepspeed = one_f_one_b(layout)
            one_f_one_b_s = self._predict(layout, deepspeed, job)
            self._fault_free_schedules[key] = (
                (deepspeed, one_f_one_b_s, "1f1b") if one_f_one_b_s <= planned else (scheduled, planned, method)
            )
        return self._fault_free_schedules[key]

    def _pipelines_scheduled(self, layout: Plan, job: Job) -> tuple[dict[int, ins.Program], str]:
        """The planner's programs for ``layout`` with no dead slot, and the scheduler that made them. Without a
        reroute the pipelines share nothing before the gradient reduction, so the planner schedules the first
        pipeline of each length alone and the others of that length run its programs under their own workers and
        micro-batches: one pipeline's problem instead of the grid's, whose size grows with the workers."""
        by_length: dict[int, tuple[Pipeline, ReCyclePlan]] = {}
        programs: dict[int, ins.Program] = {}
        for pipeline in layout.pipelines:
            count = len(pipeline.microbatches)
            if count not in by_length:
                alone = Pipeline(pipeline.stages, tuple(range(count)))
                one = dataclasses.replace(layout, pipelines=(alone,), global_batch=count * layout.micro_batch)
                by_length[count] = pipeline, self._scheduled(one, frozenset(), job)[1]
            first, scheduled = by_length[count]
            workers = dict(zip(first.workers, pipeline.workers))
            programs.update(_renamed(scheduled.programs, workers, pipeline.microbatches))
        methods = {scheduled.method for _, scheduled in by_length.values()}
        return programs, "milp" if "milp" in methods else "heuristic"

    def _finish(self, programs: Mapping[int, ins.Program]) -> dict[int, ins.Program]:
        """The programs with the optimizer step this policy's settings ask for."""
        if not self.settings.staggered_optimizer:
            return dict(programs)
        return {w: [*p[:-1], ins.OptimizerStep(early=True)] for w, p in programs.items()}

    @staticmethod
    def _predict(plan: Plan, programs: Mapping[int, ins.Program], job: Job) -> float:
        """One iteration on the cost model, gradient reduction and optimizer step included."""
        return simulate(programs, job.costs.durations(plan), plan)


def _pattern(layout: Plan, dead: frozenset[int]) -> PatternKey:
    """A failure pattern: the layout's pipelines (workers and micro-batches) and its dead slots."""
    return tuple((p.workers, p.microbatches) for p in layout.pipelines), dead


def _renamed(
    programs: Mapping[int, ins.Program], workers: Mapping[int, int], microbatches: Sequence[int]
) -> dict[int, ins.Program]:
    """One pipeline's ``programs`` run by another: each worker and peer ``w`` becomes ``workers[w]`` and
    micro-batch ``k`` becomes ``microbatches[k]``."""

    def renamed(instruction: ins.Instruction) -> ins.Instruction:
        fields = dict(vars(instruction))  # not dataclasses.replace: a thousand workers' programs are a million calls
        if "microbatch" not in fields and "peer" not in fields:
            return instruction
        if "microbatch" in fields:
            fields["microbatch"] = microbatches[fields["microbatch"]]
        if "peer" in fields:
            fields["peer"] = workers[fields["peer"]]
        return type(instruction)(**fields)

    return {workers[w]: [renamed(i) for i in program] for w, program in programs.items()}


def _decoupled(programs: Mapping[int, ins.Program]) -> int:
    """Weight gradients the programs defer (decoupled backward)."""
    return sum(isinstance(i, ins.BackwardWeight) for p in programs.values() for i in p)


def _lost_stages(layout: Plan, alive: Collection[int]) -> list[int]:
    stages = len(layout.pipelines[0].stages)
    return [s for s in range(stages) if not any(p.stages[s].worker in alive for p in layout.pipelines)]


def _rerouted(layout: Plan, plan: Plan, dead: Collection[int]) -> dict[int, int]:
    """Per peer, how many micro-batch stages it runs for dead workers."""
    own = {(mb, s): st.worker for p in layout.pipelines for mb in p.microbatches for s, st in enumerate(p.stages)}
    extra: dict[int, int] = {}
    for p in plan.pipelines:
        for mb in p.microbatches:
            for s, st in enumerate(p.stages):
                if own[(mb, s)] in dead:
                    extra[st.worker] = extra.get(st.worker, 0) + 1
    return dict(sorted(extra.items()))


def _with_slots(layout: Plan, slots: list[list[int]]) -> Plan:
    pipelines = tuple(
        Pipeline(tuple(Stage(w, st.start, st.stop) for w, st in zip(row, pipeline.stages)), pipeline.microbatches)
        for row, pipeline in zip(slots, layout.pipelines)
    )
    return dataclasses.replace(layout, pipelines=pipelines)
