"""Varuna (Athlur et al., EuroSys'22) as Oobleck's paper runs it (Sections 2, 7.2, 7.4): checkpoint-restart with job
morphing.

After every membership change, a failure or a join, every worker process is ended, fresh ones start on every live
node, and the job resumes from the protection's newest saved state (the steps since are recomputed; the data order
is a function of (seed, step) and every layout computes the same gradient, so the losses repeat the fault-free
run's). Before each start Varuna morphs: over all live workers it weighs every pipeline depth and micro-batch size,
with as many pipelines as the workers fill and the micro-batches feed, and takes the configuration the job's machine
predicts the fastest (``Machine.step_s``; the global batch fixed). Unlike ``checkpoint_restart``, which keeps
``train.stages``, no node idles that a configuration could use.

Where the papers leave it open, this module chooses:

- **Partitioning**: Varuna's partitioner balances the stages by profiled compute (``morph.balanced_split``, on the
  machine's profile): the blocks are uniform, but an embedding is cheap and a language model's head costs several
  blocks, so an even split by layer count would leave the last stage the slowest.
- **Micro-batch sizes**: the divisors of the global batch up to ``train.micro_batch``. The machine's costs are
  profiled at ``train.micro_batch``; a smaller micro-batch is charged that size's cost per micro-batch, a
  pessimistic prediction, so it wins only where it lets more pipelines run or a shallower pipeline fit memory. A
  larger one was never profiled and is not considered.
- **Memory**: a configuration must fit a device by the preflight check's formula (``stage_footprint``), on its
  balanced split.
- **Protection**: only configurations the protection can protect are weighed (``Protection.check_plan``: REFT keeps
  each shard on another holder of the same layers, so every stage needs two replicas), the fastest of all where it
  can protect none: on a host where one deep pipeline is fastest, ``protection=reft`` still gets a plan it protects.
- **Joins**: Varuna restarts to take a join in at once (it morphs on every change), where ``checkpoint_restart``
  lets a joined node wait for the next failure.
- **Checkpoints**: the protection's (``protection=storage``: every ``every`` steps or ``every_s`` seconds);
  Oobleck's evaluation checkpoints Varuna every 10 iterations.
- **Preemption warnings**: Varuna checkpoints the committed step as the warning comes, giving up the iteration in
  flight (``heeds_warnings_at_once``; ``policies.warnings``), and restarts from it when the kill comes, if the
  checkpoint completed within the grace period. Oobleck's paper has Varuna checkpoint ahead of preemptions on its
  spot traces (its Appendix C); waiting for the iteration boundary would miss the grace period whenever an
  iteration outlasts it.
"""

from __future__ import annotations

from ftlab.policies.warnings import checkpoint_now
from ftlab.policies.grid import decision
from ftlab.policies.varuna.morph import Morph, morph
from ftlab.runtime.core.contract import (
    Change, ConfigError, Decision, Heed, Job, Outcome, Policy, PreemptionWarning, Protection, Roles, Source, Stop,
)  # fmt: skip
from ftlab.runtime.core.plan import PlanError


class Varuna(Policy):
    roles = Roles(restarts=True)
    heeds_warnings_at_once = True  # it checkpoints when warned: mid-iteration, not after the kill
    plans_own_depth = True  # it morphs to the fastest depth

    def check(self, protection: Protection) -> None:
        if not protection.keeps_state:
            raise ConfigError(
                "policy=varuna restarts from saved state after every change, and protection=none saves none: add "
                "protection=storage (periodic checkpoints to storage) or protection=reft (snapshots in host memory)"
            )

    def plan(self, job: Job, protection: Protection) -> Decision:
        best, weighed = morph(job.workers, job, protection, generation=0, step=job.start_step)
        return self._decision(best, weighed, "morphed over every worker", restore=job.start)

    def on_warning(self, warning: PreemptionWarning, job: Job, protection: Protection) -> Heed:
        return checkpoint_now(warning, job, protection)

    def on_change(self, change: Change, job: Job, protection: Protection) -> Outcome:
        source: Source | None = protection.restore_source(change)
        try:
            best, weighed = morph(job.slots, job, protection, change.generation, source.step if source else 0)
        except PlanError as exc:
            return Stop(f"{change.describe()}: {exc}")
        where = f"{source.kind} of step {source.step}" if source else "scratch (nothing saved yet)"
        reason = f"{change.describe()}: restart {len(best.plan.workers)} of {len(job.slots)} workers from {where}"
        return self._decision(best, weighed, reason, restore=source, restart=True)

    @staticmethod
    def _decision(best: Morph, weighed: list[Morph], why: str, restore: Source | None, restart: bool = False) -> Decision:
        reason = (f"{why}: {best.pipelines} pipelines of {best.stages} stages, micro-batch {best.micro_batch} "
                  f"(predicted {best.samples_per_s:.1f} samples/s, best of {len(weighed)})")  # fmt: skip
        d = decision(best.plan, reason, restore=restore, restart=restart, stages=best.stages,
                     pipelines=best.pipelines, micro_batch=best.micro_batch)  # fmt: skip
        return Decision(d.plan, d.programs, restart=restart, restore=restore, reason=reason, details=d.details,
                        predicted_iter_s=best.step_s)  # fmt: skip
