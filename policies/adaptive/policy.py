"""``policy=adaptive``: per membership change, the recovery with the lowest predicted cost (the idea of Odyssey,
2025; it has no public code, so everything below is our choice).

The candidates are the existing policies, imported, never copied: **reroute** (``ReCycle``: no pause, slower
iterations around the dead workers), **reconfigure** (``Oobleck``: a pause for layer copies, then new pipelines) and
**restart** (``CheckpointRestart``: new processes restored from the protection's newest state, REFT's memory or
storage, losing the steps since it). At each change every candidate gives its own answer, and each answer is
costed on the one cost model:

    cost = pause + iteration time x (steps lost and recomputed + steps expected until the next membership change)

- the iteration time is the simulator's (``runtime.sim_timing.IterationTimer``: the candidate's programs on
  ``CostModel.durations``, i.e. ``program_check.simulate``'s abstract machine, with the shared host's cores and the
  runtime's per-instruction cost when the profile was measured here), plus the commit's round trip and the slowest
  optimizer step, as a simulated step costs;
- the pause is what the simulator charges for carrying the answer out (``runtime.sim_backend``, whose formulas are
  followed with the same measured constants, ``Job.machinery`` = ``conf/sim``): detection, the failure window and
  the abort (failures only), configuring the plan, then on a restart the processes' start (``host_cores`` at a time
  on a shared host), and for every worker that lacks layers of its stage the layer copies (each source's sends one
  after another at the cost model's p2p bandwidth), decoding what it received, building what is new and reading
  what it restores (storage: at the storage's read bandwidth; memory: decoded from the host's /dev/shm at the codec
  bandwidth: a coarser figure than the simulator's, which reads local records at the snapshot copy rate and
  fetches or decodes the rest along REFT's load plan; unifying the two is left to do);
- the steps until the next change come from the fault schedule's rate (``Job.failure_rate.steps_between`` at the
  candidate's iteration time), else ``policy.mtbf_steps``, at most the steps the job has left.

The cheapest answer is carried out; ties go to the order reroute, reconfigure, restart (and a ``Keep``, on a join,
before all: it pauses nothing). The choice is a pure function of the change, the job and the profile: the same
failure on the same profile is answered the same way. Every candidate's prediction and the choice go into the
decision's ``details`` (the ``recovery_decision`` event); the chosen answer's pause and iteration time into
``Decision.predicted_pause_s`` / ``predicted_iter_s``, which tracking logs beside the measured ones.

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

Left for later: switching without a change when the prediction says so (e.g. back from reroute to a reconfigured
plan once the expected time to the next join exceeds the reconfiguration's pause).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ftlab.policies.adaptive.config import CANDIDATES
from ftlab.policies.checkpoint_restart.config import CheckpointRestartConfig
from ftlab.policies.checkpoint_restart.policy import CheckpointRestart
from ftlab.policies.oobleck.config import OobleckConfig
from ftlab.policies.oobleck.policy import Oobleck
from ftlab.policies.recycle.config import ReCycleConfig
from ftlab.policies.recycle.policy import ReCycle
from ftlab.runtime.config import SimConfig
from ftlab.runtime.contract import (
    Change, ConfigError, Decision, Job, Keep, LayerTransfer, MemorySource, Outcome, Policy, Protection, Source,
    StorageSource, Stop,
)  # fmt: skip
from ftlab.runtime.plan import PlanError
from ftlab.runtime.sim_timing import IterationTimer


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


class Adaptive(Policy):
    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        unknown = [c for c in settings.candidates if c not in CANDIDATES]
        if unknown:
            raise ConfigError(f"policy.candidates={list(settings.candidates)}: {unknown} unknown; use any of "
                              f"{', '.join(CANDIDATES)}")  # fmt: skip
        self.explicit = bool(settings.candidates)
        names = [c for c in CANDIDATES if c in settings.candidates] if self.explicit else list(CANDIDATES)
        self.moves_layers = any(name != "restart" for name in names)  # type: ignore[misc]
        built: dict[str, Policy] = {
            "reroute": ReCycle(ReCycleConfig(solver=settings.solver)),
            "reconfigure": Oobleck(OobleckConfig(fault_threshold=settings.fault_threshold)),
            "restart": CheckpointRestart(CheckpointRestartConfig()),
        }
        self.candidates: dict[str, Policy] = {name: built[name] for name in names}
        """The candidates in the order that breaks ties."""
        self.excluded: dict[str, str] = {}
        """Candidates that do not apply to this job, and why."""
        self._timer: IterationTimer | None = None
        self._iter_s: dict[int, float] = {}
        """The predicted iteration time of every plan adaptive proposed, by generation (a Keep's cost)."""

    # -- composition -----------------------------------------------------------------------------------------------
    def check(self, protection: Protection) -> None:
        if self.settings.mtbf_steps <= 0:
            raise ConfigError(f"policy.mtbf_steps={self.settings.mtbf_steps}: give a positive number of steps")
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
        """Every candidate's first plan (each needs its own to plan from later); the fastest iteration is run."""
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
        name, chosen, iter_s = min(options, key=lambda o: (o[2], list(self.candidates).index(o[0])))
        self._iter_s[chosen.plan.generation] = iter_s
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
        predictions: list[tuple[Prediction, Decision | Keep]] = []
        for name, answer in answers.items():
            if isinstance(answer, Decision):
                predictions.append((self.predict(name, answer, change, job), answer))
        if not change.is_failure and change.plan.generation in self._iter_s:
            keep = Keep(f"{change.describe()}: keep the running plan")
            predictions.append((self._keep(change, job), keep))
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
            return Keep(f"adaptive chose keep (predicted cost {summary}): {answer.reason}")
        self._iter_s[answer.plan.generation] = best.iter_s
        details = {"chosen": best.candidate, "candidates": table, "refused": refused, **answer.details}
        reason = f"adaptive chose {best.candidate} (predicted cost {summary}): {answer.reason}"
        return replace(answer, reason=reason, details=details, predicted_pause_s=best.pause_s,
                       predicted_iter_s=best.iter_s)  # fmt: skip

    # -- predictions -----------------------------------------------------------------------------------------------
    def predict(self, name: str, decision: Decision, change: Change, job: Job) -> Prediction:
        """``decision``'s cost, on the one cost model and the simulator's measured constants."""
        iter_s = self._iteration_s(decision, job)
        lost = change.step - decision.plan.step
        return Prediction(name, decision.kind, self._pause_s(decision, change, job), iter_s, lost,
                          self._horizon(change, job, iter_s))  # fmt: skip

    def _keep(self, change: Change, job: Job) -> Prediction:
        iter_s = self._iter_s[change.plan.generation]
        return Prediction("keep", "keep", 0.0, iter_s, 0, self._horizon(change, job, iter_s))

    def _horizon(self, change: Change, job: Job, iter_s: float) -> float:
        rate = job.failure_rate
        expected = rate.steps_between(iter_s) if rate is not None else self.settings.mtbf_steps
        return max(0.0, min(expected, job.train.steps - change.step))

    def _iteration_s(self, decision: Decision, job: Job) -> float:
        """One step of ``decision.plan``: until every worker has reduced, the commit's round trip, the slowest
        optimizer step (as the simulator charges a step)."""
        m = _machinery(job)
        if self._timer is None:
            shared = job.shared_host and m.host_cores > 0
            cores = m.host_cores if shared else None
            instruction_s = m.instruction_s if job.shared_host else 0.0
            self._timer = IterationTimer(job.costs, check=False, cores=cores, instruction_s=instruction_s)  # type: ignore[arg-type]
        timing = self._timer.time(decision.plan, decision.programs)
        return timing.ready_s + m.control_s + timing.optimizer_s

    def _pause_s(self, decision: Decision, change: Change, job: Job) -> float:
        """From the failure's signal (or the join's notice) until training runs on ``decision.plan``."""
        m = _machinery(job)
        costs = job.costs
        codec = m.codec_bytes_per_s if job.shared_host else float("inf")
        build = m.build_bytes_per_s if job.shared_host else float("inf")
        seconds = m.detect_s + m.failure_window_s + m.abort_s if change.is_failure else 0.0
        if decision.restart:
            at_once = len(job.slots) if job.shared_host else job.workers_per_node  # every live node's workers restart
            cores = m.host_cores if job.shared_host and m.host_cores > 0 else at_once
            seconds += m.process_start_s * max(1.0, at_once / cores)
        arrival, received = _arrivals(decision.transfers, costs.transfer_s)
        slowest = 0.0
        restored: dict[int, tuple[int, ...]] = {}
        for worker, (start, stop) in decision.plan.layer_ranges().items():
            held = set() if decision.restart else set(change.holdings.get(worker, ()))
            new = set(range(start, stop)) - held
            if not new:
                continue
            got = received.get(worker, [])
            missing = new - set(got)
            if missing and decision.restore is not None:
                restored[worker] = tuple(sorted(missing))
            decoded = _bytes(costs, got) / codec
            slowest = max(slowest, arrival.get(worker, 0.0) + decoded + _bytes(costs, new) / build)
        reading = _restore_s(decision.restore, restored, costs, m, codec) if restored else 0.0
        return seconds + m.configure_s + slowest + reading


def _machinery(job: Job) -> SimConfig:
    return job.machinery if job.machinery is not None else SimConfig()


def _bytes(costs: Any, layers: Any) -> float:
    return float(sum(costs.state_bytes(layer, layer + 1) for layer in layers))


def _arrivals(transfers: tuple[LayerTransfer, ...], transfer_s: Any) -> tuple[dict[int, float], dict[int, list[int]]]:
    """When each receiver has its layers, and which: a source's sends go out one after another (as the simulator
    charges them), in the order of the decision."""
    busy: dict[int, float] = {}
    arrival: dict[int, float] = {}
    received: dict[int, list[int]] = {}
    for t in transfers:
        busy[t.source] = busy.get(t.source, 0.0) + transfer_s(t.layer)
        arrival[t.destination] = max(arrival.get(t.destination, 0.0), busy[t.source])
        received.setdefault(t.destination, []).append(t.layer)
    return arrival, received


def _restore_s(
    source: Source | None, readers: Mapping[int, tuple[int, ...]], costs: Any, m: SimConfig, codec: float
) -> float:
    per_reader = [_bytes(costs, layers) for layers in readers.values()]
    decode = max(per_reader, default=0.0) / codec
    if isinstance(source, StorageSource):
        return sum(per_reader) / m.storage_read_bytes_per_s + decode
    if isinstance(source, MemorySource):
        return decode
    return 0.0

