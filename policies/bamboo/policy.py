"""Bamboo (Thorpe et al., NSDI'23) as Oobleck's paper summarises it (Sections 2, 7.2, 7.4): redundant computation.

Each stage's worker keeps a copy of the next stage of its pipeline (twice the model state on a device), runs that
stage's forward of every micro-batch redundantly (eager forward redundant computation), and when the next stage's
worker fails, takes its stage over in place: no process restarts, nothing is restored from storage, no committed
step is lost, and the pipeline runs one stage shorter. Two adjacent failures (a stage and the one keeping its copy)
force a full reconfiguration: every worker restarts from the protection's newest saved state.

Where the papers leave it open, this module chooses:

- **Keeping the copy current**: after ``ReduceGrads`` the owner of a stage sends its reduced gradients to the
  holder of its copy (``SendReduced``/``RecvReduced``), and the holder steps the copy with them at the commit, as
  it steps its own layers. The copy is then bit for bit the owner's layers with their optimizer state at every
  committed step (the same optimizer on the same gradient), so a takeover is exact, and an aborted iteration steps
  neither. The copies are made by copying each stage's layers with their optimizer state to its holder in
  place at the first step boundary of a plan without copies (the first plan, a restart's): from then on they are
  kept, not copied again.
- **Forward redundant computation**: the holder runs the owner's forward on the activation it sends the owner,
  placed at its next wait (a receive, or its ``ReduceGrads``), where 1F1B has a bubble if it has one; its output is
  dropped (Bamboo keeps it for a backward redundant computation after a failure mid-iteration; here the two-phase
  commit aborts that iteration, and the takeover's first iteration runs both stages' forward and backward, which is
  the backward redundant computation it needs).
- **The first stage**: Bamboo's ring wraps around (its last node keeps the first stage). A worker here runs one
  contiguous range of layers, so the wrap-around copy is kept where taking it over stays contiguous, in a pipeline of
  two stages (the second keeps the first); in a deeper pipeline losing a first stage means a restart, as losing a
  stage and the one keeping its copy does. The holder of a first stage's copy has no input tokens and runs no
  redundant forward for it. A job where a stage and its copy do not fit a device (no activation checkpointing) is
  refused before any worker starts.
- **What it costs** (what the runtime does, so what the simulator charges): the redundant forward runs on the
  holder's device in line with its own work, so it is free only where 1F1B leaves the holder idle; the holder reports
  ready once the owner's reduced gradients (fp32, the copy's size) have arrived, and its optimizer step at the commit
  steps the copy too (``runtime.sim.timing``). Memory (``redundancy.memory_with_copy``, one formula for the preflight
  and a takeover): the stage with no activation checkpointing, plus the copy's weights, gradients and AdamW state
  and, under autocast, its weights' half-precision cast; the redundant forward runs without autograd and keeps no
  activations (Bamboo keeps them for its lazy backward redundant computation). Activations are counted as
  ``runtime.core.model_spec`` counts them for the model's attention (``model.attention``): with unfused attention
  each block also keeps a sequence-by-sequence matrix per head and micro-batch, which without activation
  checkpointing puts GPT-3 6.7B at 8 stages out of Bamboo's reach on A100-80GB, as in ReCycle's evaluation.
- **After a takeover** the grown stage and the stage after it have no copy (their holder is the grown worker, or
  lost); a failure of either restarts. Copies are not rebuilt until a restart, which rebuilds them all.
- **Joins** wait for the next restart, as in checkpoint-restart (Bamboo's own scheduler adds nodes to pipelines;
  the papers' comparisons measure failures).
- **Protection**: a restart restores the protection's newest state; with ``protection=none`` a restart is
  impossible and the job stops where a takeover cannot recover.
"""

from __future__ import annotations

from ftlab.policies.bamboo import redundancy as rc
from ftlab.policies.grid import decision, grid, restart
from ftlab.runtime.core.contract import (
    Change, ConfigError, Decision, Job, Keep, Outcome, Policy, Protection, Roles, Stop,
)  # fmt: skip
from ftlab.runtime.core.plan import Plan


class Bamboo(Policy):
    roles = Roles(in_place=True, restarts=True, state_copies=2)
    moves_layers = True  # the copies are made by copying layers with their optimizer state

    @property
    def review_every(self) -> int:
        return 1  # a plan without copies gets them at its first step boundary

    def plan(self, job: Job, protection: Protection) -> Decision:
        t = job.train
        if len(job.slots_of_node) < 2:
            raise ConfigError("policy=bamboo keeps each stage's copy on another worker and takes a failed node's stage "
                              "over from a surviving one: it needs at least two nodes (raise cluster.nodes)")  # fmt: skip
        if t.stages < 2:
            raise ConfigError(f"policy=bamboo keeps a copy of each stage's successor, and train.stages={t.stages} has "
                              f"none: set train.stages to 2 or more")  # fmt: skip
        if t.activation_checkpointing:
            raise ConfigError("policy=bamboo does not use activation checkpointing (its memory model keeps every "
                              "stage's activations and the successor's state): set train.activation_checkpointing=false")  # fmt: skip
        plan = grid(job.workers, job, generation=0, step=job.start_step)
        ranges = plan.layer_ranges()
        for copy, in_flight in rc.ring_copies(plan):
            need = rc.memory_with_copy(job, ranges[copy.holder], in_flight, copy)
            if need > job.device_memory_bytes:
                held, kept = ranges[copy.holder], (copy.start, copy.stop)
                raise ConfigError(
                    f"policy=bamboo keeps each stage's state and a neighbour's (twice the model state): worker "
                    f"{copy.holder} with layers {held[0]}..{held[1] - 1} and its copy of layers {kept[0]}..{kept[1] - 1} "
                    f"of {job.model.name} needs {need / 2**30:.3f} GiB where a device has "
                    f"{job.device_memory_bytes / 2**30:.3f} GiB: raise cluster.device_memory_gb, raise train.stages "
                    f"(smaller stages), or use a policy without redundant copies (oobleck, recycle, checkpoint_restart)"
                )
        return decision(plan, "the PP x DP grid of train.stages; copies at the first step boundary", restore=job.start)

    def review(self, change: Change, job: Job, protection: Protection) -> Decision | Keep:
        if rc.copies_of(change.plan) is not None:
            return Keep("every copy this plan can keep is kept")
        copies = rc.fitting_copies(change.plan, job)
        plan = rc.with_copies(change.plan, copies, change.generation, change.step)
        reason = f"{change.describe()}: {len(copies)} stages' layers copied to the neighbours keeping them"
        return Decision(plan, rc.programs(plan, copies), transfers=rc.transfers(copies), reason=reason,
                        details={"copies": len(copies)})  # fmt: skip

    def on_change(self, change: Change, job: Job, protection: Protection) -> Outcome:
        if not change.is_failure:
            return Keep(f"{change.describe()}; they join at the next restart")
        lost = set(change.plan.workers) - set(job.workers)
        copies = rc.copies_of(change.plan) or {}
        plan = rc.taken_over(change.plan, lost, copies, change.generation, change.step)
        if plan is not None and self._fits(plan, job):
            kept = rc.copies_of(plan) or {}
            holders = sorted(copies[w].holder for w in lost)
            reason = f"{change.describe()}: workers {holders} take the failed stages over from their copies"
            return Decision(plan, rc.programs(plan, kept.values()), reason=reason,
                            details={"taken_over": len(lost), "copies": len(kept)})  # fmt: skip
        return self._restart(change, job, protection)

    @staticmethod
    def _fits(plan: Plan, job: Job) -> bool:
        """Every stage of ``plan``, grown ones too, with the copy it keeps, fits its device."""
        copies = {k.holder: k for k in (rc.copies_of(plan) or {}).values()}
        return all(
            rc.memory_with_copy(job, (stage.start, stage.stop), len(pipeline.stages) - s, copies.get(stage.worker))
            <= job.device_memory_bytes
            for pipeline in plan.pipelines
            for s, stage in enumerate(pipeline.stages)
        )

    def _restart(self, change: Change, job: Job, protection: Protection) -> Outcome:
        """Restart from the protection's newest state; from scratch where it keeps state but has saved none yet (as
        checkpoint-restart does: the steps lost are fewer than its interval), never where it keeps none."""
        source = protection.restore_source(change)
        if source is None and change.step > 0 and not protection.keeps_state:
            return Stop(f"{change.describe()}: no live worker keeps a copy of every failed stage, and "
                        f"protection={protection.name} keeps no saved state to restart from")  # fmt: skip
        return restart(job, change.generation, source, f"{change.describe()}: a failed stage has no live copy")
