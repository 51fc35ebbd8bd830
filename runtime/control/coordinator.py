"""The coordinator's protocol: plan, configure, run steps, commit, and recover when membership changes.

One iteration is a two-phase commit. Every worker of the plan runs its program up to the optimizer step and reports
ready with its gradients reduced; only when all have does the coordinator commit, and the workers step their
optimizers. A failure before that point aborts the iteration everywhere, so no two replicas of a layer are ever at
different steps and a failure costs at most the iteration in flight.

The loop carries out one ``Decision`` at a time: the policy's first plan, then whatever it answers to a failure, a
join, or a review of the running plan (after every ``policy.review_every`` committed steps of it, for a policy that
reviews: a switch without a failure, carried out as a join's answer is). A failure while a decision is carried out
(a node lost during a restart or a layer copy) is recovered from in turn, from the last plan every worker was
configured for. What the machines do is the backend's business (``runtime.control.backend``); what happened is published
as events (``runtime.control.events``).

The update itself (the global gradient norm, clipping, fp16's loss scale) is decided between Ready and Commit by the
job's ``UpdateRule`` (``runtime.control.update``) and travels in the Commit, so it is part of the two-phase commit:
a decision that resumes from a committed step rewinds the rule to that step.

Preemption warnings are heard at the next iteration boundary, or at once by a policy that says so
(``Policy.heeds_warnings_at_once``: it saves when warned, and the boundary may come after the kill): the iteration
in flight is then given up, the saves made, and the same plan goes on in a new generation.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import NoReturn

from ftlab.runtime.control import events as ev
from ftlab.runtime.control.backend import Backend, Failure, Interrupted, Membership
from ftlab.runtime.control.update import StepNumerics, UpdateRule, UpdateStopped
from ftlab.runtime.core.contract import (
    Action, Change, Decision, Job, Keep, Outcome, Policy, PreemptionWarning, Protection, SaveCheckpoint, Stop,
)  # fmt: skip
from ftlab.runtime.core.instructions import Program
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.core.scheduler import transfer_programs


class JobStopped(RuntimeError):
    """The job cannot go on: the policy decided to stop. The message says why and how to resume."""


class Coordinator:
    def __init__(
        self,
        backend: Backend,
        policy: Policy,
        protection: Protection,
        make_job: Callable[[Membership], Job],
        bus: ev.EventBus,
        steps: int,
        stop_directory: str,
        update_rule: UpdateRule | None = None,
    ) -> None:
        self.backend = backend
        self.policy = policy
        self.protection = protection
        self.make_job = make_job
        self.bus = bus
        self.steps = steps
        self.stop_directory = stop_directory
        """Where the survivors save the last committed step when the policy stops the job."""
        self.confirmed: Plan | None = None
        """The last plan every worker was configured for: what a recovery starts from."""
        self.tried = -1
        """The newest generation any plan was tried with."""
        self._change: Change | None = None
        """The change the current decision answers (asked again if its restore source cannot be loaded)."""
        self.update_rule = update_rule
        """None: every update as the gradients are (no clipping, no loss scale), and nothing to report."""
        self._warned: list[ev.PreemptionWarned] = []
        """Preemption notices the policy has not seen yet (the injector's thread adds them)."""
        self._warned_lock = threading.Lock()
        self._programs: Mapping[int, Program] = {}
        """The confirmed plan's programs: what it runs again in a new generation (``_heed_at_once``)."""
        bus.subscribe(self._on_warning)

    def _on_warning(self, event: ev.Event) -> None:
        if isinstance(event, ev.PreemptionWarned):
            with self._warned_lock:
                self._warned.append(event)

    def job(self) -> Job:
        return self.make_job(self.backend.membership())

    def run(self, first: Decision) -> None:
        """Train until ``steps`` steps are committed."""
        # Each decision's plan starts at the step training goes on from; no other record of it is kept, so one
        # replaced below (a refused restore source makes the policy answer again) brings its own.
        decision: Decision | None = first
        while decision is not None:
            loadable = self._loadable(decision)
            if isinstance(loadable, Failure):
                decision = self._recover(loadable, self.confirmed or decision.plan, decision.plan.step)
                continue
            decision = loadable
            if self.update_rule is not None:
                self.update_rule.rewind(decision.plan.step)
            failure = self._carry_out(decision)
            if failure:
                decision = self._recover(failure, decision.plan, decision.plan.step)
            else:
                decision = self._train(decision.plan)

    # -- carrying out a decision -----------------------------------------------------------------------------------
    def _carry_out(self, decision: Decision) -> Failure | None:
        assert decision.plan.generation > self.tried, f"generation {decision.plan.generation} was used before"
        self.tried = decision.plan.generation
        if decision.restart:
            failure = self.backend.restart_workers()
            if failure:
                return failure
        plan = decision.plan
        report = self.backend.configure(plan, decision.programs, transfer_programs(decision.transfers), decision.restore)
        if isinstance(report, Failure):
            return report
        if decision.transfers:
            self._publish(ev.LayersCopied, copies=len(decision.transfers), nbytes=report.received_bytes,
                          generation=plan.generation)  # fmt: skip
        restore = decision.restore
        if restore is not None:
            self._publish(ev.StateRestored, step=restore.step, source=report.restored_from or restore.kind,
                          reason=restore.reason, seconds=report.restore_s, nbytes=report.restored_bytes,
                          generation=plan.generation)  # fmt: skip
        self.confirmed = plan
        self._programs = decision.programs
        self._publish(ev.PlanConfigured, generation=plan.generation, step=plan.step,
                      pipelines=len(plan.pipelines), plan=plan)  # fmt: skip
        return None

    # -- training ------------------------------------------------------------------------------------------------
    def _train(self, plan: Plan) -> Decision | None:
        """Run steps of the configured ``plan`` from its first until the job is done (no decision), or a failure or a
        join asks for a new decision. Each committed step is reported while the workers compute the next one."""
        step = plan.step
        unreported: ev.StepCommitted | None = None
        writers: dict[int, tuple[int, ...]] | None = None  # found at the first save, then kept: the plan is fixed here
        while step < self.steps:
            switch = self._joins(plan, step)
            if switch is None:
                switch = self._review(plan, step)
            if switch is not None:
                self._report(unreported)
                return switch
            failure = self._heed_warnings(plan, step)
            if failure:
                return self._recover(failure, plan, step)
            self._publish(ev.StepStarting, step=step)
            started = self.backend.clock()
            rule = self.update_rule
            self.backend.begin_step(plan, step, rule.loss_scale(step) if rule else 1.0)
            self._report(unreported)
            unreported = None
            result = self.backend.finish_step(plan, step, self._warned_now)
            if isinstance(result, Failure):
                return self._recover(result, plan, step)
            if isinstance(result, Interrupted):
                return self._heed_at_once(plan, step)
            self._absorb_saves()
            numerics = self._commit(plan, step, result.grad_sq)
            step += 1
            committed_at = self.backend.clock()
            unreported = ev.StepCommitted(
                at=committed_at, step=step - 1, loss=result.loss, iter_s=committed_at - started,
                compute_s=result.compute_s, generation=plan.generation, samples=plan.global_batch,
                alive_nodes=len(self.backend.membership().slots_of_node), pipelines=len(plan.pipelines),
                snapshot_s=result.snapshot_s, numerics=numerics,
            )  # fmt: skip
            for action in self.protection.after_commit(step, plan):
                self._report(unreported)
                unreported = None
                writers = writers or first_holders(plan)
                failure = self._save(step, action, writers, plan.num_layers)
                if failure:
                    return self._recover(failure, plan, step)
        self._report(unreported)
        return None

    def _warned_now(self) -> bool:
        """Whether a preemption was warned that the policy hears as it comes (``Policy.heeds_warnings_at_once``)."""
        return self.policy.heeds_warnings_at_once and bool(self._warned)

    def _heed_at_once(self, plan: Plan, step: int) -> Decision:
        """A warning came during step ``step`` to a policy that hears it at once: give the iteration up (nothing of
        it is committed, so the state to save is the same), carry out the saves the policy asks for, and go on with
        the same plan in a new generation, the abort having ended this one's groups."""
        failure = Failure()
        self.backend.abort(plan, failure, step)  # members that die meanwhile are folded into it
        self._absorb_saves()
        failure = failure or self._heed_warnings(plan, step, given_up=True)
        if failure:
            return self._recover(failure, plan, step)
        again = dataclasses.replace(plan, generation=self.tried + 1, step=step)
        return Decision(again, self._programs, reason=f"step {step} given up to save before a preemption")

    def _heed_warnings(self, plan: Plan, step: int, given_up: bool = False) -> Failure | None:
        """At an iteration boundary (or with the iteration ``given_up`` for them): ask the policy about each
        preemption warned since the last time and carry out the saves it asks for (the kill comes when the warning
        said, whatever they are)."""
        with self._warned_lock:
            warned, self._warned = self._warned, []
        for notice in warned:
            left = max(0.0, notice.at + notice.grace_s - self.backend.clock())
            warning = PreemptionWarning(plan, step, notice.nodes, notice.grace_s, left)
            heed = self.policy.on_warning(warning, self.job(), self.protection)
            self._publish(ev.WarningHeeded, policy=self.policy.name, nodes=notice.nodes, step=step, left_s=left,
                          actions=tuple(type(a).__name__ for a in heed.actions), reason=heed.reason,
                          step_given_up=given_up)  # fmt: skip
            for action in heed.actions:
                failure = self._save(step, action, first_holders(plan), plan.num_layers)
                if failure:
                    return failure
        return None

    def _commit(self, plan: Plan, step: int, grad_sq: dict[tuple[int, int], float] | None) -> StepNumerics | None:
        """Commit ``step`` with the update the rule decides from the workers' gradient norms, and answer what that
        update was (for the step's report); a rule that cannot go on stops the job (after the commit when it is the
        committed step that says so: too many skipped steps)."""
        rule = self.update_rule
        if rule is None:
            self.backend.commit(plan, step)
            return None
        try:
            update = rule.decide(step, grad_sq)
        except UpdateStopped as exc:
            self.backend.abort(plan, Failure(), step)
            self._halt(str(exc))
        self.backend.commit(plan, step, update)
        try:
            return rule.committed(step)
        except UpdateStopped as exc:
            self._halt(str(exc))

    def _halt(self, reason: str) -> NoReturn:
        self._publish(ev.JobStoppedEvent, reason=reason)
        raise JobStopped(reason)

    def _report(self, committed: ev.StepCommitted | None) -> None:
        if committed is not None:
            self.bus.publish(committed)

    def _joins(self, plan: Plan, step: int) -> Decision | None:
        """Offer nodes that joined to the policy, at an iteration boundary; the decision to carry out, if any."""
        nodes = self.backend.joined()
        if not nodes:
            return None
        self._publish(ev.NodesJoined, nodes=tuple(nodes), step=step)
        holdings = _holdings(plan)
        change = Change(plan, step, self.tried + 1, joined_nodes=tuple(nodes), holdings=holdings)
        outcome = self._decide(change)
        if isinstance(outcome, Stop):
            self._stop(outcome, step, holdings)
        return outcome if isinstance(outcome, Decision) else None

    def _review(self, plan: Plan, step: int) -> Decision | None:
        """After every ``policy.review_every`` committed steps of ``plan``, at the step boundary: ask the policy
        whether to leave the plan although nobody failed or joined; the decision to carry out (as a join's), if any."""
        every = self.policy.review_every
        if every <= 0 or step <= plan.step or (step - plan.step) % every:
            return None
        holdings = {w: tuple(range(a, b)) for w, (a, b) in plan.layer_ranges().items()}
        outcome = self.policy.review(Change(plan, step, self.tried + 1, holdings=holdings), self.job(), self.protection)
        if isinstance(outcome, Keep):
            self._publish(ev.Reviewed, policy=self.policy.name, outcome="keep", reason=outcome.reason, step=step,
                          details=dict(outcome.details))  # fmt: skip
            return None
        if outcome.restart or outcome.plan.step != step:
            raise RuntimeError(f"policy {self.policy.name}'s review must go on from step {step} without a restart, "
                               f"not {outcome.kind} from step {outcome.plan.step}: {outcome.reason}")  # fmt: skip
        self._publish(
            ev.Reviewed, policy=self.policy.name, outcome=outcome.kind, reason=outcome.reason, step=step,
            generation=outcome.plan.generation, transfers=len(outcome.transfers), details=dict(outcome.details),
            predicted_pause_s=outcome.predicted_pause_s, predicted_iter_s=outcome.predicted_iter_s,
        )  # fmt: skip
        return outcome

    def _save(self, step: int, action: Action, writers: dict[int, tuple[int, ...]], num_layers: int) -> Failure | None:
        started = self.backend.clock()
        report = self.backend.save(step, action, writers, num_layers, self._manifest(step))
        if isinstance(report, Failure):
            return report
        if report.failed is not None:  # a storage error, not a failed member: training goes on without this save
            self._publish(ev.SaveFailed, step=step, reason=report.failed, location=report.location)
            stop = self.protection.unsaved(action, step, report.failed)
            if stop is not None:
                self._halt(stop)
            return None
        if report.pending:
            return None  # its parts complete later (_absorb_saves)
        self.protection.saved(action, step)
        self._publish(ev.StateSaved, step=step, seconds=self.backend.clock() - started, nbytes=report.nbytes,
                      location=report.location)  # fmt: skip
        return None

    def _absorb_saves(self) -> None:
        """Tell the protection which parts of its asynchronous saves completed."""
        for progress in self.backend.completed_saves():
            if progress.failed is not None:  # as a storage error is: an event, and the protection may stop the job
                self._publish(ev.SaveFailed, step=progress.step, reason=progress.failed, location="memory")
                stop = self.protection.unsaved(progress.action, progress.step, progress.failed)
                if stop is not None:
                    self._halt(stop)
            self.protection.saved(progress.action, progress.step, progress.records)
            if progress.complete:
                self._publish(ev.SnapshotTaken, step=progress.step, copy_s=progress.copy_s, cpu_s=progress.cpu_s,
                              nbytes=progress.nbytes)

    # -- recovery ------------------------------------------------------------------------------------------------
    def _recover(self, failure: Failure, attempted: Plan, step: int) -> Decision:
        """Abort the iteration (or the configuration) in flight and ask the policy what to do.

        ``step`` is where every survivor that holds layers stands. Members that die during the abort are folded into
        this failure; members that die while the answer is carried out are the next failure (``run``).
        """
        self._publish(ev.FailureDetected, nodes=tuple(sorted(failure.nodes)), workers=tuple(sorted(failure.workers)),
                      step=step, noticed_at=failure.noticed_at)  # fmt: skip
        holdings = self.backend.abort(attempted, failure, step)
        self._absorb_saves()  # survivors finish the snapshot they were copying before they acknowledge the abort
        on_live_nodes = {w for ws in self.backend.membership().slots_of_node.values() for w in ws}
        change = Change(
            plan=self.confirmed or attempted,
            step=step,
            generation=self.tried + 1,
            failed_nodes=tuple(sorted(failure.nodes)),
            failed_workers=tuple(sorted(w for w in failure.workers if w in on_live_nodes)),
            holdings=holdings,
        )
        outcome = self._decide(change)
        if isinstance(outcome, Stop):
            self._stop(outcome, step, holdings)
        if isinstance(outcome, Keep):
            raise JobStopped(f"policy {self.policy.name} kept the running plan after a failure: {outcome.reason}")
        return outcome

    def _decide(self, change: Change) -> Outcome:
        self._change = change
        outcome = self.policy.on_change(change, self.job(), self.protection)
        fields = {"policy": self.policy.name, "reason": outcome.reason, "committed_step": change.step}
        if isinstance(outcome, Decision):
            restore = outcome.restore
            self._publish(
                ev.Decided, outcome=outcome.kind, resume_step=outcome.plan.step, generation=outcome.plan.generation,
                transfers=len(outcome.transfers), restore=f"{restore.kind} of step {restore.step}" if restore else None,
                restore_reason=restore.reason if restore else "", details=dict(outcome.details),
                predicted_pause_s=outcome.predicted_pause_s, predicted_iter_s=outcome.predicted_iter_s, **fields,
            )  # fmt: skip
        else:
            details = dict(outcome.details) if isinstance(outcome, Keep) else {}
            self._publish(ev.Decided, outcome=type(outcome).__name__.lower(), details=details, **fields)
        return outcome

    def _loadable(self, decision: Decision) -> Decision | Failure:
        """``decision`` with its restore source verified (narrowed to what is intact), or the policy's answer once
        the protection knows that source cannot be loaded; a Failure if a member died meanwhile."""
        while decision.restore is not None:
            checked = self.backend.verify(decision.restore)
            if isinstance(checked, Failure):
                return checked
            if not isinstance(checked, str):
                return dataclasses.replace(decision, restore=checked)
            source = decision.restore
            self._publish(ev.RestoreRefused, source=f"{source.kind} of step {source.step}", reason=checked)
            self.protection.unusable(source, checked)
            if self._change is None:
                raise JobStopped(f"the saved state to start from ({source.kind} of step {source.step}) cannot be "
                                 f"loaded: {checked}")  # fmt: skip
            change = dataclasses.replace(self._change, generation=self.tried + 1)
            outcome = self._decide(change)
            if isinstance(outcome, Stop):
                self._stop(outcome, change.step, dict(change.holdings))
            if isinstance(outcome, Keep):
                raise JobStopped(f"policy {self.policy.name} kept the running plan after a failure: {outcome.reason}")
            decision = outcome
        return decision

    def _stop(self, stop: Stop, step: int, holdings: dict[int, tuple[int, ...]]) -> None:
        self._halt(stop.reason + self._save_survivors(step, holdings))

    def _save_survivors(self, step: int, holdings: dict[int, tuple[int, ...]]) -> str:
        """Before stopping: a checkpoint of the last committed step from the survivors, if they hold every layer."""
        num_layers = len(self.job().specs)
        writers = first_holders_of(holdings)
        missing = sorted(set(range(num_layers)) - {layer for layers in writers.values() for layer in layers})
        if missing:
            return (f". Layers {missing} have no live replica, so no checkpoint of step {step} could be written"
                    f"{self._newest_checkpoint()}.")  # fmt: skip
        report = self.backend.save(step, SaveCheckpoint(self.stop_directory, keep=0), writers, num_layers,
                                   self._manifest(step))
        if isinstance(report, Failure):
            return f". A further failure stopped the checkpoint of step {step}."
        if report.failed is not None:
            return f". The survivors' checkpoint of step {step} could not be written: {report.failed}."
        return f". The survivors saved step {step} to {report.location}: resume with train.resume_from={report.location}"

    def _newest_checkpoint(self) -> str:
        """Where a job that stops without its survivors' checkpoint resumes from, if the protection has a
        checkpoint on storage."""
        newest = self.protection.newest_on_storage()
        if newest is None:
            return ""
        return f"; the newest checkpoint is step {newest.step}'s: resume with train.resume_from={newest.directory}"

    def _manifest(self, step: int) -> dict[str, object]:
        return self.update_rule.manifest(step) if self.update_rule is not None else {}

    def _publish(self, kind: type[ev.Event], **fields: object) -> None:
        self.bus.publish(kind(at=self.backend.clock(), **fields))


def first_holders_of(holdings: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """One writer per layer: the holder with the smallest worker id."""
    writer: dict[int, int] = {}
    for worker, layers in sorted(holdings.items()):
        for layer in layers:
            writer.setdefault(layer, worker)
    return {w: tuple(sorted(layer for layer, ww in writer.items() if ww == w)) for w in sorted(set(writer.values()))}


def first_holders(plan: Plan) -> dict[int, tuple[int, ...]]:
    return first_holders_of(_holdings(plan))


def _holdings(plan: Plan) -> dict[int, tuple[int, ...]]:
    """Each worker's layers in ``plan``: one tuple per range, shared by its workers (a thousand of them)."""
    layers = {held: tuple(range(*held)) for held in plan.workers_by_range()}
    return {worker: layers[held] for worker, held in plan.layer_ranges().items()}
