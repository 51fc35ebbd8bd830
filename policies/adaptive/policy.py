"""``policy=adaptive``: per membership change, the recovery with the lowest predicted cost (the idea of Odyssey,
2025; it has no public code, so everything below is our choice).

The candidates are the policies that offer themselves as one (``Roles.candidate``), found, never listed or copied
(``offered_candidates``): **reroute** (``ReCycle``: no pause, slower iterations around the dead workers),
**reconfigure** (``Oobleck``: a pause for layer copies, then new pipelines) and **restart** (``CheckpointRestart``:
new processes restored from the protection's newest state, REFT's memory or storage, losing the steps since it),
and any new policy that declares a candidate name. At each change every candidate gives its own answer, and each
answer is costed on the job's machine (``Job.machine``, the one the simulator charges with):

    cost = pause + iteration time x (steps lost and recomputed + steps expected until the next membership change)

- the iteration time is ``Machine.step_s``: the candidate's programs until every worker has reduced, the commit's
  round trip and the slowest optimizer step, as a simulated step costs, and what the protection's snapshot copies
  add to the steps they overlap (``Protection.copies_beside_training``), spread over the steps between snapshots;
- the pause is ``Machine.pause_s``, what the simulator charges for carrying the answer out: detection, the failure
  window and the abort (failures only), on a restart the processes' start, then configuring the plan, and for every
  worker that lacks layers of its stage the layer copies, decoding what it received, building what is new and
  reading what it restores (from storage, or from REFT's memory along the runtime's own load plan);
- the steps until the next change come from the fault schedule's rate (``Job.failure_rate``), else
  ``policy.mtbf_steps``, at most the steps the job has left: at a failure the mean time between failures, later the
  mean residual life given the steps since the last failure (``horizon``: the same for exponential gaps, longer for
  the bursty Weibull ones). A rate in seconds becomes steps at the iteration time of the plan that ran when the
  change came (adaptive's prediction of it; the fastest candidate's if adaptive did not propose it), one horizon
  for every candidate: at each candidate's own iteration time the cost would be pause + iteration x (mean seconds /
  iteration), the iteration time would cancel, and the choice would weigh pauses alone.

The cheapest answer is carried out; ties go to the order reroute, reconfigure, restart, then any other candidate
(``TIE_ORDER``), and a ``Keep``, on a join, before all: it pauses nothing. The choice is a pure function of the change,
the job and the profile: the same failure on the same profile is answered the same way. Every candidate's prediction and
the choice go into the decision's ``details`` (the ``recovery_decision`` event); the chosen answer's pause and iteration
time into ``Decision.predicted_pause_s`` / ``predicted_iter_s``, which tracking logs beside the measured ones.

The candidates keep state between changes (ReCycle the layout of each of its plans, Oobleck the pipelines), and
adaptive carries out only one candidate's plan. Our choice: each candidate remembers the plan it proposed for each
generation, and when ``Change.plan`` (the last confirmed plan) is not that plan, it plans from the running plan
instead of its own: ReCycle takes a grid (a restart's) as its layout and answers ``Stop`` to anything else (Oobleck's
heterogeneous pipelines have no data-parallel peers to reroute to); Oobleck re-instantiates every whole live node
from its templates and copies the layers each GPU lacks from the survivors' holdings; checkpoint-restart keeps no
state. No candidate is told what adaptive chose: the confirmed plan says it. A candidate's ``Stop`` or ``Keep`` on a
failure removes it from that decision; adaptive stops only when every candidate does.

Asking a candidate is not free of side effects on the protection: REFT's ``restore_source`` forgets snapshots the
failure broke, which holds whichever answer is taken.

**Reviews.** After every ``policy.review_every`` committed steps of a plan the coordinator asks ``review``
(``Policy.review``), and adaptive may switch without a failure: it re-costs the running plan (no pause, its predicted
iteration time) against the in-place candidates' answers (``Roles.in_place``: reroute, reconfigure; a pause without the
failure's detection and abort, then their iteration time) over one horizon, the steps expected until the next change at
the running plan's iteration time, and switches to the cheapest when staying costs more by ``REVIEW_MARGIN`` (5%). A
restart is never an option (it would lose steps and restart processes nobody lost), nor is the candidate whose plan runs
(it would propose the same plan). What changes between the failure and a review is the horizon: with bursty failures
(Weibull shape below 1) the longer nothing has failed, the longer nothing is expected to, so a reroute chosen because
the next change was expected soon gives way to a reconfiguration once its pause is repaid over the horizon; with
exponential failures (and ``policy.mtbf_steps``) the horizon only shrinks toward the job's end, and a review keeps what
the failure chose. A review is a pure function of the job, the running plan, the profile, the step and the step of the
last failure; the candidates are asked once per running plan and membership (their answers' costs do not depend on the
step), so a simulated day of reviews costs a lookup each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ftlab.policies import catalog
from ftlab.policies.adaptive.config import TIE_ORDER
from ftlab.policies.adaptive.horizon import steps_until_change
from ftlab.runtime.core.contract import (
    Change, ConfigError, Decision, Job, Keep, Outcome, Policy, Protection, Roles, Stop,
)  # fmt: skip
from ftlab.runtime.core.plan import PlanError

REVIEW_MARGIN = 0.05
"""A review leaves the running plan only when staying is predicted to cost more than switching by over 5%. A
predicted iteration time carries the machine model's error, but most of it is shared by two plans of one job on one
machine (the same constants, the same cost per layer), so their difference is known much better than either; the
margin keeps a review from paying a pause, layer copies and a window in which a failure finds a reconfiguration
half done for a gain the size of the model's error between plans."""
FIRST_PLAN_TIE = 0.01
"""First plans whose predicted iterations differ by less than 1% are a tie, which the earlier candidate in
``policy.candidates`` wins. Often they are the same layout (a grid is also one Oobleck instantiation), and which one
starts must not turn on the last digits of a profile or a constant."""


def offered_candidates() -> dict[str, str]:
    """Candidate name -> the policy that offers itself under it (``Roles.candidate``), every one found, in the order
    that breaks ties (``TIE_ORDER``, then the others by policy name)."""
    offered: dict[str, str] = {}
    for policy, roles in catalog.roles().items():
        name = roles.candidate
        if name is None:
            continue
        if name in offered:
            raise ConfigError(f"policies {offered[name]} and {policy} both offer adaptive the candidate {name!r}: "
                              f"a candidate's name (Roles.candidate) names one policy")  # fmt: skip
        offered[name] = policy
    rank = {name: i for i, name in enumerate(TIE_ORDER)}
    return dict(sorted(offered.items(), key=lambda item: (rank.get(item[0], len(rank)), item[1])))


def build_candidate(policy: str, settings: Any) -> Policy:  # noqa: ANN401 - adaptive's settings
    """``policy`` on its default settings but for those it shares by name with adaptive's (``AdaptiveConfig``)."""
    schema = catalog.component_schemas()["policy"][policy]
    shared = {s: getattr(settings, s) for s in catalog.settings_of("policy", policy) if hasattr(settings, s)}
    return catalog.component_class(schema)(schema(**shared))


@dataclass(frozen=True)
class Prediction:
    """One candidate's answer, costed."""

    candidate: str
    outcome: str
    """reconfigure | replan | restart | keep"""
    pause_s: float
    iter_s: float
    lost_steps: int
    horizon_steps: float
    """Steps expected until the next membership change (at most the job's remaining steps)."""

    @property
    def cost_s(self) -> float:
        return self.pause_s + self.iter_s * (self.lost_steps + self.horizon_steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome, "pause_s": round(self.pause_s, 6), "iter_s": round(self.iter_s, 6),
            "lost_steps": self.lost_steps, "horizon_steps": round(self.horizon_steps, 3),
            "cost_s": round(self.cost_s, 6),
        }  # fmt: skip


Switches = tuple[list[tuple[Prediction, Decision]], dict[str, str]]
"""A review's alternatives: the in-place answers, costed, and the candidates that gave none, with why."""


class Adaptive(Policy):
    roles = Roles(restarts=True, chooses=True)
    """With its default candidates it may restart from saved state; it is no candidate of its own."""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        offered = offered_candidates()
        unknown = [c for c in settings.candidates if c not in offered]
        if unknown:
            raise ConfigError(f"policy.candidates={list(settings.candidates)}: {unknown} unknown; use any of "
                              f"{', '.join(offered)}")  # fmt: skip
        self.explicit = bool(settings.candidates)
        names = [c for c in offered if c in settings.candidates] if self.explicit else list(offered)
        self.candidates: dict[str, Policy] = {name: build_candidate(offered[name], settings) for name in names}
        """The candidates in the order that breaks ties."""
        self.moves_layers = any(c.moves_layers for c in self.candidates.values())  # type: ignore[misc]
        self.excluded: dict[str, str] = {}
        """Candidates that do not apply to this job, and why."""
        self._protection: Protection | None = None
        """The job's protection: its snapshots' copies are part of every plan's iterations."""
        self._iter_s: dict[int, float] = {}
        """The predicted iteration time of every plan adaptive proposed, by generation (a Keep's cost)."""
        self._owner: dict[int, str] = {}
        """The candidate whose plan adaptive proposed, by generation."""
        self._failed_at = 0
        """The step training resumed from after the last failure (the job's start before any): the horizon's origin."""
        self._switches: tuple[tuple[int, tuple[int, ...]], Switches] | None = None
        """The in-place alternatives to the running plan and membership (its generation, the live workers), costed but
        for the horizon: reviews of an unchanged plan ask the candidates once (``review``)."""

    # -- composition -----------------------------------------------------------------------------------------------
    def check(self, protection: Protection) -> None:
        self._protection = protection
        if self.settings.mtbf_steps <= 0:
            raise ConfigError(f"policy.mtbf_steps={self.settings.mtbf_steps}: give a positive number of steps")
        if self.settings.review_every < 0:
            raise ConfigError(f"policy.review_every={self.settings.review_every}: give the committed steps between "
                              f"reviews of the running plan, or 0 to never review it")  # fmt: skip
        for name, candidate in list(self.candidates.items()):
            try:
                candidate.check(protection)
            except ConfigError as exc:
                if self.explicit:
                    raise ConfigError(f"policy=adaptive candidate {name}: {exc}") from exc
                self._exclude(name, str(exc))
        if not self.candidates:
            raise ConfigError(f"policy=adaptive has no candidate left: {self.excluded}")

    def _exclude(self, name: str, why: str) -> None:
        del self.candidates[name]
        self.excluded[name] = why

    # -- the first plan --------------------------------------------------------------------------------------------
    def plan(self, job: Job, protection: Protection) -> Decision:
        """Every candidate's first plan (each needs its own to plan from later); the fastest iteration is run
        (``FIRST_PLAN_TIE``)."""
        options: list[tuple[str, Decision, float]] = []
        for name, candidate in list(self.candidates.items()):
            try:
                decision = candidate.plan(job, protection)
            except PlanError as exc:
                if self.explicit:
                    raise
                self._exclude(name, str(exc))
                continue
            options.append((name, decision, self._iteration_s(decision, job)))
        if not options:
            raise PlanError(f"policy=adaptive: no candidate can plan this job: {self.excluded}")
        fastest = min(s for _, _, s in options)
        name, chosen, iter_s = next(o for o in options if o[2] <= (1 + FIRST_PLAN_TIE) * fastest)  # in their order
        self._iter_s[chosen.plan.generation] = iter_s
        self._owner[chosen.plan.generation] = name
        self._failed_at = job.start_step
        details = {
            "chosen": name,
            "candidates": {n: {"iter_s": round(s, 6)} for n, _, s in options},
            "excluded": dict(self.excluded),
            **chosen.details,
        }
        reason = f"adaptive: {name}'s first plan (predicted iteration {iter_s:.3f} s): {chosen.reason}"
        return replace(chosen, reason=reason, details=details, predicted_iter_s=iter_s)

    # -- changes ---------------------------------------------------------------------------------------------------
    def on_change(self, change: Change, job: Job, protection: Protection) -> Outcome:
        answers: dict[str, Outcome] = {}
        for name, candidate in self.candidates.items():
            try:
                answers[name] = candidate.on_change(change, job, protection)
            except PlanError as exc:  # e.g. no batch split fits its pipelines: this candidate cannot answer
                answers[name] = Stop(str(exc))
        predictions: list[tuple[Prediction, Decision | Keep]] = [
            (self.predict(name, answer, change, job), answer)
            for name, answer in answers.items()
            if isinstance(answer, Decision)
        ]
        if not change.is_failure and change.plan.generation in self._iter_s:
            keep = Keep(f"{change.describe()}: keep the running plan")
            predictions.append((Prediction("keep", "keep", 0.0, self._iter_s[change.plan.generation], 0, 0.0), keep))
        if predictions:
            # One horizon for every candidate: counted in steps at each one's own iteration time, a rate in seconds
            # would cost each pause + iteration x (mean seconds / iteration), and the iteration time would cancel.
            reference = self._iter_s.get(change.plan.generation, min(p.iter_s for p, _ in predictions))
            horizon = self._horizon(change, job, reference)
            predictions = [(replace(p, horizon_steps=horizon), a) for p, a in predictions]
        refused = {
            n: f"{type(a).__name__.lower()}: {a.reason}" for n, a in answers.items() if not isinstance(a, Decision)
        }
        if not predictions:
            stops = [a for a in answers.values() if isinstance(a, Stop)]
            if stops and (change.is_failure or len(stops) == len(answers)):
                why = "; ".join(f"{n}: {r}" for n, r in refused.items())
                return Stop(f"policy=adaptive: no candidate can recover: {why}")
            return Keep("; ".join(f"{n}: {r}" for n, r in refused.items()))
        order = ["keep", *self.candidates]
        best, answer = min(predictions, key=lambda pa: (pa[0].cost_s, order.index(pa[0].candidate)))
        table = {p.candidate: p.to_dict() for p, _ in predictions}
        summary = ", ".join(f"{p.candidate} {p.cost_s:.2f} s" for p, _ in predictions)
        if isinstance(answer, Keep):
            return Keep(f"adaptive chose keep (predicted cost {summary}): {answer.reason}",
                        {"chosen": "keep", "candidates": table, "refused": refused})  # fmt: skip
        self._iter_s[answer.plan.generation] = best.iter_s
        self._owner[answer.plan.generation] = best.candidate
        if change.is_failure:
            self._failed_at = answer.plan.step
        details = {"chosen": best.candidate, "candidates": table, "refused": refused, **answer.details}
        reason = f"adaptive chose {best.candidate} (predicted cost {summary}): {answer.reason}"
        return replace(answer, reason=reason, details=details, predicted_pause_s=best.pause_s,
                       predicted_iter_s=best.iter_s)  # fmt: skip

    # -- reviews ---------------------------------------------------------------------------------------------------
    @property
    def review_every(self) -> int:
        return int(self.settings.review_every)

    def review(self, change: Change, job: Job, protection: Protection) -> Decision | Keep:
        """Leave the running plan for an in-place candidate's when staying is predicted to cost more than switching
        by ``REVIEW_MARGIN``, over the steps expected until the next change at the running plan's iteration time."""
        running = change.plan.generation
        iter_s = self._iter_s.get(running)
        if iter_s is None:
            return Keep(f"adaptive did not propose the running plan (generation {running}): nothing to weigh it by")
        horizon = self._horizon(change, job, iter_s)
        keep = Prediction("keep", "keep", 0.0, iter_s, 0, horizon)
        key = (running, tuple(job.workers))
        if self._switches is None or self._switches[0] != key:
            self._switches = (key, self._switch_options(change, job, protection))
        costed, refused = self._switches[1]
        options = [(replace(p, horizon_steps=horizon), answer) for p, answer in costed]
        table = {p.candidate: p.to_dict() for p in (keep, *(p for p, _ in options))}
        details = {"candidates": table, "refused": refused, "margin": REVIEW_MARGIN,
                   "steps_since_failure": change.step - self._failed_at}  # fmt: skip
        summary = ", ".join(f"{name} {p['cost_s']:.2f} s" for name, p in table.items())
        order = list(self.candidates)
        best = min(options, key=lambda pa: (pa[0].cost_s, order.index(pa[0].candidate)), default=None)
        if best is None or keep.cost_s <= (1 + REVIEW_MARGIN) * best[0].cost_s:
            return Keep(f"adaptive review keeps the running plan (predicted cost {summary})",
                        {"chosen": "keep", **details})  # fmt: skip
        prediction, answer = best
        if answer.plan.step != change.step:  # costed at an earlier review of this plan: the same answer from here
            again = self.candidates[prediction.candidate].on_change(change, job, protection)
            assert isinstance(again, Decision) and again.plan.step == change.step, again
            answer = again
        self._switches = None
        self._iter_s[answer.plan.generation] = prediction.iter_s
        self._owner[answer.plan.generation] = prediction.candidate
        reason = (f"adaptive review leaves the running plan for {prediction.candidate}'s (predicted cost {summary}, "
                  f"margin {REVIEW_MARGIN:.0%}): {answer.reason}")  # fmt: skip
        return replace(answer, reason=reason, details={"chosen": prediction.candidate, **details, **answer.details},
                       predicted_pause_s=prediction.pause_s, predicted_iter_s=prediction.iter_s)  # fmt: skip

    def _switch_options(self, change: Change, job: Job, protection: Protection) -> Switches:
        """The in-place candidates' answers to a review, costed (the horizon is set by the caller), and why the others
        are none. The candidate whose plan runs is not asked (it would propose its plan again); a restart, or any
        answer that loses steps, is no option without a failure."""
        owner = self._owner.get(change.plan.generation)
        options: list[tuple[Prediction, Decision]] = []
        refused: dict[str, str] = {}
        for name, candidate in self.candidates.items():
            if not candidate.roles.in_place or name == owner:
                continue
            try:
                answer = self.candidates[name].on_change(change, job, protection)
            except PlanError as exc:
                refused[name] = f"stop: {exc}"
                continue
            if not isinstance(answer, Decision):
                refused[name] = f"{type(answer).__name__.lower()}: {answer.reason}"
            elif answer.restart or answer.plan.step != change.step:
                refused[name] = f"{answer.kind} from step {answer.plan.step}: not without a failure"
            else:
                options.append((self.predict(name, answer, change, job), answer))
        return options, refused

    # -- predictions -----------------------------------------------------------------------------------------------
    def predict(self, name: str, decision: Decision, change: Change, job: Job) -> Prediction:
        """``decision``'s cost, on the one cost model and the simulator's measured constants, over no horizon yet
        (the caller sets the one it weighs every candidate over)."""
        iter_s = self._iteration_s(decision, job)
        lost = change.step - decision.plan.step
        return Prediction(name, decision.kind, self._pause_s(decision, change, job), iter_s, lost, 0.0)

    def _horizon(self, change: Change, job: Job, iter_s: float) -> float:
        """Steps expected until the next change (``horizon``), at most the steps the job has left."""
        since = 0 if change.is_failure else max(0, change.step - self._failed_at)
        expected = steps_until_change(job.failure_rate, self.settings.mtbf_steps, since, iter_s)
        return max(0.0, min(expected, job.train.steps - change.step))

    def _iteration_s(self, decision: Decision, job: Job) -> float:
        """One step of ``decision.plan`` on the job's machine (as the simulator charges a step), with what the
        protection's snapshot copies add to the steps they overlap, spread over the steps between snapshots."""
        copied, every = self._protection.copies_beside_training(decision.plan, job) if self._protection else ({}, 1)
        return job.machine().step_s(decision.plan, decision.programs, copied, every)

    def _pause_s(self, decision: Decision, change: Change, job: Job) -> float:
        """From the failure's signal (or the join's notice) until training runs on ``decision.plan``, as the
        simulator charges it (``Machine.pause_s``)."""
        return job.machine().pause_s(decision, change, job)
