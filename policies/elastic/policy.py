"""torchft-style elastic data parallelism on the PP x DP grid of ``train.stages``.

- **A failure** drops every replica (pipeline) that lost a worker; the whole replicas go on in place, each worker
  keeping its stage, layers and optimizer state, with the global batch dealt over them: no restart, no committed
  step lost. The loss is the mean over the global batch in every layout, so training stays on the fault-free curve.
- **Idle workers** (a joined node's, or survivors of dropped replicas) form new replicas of the running layout, as
  many as they fill and the global batch feeds (one micro-batch each). A worker that already holds a stage's layers
  at the committed step takes that stage; every other layer is copied with its optimizer state from a live holder
  (layer transfers, in place). So survivors of two broken replicas that hold complementary stages make a whole one
  with nothing copied.
- **No whole replica** and no set of survivors that holds every layer: every process restarts on the live nodes from
  the protection's newest state (its steps since are recomputed), or, with a protection that saves nothing, the job
  stops with what to change.

The layout never changes while the job runs in place: ``train.stages`` stages of ``even_split`` layers, the running
plan's spans. A restart keeps it where ``train.stages`` workers live; with fewer it restarts on one stage per live
worker, as checkpoint-restart does (a checkpoint holds layers, not a layout, so any layout restores it), and new
replicas then copy that layout until the next restart. A restart whose fewer stages do not fit the devices stops the
job with the stage that does not fit.
"""

from __future__ import annotations

from ftlab.policies.elastic.replicas import Spans, heal, replicas_plan, room
from ftlab.policies.grid import check_fits, decision
from ftlab.runtime.core.contract import (
    Change, Decision, Job, Keep, Outcome, Policy, Protection, Roles, Source, Stop,
)  # fmt: skip
from ftlab.runtime.core.plan import Plan, PlanError, even_split


class Elastic(Policy):
    roles = Roles(in_place=True, restarts=True)
    moves_layers = True  # new replicas are healed by copying layers with their optimizer state

    def plan(self, job: Job, protection: Protection) -> Decision:
        plan = self._grid(job.workers, job, generation=0, step=job.start_step, stages=job.train.stages)
        why = f"{len(plan.pipelines)} replicas of {job.train.stages} stages (train.stages)"
        return decision(plan, why, restore=job.start)

    def on_change(self, change: Change, job: Job, protection: Protection) -> Outcome:
        alive = set(job.workers)
        spans: Spans = change.plan.pipelines[0].spans
        whole = [list(p.workers) for p in change.plan.pipelines if set(p.workers) <= alive]
        # Only the running plan's survivors hold layers at the committed step (an idle worker's are stale or none).
        holdings = {w: frozenset(layers) for w, layers in change.holdings.items() if w in alive and w in change.plan.workers}
        idle = sorted(alive - {w for chain in whole for w in chain})
        count = min(len(idle) // len(spans), room(job) - len(whole))
        healed = heal(idle, spans, count, holdings, whole) if count > 0 else ([], [])
        if healed is None or not (whole or healed[0]):
            return self._restart(change, job, protection)
        chains, transfers = healed
        if not change.is_failure and not chains:
            return Keep(f"{change.describe()}: {len(idle)} idle workers, a replica needs {len(spans)}")
        plan = replicas_plan([*whole, *chains], spans, job, change.generation, change.step)
        dropped = len(change.plan.pipelines) - len(whole)
        reason = (f"{change.describe()}: {len(whole)} whole replicas go on ({dropped} dropped), {len(chains)} new "
                  f"healed with {len(transfers)} layer copies")  # fmt: skip
        d = decision(plan, reason, dropped=dropped, healed=len(chains))
        return Decision(d.plan, d.programs, transfers=tuple(transfers), reason=d.reason, details=d.details)

    def _restart(self, change: Change, job: Job, protection: Protection) -> Outcome:
        if not protection.keeps_state:
            return Stop(
                f"{change.describe()}: no replica is whole and the survivors do not hold every layer; "
                f"protection={protection.name} saves nothing to restart from: add protection=storage or protection=reft"
            )
        source: Source | None = protection.restore_source(change)
        # The restart's promise (Roles.restarts): any live node whose devices hold the model.
        stages = min(job.train.stages, len(job.slots))
        try:
            plan = self._grid(job.slots, job, change.generation, source.step if source else 0, stages)
            check_fits(plan, job)
        except PlanError as exc:
            return Stop(f"{change.describe()}: no replica is whole and no restart fits: {exc}")
        where = f"{source.kind} of step {source.step}" if source else "scratch (nothing saved yet)"
        reason = f"{change.describe()}: no replica is whole; restart {len(plan.pipelines)} replicas from {where}"
        return decision(plan, reason, restore=source, restart=True)

    @staticmethod
    def _grid(workers: list[int], job: Job, generation: int, step: int, stages: int) -> Plan:
        """As many replicas of ``stages`` stages as ``workers`` fill and the global batch feeds."""
        spans = tuple(even_split(len(job.specs), stages))
        count = min(len(workers) // stages, room(job))
        if count < 1:
            raise PlanError(
                f"{len(workers)} live workers cannot form one replica of train.stages={stages} stages: lower "
                f"train.stages to at most {len(workers)} or add nodes"
            )
        chains = [workers[r * stages : (r + 1) * stages] for r in range(count)]
        return replicas_plan(chains, spans, job, generation, step)
