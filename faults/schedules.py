"""Fault schedules: a config, and a pure function that turns it into a reproducible, validated list of fault events.

The injector fires the events; this module only decides what happens, to whom, and when. Every check runs in
``build_schedule``, before any worker starts, and every ``FaultConfigError`` says what to change.

Kinds. ``node`` kills a node's agent and all its workers (its host memory is lost); ``process`` kills one worker;
``hang`` stops one worker (SIGSTOP), for good or, with ``for_s``, for that many seconds (a stall: a long pause, a
frozen link); ``join`` starts a new node. ``process`` and ``hang`` leave the node alive as far as the schedule is
concerned: what becomes of the worker is the policy's business.

Clocks. An event fires when the job reaches a training step (``at_step``, optionally in one ``phase`` of it) or a
number of seconds after training starts (``at_time_s``). Steps and seconds cannot be ordered against each other
before the run, so a schedule uses one clock for all its events.

The generated and trace schedules take their rates in either clock: ``mtbf_steps`` or ``mtbf_s``, ``interval_steps``
or ``interval_s``, ``weibull_scale_steps`` or ``weibull_scale_s``, ``trace_s_per_step`` or ``time_compression``, with
``horizon_*`` and ``replace_after_*`` in the same clock. The shipped configs give rates per step. A rate in seconds
means a different number of faults on every machine and under every load (a default job trains for 10 s on an idle
machine and 40 s on a busy one), so with seconds a shipped MTBF either fires nothing in a default job or kills every
node of a long one; a rate in steps gives the same faults at the same steps everywhere, which is what a sweep over
policies compares. The step clock turns the generated times into steps by flooring: a fault drawn at 7.4 steps
fires as step 7 starts. Seconds stay for what they are good for: replaying a real trace at its own pace, or
measuring a policy against failures that arrive while it is slow.

Reach. Whether a fault fires within the job is checked before the run where the clock allows: an explicit event at or
after ``train.steps`` is an error, a generated or replayed one a warning (the schedule is a distribution; the job is
too short for its tail). Faults still pending when the job ends (time-clocked ones the job did not live to see, or a
phase the job never entered) are reported then, as a warning and an event (``experiments/job.py``).

Nodes. The cluster starts with nodes ``0..N-1``, each with workers ``0..W-1``. A join gets the next index never used
(N, N+1, ...) and W workers: indices are never reused, so an index names one node for the whole run.

Order and survival. Events are sorted by step or time; events of the same instant keep the order the schedule gives
them (the config's, the trace's). Replaying them in that order, every fault must hit a node that exists and is alive,
and at least one node alive before each instant must survive it: no policy can recover a job whose every node died,
and a node joining at the instant the last survivor dies would have no one to take the job's state from. Such a
schedule is rejected.

Schedules (``FaultsConfig.schedule``):

- ``none``: no events.
- ``explicit``: ``events``, as given.
- ``fixed``: a fault at ``interval``, ``2 * interval``, ... (``interval_steps`` or ``interval_s``)
- ``exponential``: gaps between consecutive faults drawn from an exponential distribution of mean ``mtbf_steps`` (or
  ``mtbf_s``): a Poisson process of faults for the whole cluster, not per node, so the rate does not change as nodes
  die.
- ``weibull``: gaps drawn from a Weibull distribution (``weibull_shape``, ``weibull_scale_steps`` or
  ``weibull_scale_s``); a shape below 1 gives bursts of early failures, above 1 wear-out.

  Generated faults are of ``kind`` (node, process or hang). Each picks a node uniformly among the nodes alive at
  that moment, and a worker uniformly, from one ``random.Random(seed)`` stream, so the same config and cluster give
  the same events and another seed other ones. Generation stops after ``max_failures`` faults or at ``horizon_s``,
  whichever comes first; one of them must be set. With ``replace_after``, every node fault is followed that many
  steps (seconds) later by the join of a fresh node (a spot replacement), which later faults may hit in turn;
  replacement joins at or after the horizon are dropped.
- ``trace``: replays a node-availability trace (see ``faults/trace.py`` for the format). Run time 0 is the trace's
  first timestamp; each training step stands for ``trace_s_per_step`` trace seconds, or trace times are divided by
  ``time_compression`` (trace seconds per run second; 1, real time, when neither is set). A trace
  describes a cluster of its own size, usually larger than the run's, so the run replays the lives of some of the
  trace's nodes:

  * cluster nodes ``0..N-1`` stand for the first N trace nodes to appear, or for the trace nodes ``node_map`` names.
    They are up from time 0 even where the trace adds them a little later (g4dn's first nodes arrive over two
    minutes, so its first timestamp holds one node); cluster nodes that stand for no trace node never fail;
  * a trace node present at the first timestamp that the cluster does not stand for is ignored with all its events;
  * a later ``add`` becomes a join while fewer than ``max_nodes`` (default N) nodes are alive, and is otherwise
    ignored with all that node's events: a small cluster refills to its own size as the trace's replacements arrive.
    With N equal to the trace's initial size and ``max_nodes`` at least its peak, the replay is exact;
  * a ``remove`` of a node the cluster stands for is a ``node`` fault. (The synthetic traces remove 15 of their 30
    nodes, few of the first ones: name the nodes to replay in ``node_map`` to see more of their faults.)
  * a cluster larger than the trace (more nodes than it ever holds at once) needs a mapping: ``node_map`` (the
    cluster's other nodes never fail), or ``trace_copies`` k: k copies of the trace replayed side by side, each
    with nodes of its own, so that every node lives the trace's kind of life (the same preemption rate per node).
    Copy j's events after the first timestamp are delayed by j times the trace's mean time between removals over
    k, so the copies' preemptions interleave instead of striking k nodes at once; copies run past the trace's
    end by at most that delay. Without either, a larger cluster is refused rather than left mostly failure-free.
  * ``max_failures`` ends the replay with that fault, ``horizon_steps`` / ``horizon_s`` (run steps or seconds) there.

Warnings. A node fault may carry ``warning_s`` (``faults.warning_s`` gives it to every node fault of a schedule: a spot
trace's grace period): at its firing point the injector gives notice of the preemption, and the node is killed that
many seconds later on the backend's clock, whatever the policy did meanwhile (``Policy.on_warning``, asked at the
next iteration boundary). A warning longer than the gap to the next fault is refused where both are in seconds
(faults at the same instant are warned together).

Settings that the chosen schedule does not use are rejected rather than ignored, so that a sweep over
``faults.mtbf_steps`` under ``faults=fixed`` fails loudly instead of running the same job several times; so are
settings of the other clock (``horizon_s`` with ``mtbf_steps``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ftlab.faults.trace import TraceError, TraceRecord, read_trace
from ftlab.runtime.core.contract import FailureRate

FaultKind = Literal["node", "process", "hang", "join"]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)
GENERATED_KINDS: tuple[str, ...] = ("node", "process", "hang")
WORKER_KINDS: tuple[str, ...] = ("process", "hang")
PHASES: tuple[str, ...] = ("forward", "backward", "reduce", "optimizer", "checkpoint", "transfer", "snapshot")
"""``transfer``: while the target receives layers in an in-place reconfiguration that resumes at step ``at_step``;
``snapshot``: in the middle of copying the in-memory snapshot of ``at_step`` committed steps (``protection=reft``),
after one record's bytes and before its commit record."""
SCHEDULES: tuple[str, ...] = ("none", "explicit", "fixed", "exponential", "weibull", "trace")

# A typo such as horizon_s=1e9 with mtbf_s=1 would otherwise build a list of a billion events before anything runs.
MAX_EVENTS = 100_000


class FaultConfigError(ValueError):
    """A fault schedule that cannot run on the given cluster; the message says what to change."""


@dataclass(frozen=True)
class FaultEvent:
    """One fault to inject. Checks of the event on its own run here; checks against the cluster in build_schedule."""

    kind: str
    """One of FaultKind."""
    node: int
    """Cluster node index; for a join, the index the new node gets."""
    worker: int | None = None
    """Local worker index on that node, for process and hang; None for node and join."""
    at_step: int | None = None
    """Fire when the job reaches this training step (exactly one of at_step and at_time_s is set)."""
    at_time_s: float | None = None
    """Or this many seconds after training starts."""
    phase: str | None = None
    """With at_step: fire while the target is in this phase of that step (one of PHASES)."""
    warning_s: float | None = None
    """A node fault only: a preemption notice at the firing point, the kill this many seconds later (a spot
    instance's grace period), whatever the policy does meanwhile."""
    for_s: float | None = None
    """A hang only: the worker resumes (SIGCONT) this many seconds later. A stall shorter than
    ``cluster.heartbeat_timeout_s`` is never taken for a hang; one longer than ``cluster.comm_timeout_s`` fails the
    operations its peers wait in, with no death to explain it (the backend then fences a failed worker)."""

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise FaultConfigError(f"unknown fault kind {self.kind!r}; use one of {', '.join(FAULT_KINDS)}")
        if self.node < 0:
            raise FaultConfigError(f"node {self.node} is negative; use a cluster node index (0 is the first node)")
        if self.kind in WORKER_KINDS and self.worker is None:
            raise FaultConfigError(f"a {self.kind} fault hits one worker; set worker to its local index on the node")
        if self.kind not in WORKER_KINDS and self.worker is not None:
            raise FaultConfigError(f"a {self.kind} event concerns a whole node; remove worker ({self.worker})")
        if self.worker is not None and self.worker < 0:
            raise FaultConfigError(f"worker {self.worker} is negative; use a local worker index (0 is the first)")
        if (self.at_step is None) == (self.at_time_s is None):
            raise FaultConfigError("set exactly one of at_step (a training step) and at_time_s (seconds of training)")
        if self.at_step is not None and self.at_step < 0:
            raise FaultConfigError(f"at_step {self.at_step} is negative; steps count from 0")
        if self.at_time_s is not None and not (math.isfinite(self.at_time_s) and self.at_time_s >= 0):
            raise FaultConfigError(f"at_time_s {self.at_time_s} must be a finite number of seconds >= 0")
        if self.phase is not None:
            if self.at_step is None:
                raise FaultConfigError(f"phase {self.phase!r} needs at_step; a phase is part of a step, not of a time")
            if self.phase not in PHASES:
                raise FaultConfigError(f"unknown phase {self.phase!r}; use one of {', '.join(PHASES)}")
        if self.warning_s is not None:
            if self.kind != "node":
                raise FaultConfigError(f"warning_s warns of a preemption, which takes a whole node: a {self.kind} "
                                       f"fault has none; remove warning_s or use kind: node")  # fmt: skip
            if not (math.isfinite(self.warning_s) and self.warning_s > 0):
                raise FaultConfigError(f"warning_s {self.warning_s} must be a finite number of seconds > 0")
            if self.phase is not None:
                raise FaultConfigError(f"a warned preemption is killed warning_s={self.warning_s:g} s after its "
                                       f"notice, not in a phase: remove phase {self.phase!r} or warning_s")  # fmt: skip
        if self.for_s is not None:
            if self.kind != "hang":
                raise FaultConfigError(f"for_s is how long a hang lasts: a {self.kind} fault has no duration; remove "
                                       f"for_s or use kind: hang")  # fmt: skip
            if not (math.isfinite(self.for_s) and self.for_s > 0):
                raise FaultConfigError(f"for_s {self.for_s} must be a finite number of seconds > 0")

    @property
    def when(self) -> str:
        """The firing point in words, for messages and logs."""
        if self.at_step is None:
            return f"t={self.at_time_s:g} s"
        return f"step {self.at_step}" + (f" ({self.phase})" if self.phase else "")

    def to_dict(self) -> dict[str, Any]:
        """The event as a JSON object for events.jsonl, without the fields that are not set."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class FaultEventConfig:
    """The structured-config form of one explicit event; the fields mean what FaultEvent's do."""

    kind: str
    node: int
    worker: int | None = None
    at_step: int | None = None
    at_time_s: float | None = None
    phase: str | None = None
    warning_s: float | None = None
    for_s: float | None = None


@dataclass
class FaultsConfig:
    """The schema of the Hydra config group ``faults``; the module docstring says what each schedule does."""

    schedule: str = "none"
    """none | explicit | fixed | exponential | weibull | trace"""
    seed: int = 0
    kind: str = "node"
    """Kind of the generated faults (fixed, exponential, weibull): node, process or hang."""
    events: list[FaultEventConfig] = field(default_factory=list)
    """explicit: the events."""
    interval_steps: float | None = None
    """fixed: training steps between faults (or interval_s: seconds)."""
    interval_s: float | None = None
    mtbf_steps: float | None = None
    """exponential: mean training steps between faults of the cluster (or mtbf_s: seconds)."""
    mtbf_s: float | None = None
    weibull_shape: float | None = None
    weibull_scale_steps: float | None = None
    """weibull: the scale in training steps (or weibull_scale_s: seconds)."""
    weibull_scale_s: float | None = None
    max_failures: int | None = None
    """Generated and trace schedules: stop after this many faults."""
    horizon_steps: float | None = None
    """Generated and trace schedules: events only before this step (horizon_s: this many seconds) of training."""
    horizon_s: float | None = None
    replace_after_steps: float | None = None
    """Generated schedules: each killed node is replaced by a joining node this many steps (replace_after_s:
    seconds) later."""
    replace_after_s: float | None = None
    trace: str | None = None
    """trace: a bundled trace name (p3, g4dn, scale_p3, scale_gcp, 5m, 10m, 30m, 1h, 3h, 6h) or a CSV path."""
    trace_s_per_step: float | None = None
    """trace: trace seconds each training step stands for (120: two trace minutes per step)."""
    time_compression: float | None = None
    """trace, on the seconds clock: trace seconds per run second (600: ten trace minutes per second of training)."""
    node_map: dict[str, int] | None = None
    """trace: trace node name -> cluster node index; default: the first N trace nodes in order of appearance."""
    max_nodes: int | None = None
    """trace: trace adds become joins only while fewer nodes than this are alive; default: the cluster's size."""
    trace_copies: int = 1
    """trace: replay this many copies of the trace side by side (for a cluster larger than the trace)."""
    warning_s: float | None = None
    """Every node fault (a preemption) warned this many seconds ahead: generated and replayed ones, and explicit ones
    that give no warning_s of their own."""


@dataclass(frozen=True)
class ClusterShape:
    """What a schedule needs to know about the cluster."""

    nodes: int
    workers_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.workers_per_node < 1:
            raise ValueError(f"a cluster needs at least 1 node of at least 1 worker, not {self}")


def faults_config_from_dict(d: Mapping[str, Any]) -> FaultsConfig:
    """Validate a plain or OmegaConf mapping against the FaultsConfig schema (unknown keys, wrong types)."""
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FaultsConfig), d))
    except OmegaConfBaseException as e:
        raise FaultConfigError(f"faults config does not fit the FaultsConfig schema; fix this: {e}") from e
    assert isinstance(cfg, FaultsConfig)
    return cfg


def build_schedule(cfg: FaultsConfig | Mapping[str, Any], cluster: ClusterShape) -> list[FaultEvent]:
    """The events of ``cfg`` on ``cluster``, sorted by step or time, checked against the cluster."""
    if not isinstance(cfg, FaultsConfig):
        cfg = faults_config_from_dict(cfg)
    if cfg.schedule not in _BUILDERS:
        raise FaultConfigError(f"unknown fault schedule {cfg.schedule!r}; use one of {', '.join(SCHEDULES)}")
    _reject_unused(cfg)
    events = sorted(_BUILDERS[cfg.schedule](cfg, cluster), key=_clock)  # stable: an instant keeps its order
    if cfg.warning_s is not None:
        if cfg.schedule in _RATES and cfg.schedule != "trace" and cfg.kind != "node":
            raise FaultConfigError(f"faults.warning_s warns of preemptions, which take whole nodes, and the "
                                   f"{cfg.schedule} schedule generates {cfg.kind} faults: set faults.kind=node or "
                                   f"remove faults.warning_s")  # fmt: skip
        events = [_warned(e, cfg.warning_s) for e in events]
    _check_warnings(events)
    if len(events) > MAX_EVENTS:
        raise FaultConfigError(
            f"the {cfg.schedule} schedule holds {len(events)} events, more than {MAX_EVENTS}; "
            "lower horizon_s or set max_failures"
        )
    unit = STEPS if clock_of(cfg) == STEPS else SECONDS
    _check_against_cluster(events, cluster, survival_hint=_SURVIVAL_HINTS[cfg.schedule].format(unit=unit))
    return events


def _warned(event: FaultEvent, warning_s: float) -> FaultEvent:
    """A node fault warned ``warning_s`` ahead unless it gives its own warning; other events as they are."""
    if event.kind != "node" or event.warning_s is not None:
        return event
    try:
        return dataclasses.replace(event, warning_s=warning_s)
    except FaultConfigError as err:
        raise FaultConfigError(f"faults.warning_s: {err}") from err


def _check_warnings(events: list[FaultEvent]) -> None:
    """A warned kill comes before the next fault fires: a grace period longer than the gap would reorder them.
    Faults at the same instant (a spot trace preempts several nodes at once) fire together, warned together. On the
    step clock steps and seconds cannot be compared before the run; there the kill comes when it is due."""
    for event, after in zip(events, events[1:]):
        if event.warning_s is None or event.at_time_s is None or after.at_time_s is None:
            continue
        gap = after.at_time_s - event.at_time_s
        if event.warning_s > gap > 0:
            raise FaultConfigError(
                f"the preemption of node {event.node} at {event.when} is warned {event.warning_s:g} s ahead, longer "
                f"than the {gap:g} s until the next fault ({after.kind} of node {after.node} at {after.when}): lower "
                f"warning_s to at most {gap:g}, or space the faults further apart"
            )


def failure_rate(cfg: FaultsConfig) -> FailureRate | None:
    """The cluster's mean time between failures under a generated schedule, in the clock it runs on; None for the
    schedules that do not say (none, explicit, trace)."""
    mean: tuple[float | None, float | None, float] | None = None
    if cfg.schedule == "fixed":
        mean = cfg.interval_steps, cfg.interval_s, 1.0
    elif cfg.schedule == "exponential":
        mean = cfg.mtbf_steps, cfg.mtbf_s, 1.0
    elif cfg.schedule == "weibull" and cfg.weibull_shape and cfg.weibull_shape > 0:  # else refused by build_schedule
        scale = math.gamma(1 + 1 / cfg.weibull_shape)
        steps, seconds = cfg.weibull_scale_steps, cfg.weibull_scale_s
        mean = steps and steps * scale, seconds and seconds * scale, cfg.weibull_shape
    if mean is None or not (mean[0] or mean[1]):
        return None
    steps, seconds, shape = mean
    return FailureRate(mean_steps=steps or None, mean_s=None if steps else seconds, shape=shape)


def _clock(event: FaultEvent) -> float:
    if event.at_step is not None:
        return event.at_step
    assert event.at_time_s is not None  # FaultEvent guarantees one of the two
    return event.at_time_s


# The settings each schedule reads; schedule and seed are read by all (a seed sweep may span schedules).
_GENERATED = {"kind", "warning_s", "max_failures", "horizon_steps", "horizon_s", "replace_after_steps", "replace_after_s"}
_USES: dict[str, set[str]] = {
    "none": set(),
    "explicit": {"events", "warning_s"},
    "fixed": {"interval_steps", "interval_s"} | _GENERATED,
    "exponential": {"mtbf_steps", "mtbf_s"} | _GENERATED,
    "weibull": {"weibull_shape", "weibull_scale_steps", "weibull_scale_s"} | _GENERATED,
    "trace": {"trace", "trace_s_per_step", "time_compression", "node_map", "max_nodes", "max_failures",
              "horizon_steps", "horizon_s", "trace_copies", "warning_s"},
}  # fmt: skip

# The setting that gives a schedule's rate in each clock: (steps, seconds).
_RATES: dict[str, tuple[str, str]] = {
    "fixed": ("interval_steps", "interval_s"),
    "exponential": ("mtbf_steps", "mtbf_s"),
    "weibull": ("weibull_scale_steps", "weibull_scale_s"),
    "trace": ("trace_s_per_step", "time_compression"),
}
STEPS, SECONDS = "steps", "s"


def clock_of(cfg: FaultsConfig) -> str | None:
    """``steps`` or ``s``: the clock a generated or trace schedule runs on, from the rate it is given (a trace with
    neither rate replays in real time); None for none and explicit, whose events carry their own clock."""
    if cfg.schedule not in _RATES:
        return None
    in_steps, in_seconds = (getattr(cfg, name) is not None for name in _RATES[cfg.schedule])
    if in_steps and in_seconds:
        a, b = _RATES[cfg.schedule]
        raise FaultConfigError(
            f"faults.{a}={getattr(cfg, a)} and faults.{b}={getattr(cfg, b)} are both set; give the {cfg.schedule} "
            f"rate in one clock and the other null (faults.{a}=null to count in seconds)"
        )
    if not in_steps and not in_seconds and cfg.schedule != "trace":
        a, b = _RATES[cfg.schedule]
        raise FaultConfigError(
            f"the {cfg.schedule} schedule needs faults.{a} (or faults.{b}, in seconds); set it to a number > 0"
        )
    clock = STEPS if in_steps else SECONDS
    for setting in ("horizon", "replace_after"):
        other = f"{setting}_s" if clock == STEPS else f"{setting}_steps"
        if getattr(cfg, other) is not None:
            mine = f"{setting}_steps" if clock == STEPS else f"{setting}_s"
            raise FaultConfigError(
                f"faults.{other} is set but the {cfg.schedule} rate is in {'steps' if clock == STEPS else 'seconds'}; "
                f"use faults.{mine}"
            )
    return clock


def _setting(cfg: FaultsConfig, name: str, clock: str | None) -> Any:
    """``horizon`` or ``replace_after`` in the schedule's clock."""
    return getattr(cfg, f"{name}_{STEPS if clock == STEPS else SECONDS}")


def _reject_unused(cfg: FaultsConfig) -> None:
    defaults = FaultsConfig()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in ("schedule", "seed") or f.name in _USES[cfg.schedule] or value == getattr(defaults, f.name):
            continue
        users = [s for s, uses in _USES.items() if f.name in uses]
        raise FaultConfigError(
            f"faults.{f.name} is set ({value!r}) but the {cfg.schedule} schedule does not use it; "
            f"remove it, or choose a schedule that does: {', '.join(users)}"
        )


# --- explicit ---------------------------------------------------------------------------------------------------


def _explicit(cfg: FaultsConfig, cluster: ClusterShape) -> list[FaultEvent]:
    events = []
    for i, e in enumerate(cfg.events):
        try:
            events.append(FaultEvent(e.kind, e.node, e.worker, e.at_step, e.at_time_s, e.phase, e.warning_s, e.for_s))
        except FaultConfigError as err:
            raise FaultConfigError(f"faults.events[{i}]: {err}") from err
    if len({e.at_step is None for e in events}) > 1:
        raise FaultConfigError(
            "faults.events mixes at_step and at_time_s; steps and seconds cannot be ordered before the run, "
            "so use at_step for every event or at_time_s for every event"
        )
    return events


# --- generated: fixed, exponential, weibull -----------------------------------------------------------------------


def _positive(cfg: FaultsConfig, name: str) -> float:
    value = getattr(cfg, name)
    if value is None:
        raise FaultConfigError(f"the {cfg.schedule} schedule needs faults.{name}; set it to a number > 0")
    if not (math.isfinite(value) and value > 0):
        raise FaultConfigError(f"faults.{name} is {value}; set it to a finite number > 0")
    return float(value)


def _rate(cfg: FaultsConfig) -> float:
    """The schedule's rate setting in its own clock (steps or seconds)."""
    in_steps, in_seconds = _RATES[cfg.schedule]
    return _positive(cfg, in_steps if clock_of(cfg) == STEPS else in_seconds)


def _fixed(cfg: FaultsConfig, cluster: ClusterShape) -> list[FaultEvent]:
    interval = _rate(cfg)
    # Multiples rather than a running sum, so the times are exact (interval, 2*interval, ...).
    return _generate(cfg, cluster, lambda _rng, t, n: (n + 1) * interval)


def _exponential(cfg: FaultsConfig, cluster: ClusterShape) -> list[FaultEvent]:
    rate = 1.0 / _rate(cfg)
    return _generate(cfg, cluster, lambda rng, t, _n: t + rng.expovariate(rate))


def _weibull(cfg: FaultsConfig, cluster: ClusterShape) -> list[FaultEvent]:
    shape, scale = _positive(cfg, "weibull_shape"), _rate(cfg)
    return _generate(cfg, cluster, lambda rng, t, _n: t + rng.weibullvariate(scale, shape))


def _at(clock: str | None, t: float) -> dict[str, Any]:
    """The firing point of a generated time ``t``: the step it falls in, or the second."""
    return {"at_step": math.floor(t)} if clock == STEPS else {"at_time_s": t}


NextTime = Callable[[random.Random, float, int], float]
"""(rng, time of the previous fault, faults so far) -> time of the next fault."""


def _generate(cfg: FaultsConfig, cluster: ClusterShape, next_time: NextTime) -> list[FaultEvent]:
    if cfg.kind not in GENERATED_KINDS:
        raise FaultConfigError(
            f"faults.kind {cfg.kind!r} cannot be generated; use one of {', '.join(GENERATED_KINDS)} "
            "(joins come from replace_after_s, explicit events or traces)"
        )
    clock = clock_of(cfg)
    unit = "steps" if clock == STEPS else "s"
    max_failures, horizon = _bounds(cfg)
    if max_failures is None and horizon is None:
        raise FaultConfigError(
            f"the {cfg.schedule} schedule never ends; set faults.max_failures or faults.horizon_{unit} (or both)"
        )
    replace_after = _setting(cfg, "replace_after", clock)
    if replace_after is not None and not (math.isfinite(replace_after) and replace_after >= 0):
        raise FaultConfigError(f"faults.replace_after_{unit} is {replace_after}; set it to {unit} >= 0")

    rng = random.Random(cfg.seed)
    alive = list(range(cluster.nodes))
    next_index = cluster.nodes
    replacements: deque[FaultEvent] = deque()  # joins due later, in time order since replace_after_s is constant
    events: list[FaultEvent] = []
    t, failures = 0.0, 0
    while (max_failures is None or failures < max_failures) and len(events) <= MAX_EVENTS:
        t = next_time(rng, t, failures)
        if horizon is not None and t >= horizon:
            break
        # Strictly earlier joins only: a node joining at this instant is no survivor of it (see the module docstring).
        while replacements and _clock(replacements[0]) < t:
            join = replacements.popleft()
            alive.append(join.node)
            events.append(join)
        node = rng.choice(alive)
        worker = rng.randrange(cluster.workers_per_node) if cfg.kind in WORKER_KINDS else None
        events.append(FaultEvent(cfg.kind, node, worker, **_at(clock, t)))
        failures += 1
        if cfg.kind == "node":
            alive.remove(node)
            if replace_after is not None:
                replacements.append(FaultEvent("join", next_index, **_at(clock, t + replace_after)))
                next_index += 1
            if not alive:
                break  # every node is dead: _check_against_cluster reports it with the schedule's hint
    events.extend(j for j in replacements if horizon is None or _clock(j) < horizon)
    return events


def _bounds(cfg: FaultsConfig) -> tuple[int | None, float | None]:
    if cfg.max_failures is not None and cfg.max_failures < 0:
        raise FaultConfigError(f"faults.max_failures is {cfg.max_failures}; set it to 0 or more")
    clock = clock_of(cfg)
    name = f"horizon_{STEPS if clock == STEPS else SECONDS}"
    if getattr(cfg, name) is not None:
        _positive(cfg, name)
    return cfg.max_failures, getattr(cfg, name)


# --- trace replay -------------------------------------------------------------------------------------------------


def _trace(cfg: FaultsConfig, cluster: ClusterShape) -> list[FaultEvent]:
    if cfg.trace is None:
        raise FaultConfigError("the trace schedule needs faults.trace: a bundled trace name or a CSV path")
    clock = clock_of(cfg)
    if clock == STEPS:
        per_unit = _positive(cfg, "trace_s_per_step")
    elif cfg.time_compression is None:
        per_unit = 1.0
    elif not (math.isfinite(cfg.time_compression) and cfg.time_compression > 0):
        raise FaultConfigError(
            f"faults.time_compression is {cfg.time_compression}; set it to trace seconds per run second, > 0 "
            "(1 replays in real time, 600 plays ten trace minutes per second)"
        )
    else:
        per_unit = cfg.time_compression
    max_nodes = cluster.nodes if cfg.max_nodes is None else cfg.max_nodes
    if max_nodes < cluster.nodes:
        raise FaultConfigError(
            f"faults.max_nodes is {max_nodes}, below the cluster's {cluster.nodes} nodes; "
            f"set it to {cluster.nodes} or more, or leave it unset"
        )
    max_failures, horizon = _bounds(cfg)
    try:
        records = read_trace(cfg.trace)
    except TraceError as e:
        raise FaultConfigError(f"faults.trace: {e}") from e
    if cfg.trace_copies < 1:
        raise FaultConfigError(f"faults.trace_copies is {cfg.trace_copies}; replay 1 or more copies of the trace")
    peak = _peak(records)
    if cfg.node_map is None and cluster.nodes > cfg.trace_copies * peak:
        copies = -(-cluster.nodes // peak)
        raise FaultConfigError(
            f"trace {cfg.trace} holds at most {peak} nodes at once ({cfg.trace_copies} cop"
            f"{'y' if cfg.trace_copies == 1 else 'ies'}: {cfg.trace_copies * peak}), fewer than the cluster's "
            f"{cluster.nodes}: replay faults.trace_copies={copies} copies of it side by side, or map trace nodes onto "
            f"cluster nodes with faults.node_map (the others never fail)"
        )
    records = _copies(records, cfg.trace_copies)
    node_map = _node_map(cfg, cluster, records)

    start_ms = records[0].time_ms
    standing = dict(node_map)  # trace nodes present now that the cluster stands for -> cluster index
    first_added: set[str] = set()  # mapped trace nodes whose first add has been seen (later adds are new lives)
    alive_count, next_index, failures = cluster.nodes, cluster.nodes, 0
    events: list[FaultEvent] = []
    for r in records:
        t = (r.time_ms - start_ms) / 1000.0 / per_unit
        if (horizon is not None and t >= horizon) or failures == max_failures:
            break
        if r.action == "add":
            if r.node in node_map and r.node not in first_added:
                first_added.add(r.node)  # up since time 0 already
            elif r.time_ms > start_ms and alive_count < max_nodes:
                standing[r.node] = next_index
                events.append(FaultEvent("join", next_index, **_at(clock, t)))
                alive_count, next_index = alive_count + 1, next_index + 1
        elif r.node in standing:
            events.append(FaultEvent("node", standing.pop(r.node), **_at(clock, t)))
            alive_count, failures = alive_count - 1, failures + 1
    return events


def _peak(records: list[TraceRecord]) -> int:
    """The most nodes the trace holds at once."""
    alive = peak = 0
    for r in records:
        alive += 1 if r.action == "add" else -1
        peak = max(peak, alive)
    return peak


def _copies(records: list[TraceRecord], copies: int) -> list[TraceRecord]:
    """``copies`` copies of the trace, copy j's nodes named ``<node>#j`` (j > 0) and its later events delayed by
    j / copies of the mean time between removals (see the module docstring)."""
    if copies == 1:
        return records
    start = records[0].time_ms
    removes = [r.time_ms for r in records if r.action == "remove"]
    gap_ms = (removes[-1] - start) / len(removes) if removes else 0.0
    merged = []
    for j in range(copies):
        delay = round(j * gap_ms / copies)
        for order, r in enumerate(records):
            at = r.time_ms if r.time_ms == start else r.time_ms + delay
            merged.append((at, j, order, TraceRecord(at, r.action, r.node if j == 0 else f"{r.node}#{j}")))
    return [record for *_, record in sorted(merged, key=lambda m: m[:3])]


def _node_map(cfg: FaultsConfig, cluster: ClusterShape, records: list[TraceRecord]) -> dict[str, int]:
    """Trace node name -> the cluster node (0..N-1) that stands for it from time 0."""
    in_order = list(dict.fromkeys(r.node for r in records))  # by first appearance
    if cfg.node_map is None:
        return {name: index for index, name in enumerate(in_order[: cluster.nodes])}
    for name, index in cfg.node_map.items():
        if name not in in_order:
            raise FaultConfigError(
                f"faults.node_map names {name!r}, which trace {cfg.trace} does not have; use its node names "
                f"(e.g. {', '.join(in_order[:3])})"
            )
        if not 0 <= index < cluster.nodes:
            raise FaultConfigError(
                f"faults.node_map maps {name!r} to node {index}, which the {cluster.nodes}-node cluster does not "
                f"have; use indices 0 to {cluster.nodes - 1}"
            )
    if len(set(cfg.node_map.values())) < len(cfg.node_map):
        raise FaultConfigError("faults.node_map maps two trace nodes to one cluster node; give each its own index")
    return dict(cfg.node_map)


_BUILDERS: dict[str, Callable[[FaultsConfig, ClusterShape], list[FaultEvent]]] = {
    "none": lambda cfg, cluster: [],
    "explicit": _explicit,
    "fixed": _fixed,
    "exponential": _exponential,
    "weibull": _weibull,
    "trace": _trace,
}

_GENERATED_HINT = "lower max_failures or horizon_{unit}, or set replace_after_{unit} so killed nodes are replaced by joins"
_SURVIVAL_HINTS: dict[str, str] = {
    "none": "",
    "explicit": "remove a node fault, or add a join before it",
    "fixed": _GENERATED_HINT,
    "exponential": _GENERATED_HINT,
    "weibull": _GENERATED_HINT,
    "trace": "set max_failures or horizon_{unit} to end the replay sooner, or give the cluster more nodes or max_nodes",
}


# --- checks against the cluster -----------------------------------------------------------------------------------


def _check_against_cluster(events: list[FaultEvent], cluster: ClusterShape, survival_hint: str) -> None:
    """Replay the sorted events: each must hit a live node and a real worker, and one node must always survive."""
    alive = set(range(cluster.nodes))
    killed_at: dict[int, str] = {}
    next_index = cluster.nodes
    joined_now: set[int] = set()  # nodes that joined at the current instant
    for i, event in enumerate(events):
        if i > 0 and _clock(event) != _clock(events[i - 1]):
            joined_now.clear()
        if event.kind == "join":
            joined_now.add(event.node)
            if event.node != next_index:
                raise FaultConfigError(
                    f"the join at {event.when} gives node index {event.node}, but the next new node is "
                    f"{next_index} (indices are never reused); set node: {next_index}"
                )
            alive.add(event.node)
            next_index += 1
            continue
        if event.node in killed_at:
            raise FaultConfigError(
                f"the {event.kind} fault at {event.when} hits node {event.node}, which was killed at "
                f"{killed_at[event.node]}; pick a node alive by then"
            )
        if event.node not in alive:
            raise FaultConfigError(
                f"the {event.kind} fault at {event.when} hits node {event.node}, which does not exist by then; "
                f"use a node from 0 to {cluster.nodes - 1} (the cluster's) or one that joined earlier"
            )
        if event.worker is not None and event.worker >= cluster.workers_per_node:
            raise FaultConfigError(
                f"the {event.kind} fault at {event.when} hits worker {event.worker}, but nodes have "
                f"{cluster.workers_per_node} workers; use a worker index from 0 to {cluster.workers_per_node - 1}"
            )
        if event.kind == "node":
            alive.remove(event.node)
            killed_at[event.node] = event.when
            if not alive - joined_now:
                at_once = sum(1 for e in events[: i + 1] if e.kind == "node" and _clock(e) == _clock(event))
                raise FaultConfigError(
                    f"no node survives {event.when}: the schedule kills every node alive before it ({at_once} node "
                    f"faults at that instant); at least one node must survive: {survival_hint}"
                )


# --- reach: can the events fire within the job? -------------------------------------------------------------------


def beyond_job(events: list[FaultEvent], first_step: int, steps: int) -> list[FaultEvent]:
    """Step-clocked events the job never reaches: at or after ``steps`` (the job runs steps ``first_step`` to
    ``steps - 1``), or before ``first_step`` (a resumed job starts there). Time-clocked events cannot be judged
    before the run."""
    return [e for e in events if e.at_step is not None and not first_step <= e.at_step < steps]


def check_reach(cfg: FaultsConfig, events: list[FaultEvent], first_step: int, steps: int) -> list[FaultEvent]:
    """The events of ``cfg`` that the job can reach. An explicit event at or after ``steps`` is an error (the user
    named a step the job never runs); a generated or replayed one is dropped, and so is any event before a resumed
    job's ``first_step`` (the job it resumes ran those steps, with their faults): the caller warns of both (see
    ``beyond_job``)."""
    beyond = beyond_job(events, first_step, steps)
    late = [e for e in beyond if (e.at_step or 0) >= steps]
    if late and cfg.schedule == "explicit":
        what = ", ".join(f"the {e.kind} fault at {e.when}" for e in late)
        raise FaultConfigError(
            f"{what} cannot fire: the job runs steps {first_step} to {steps - 1} (train.steps={steps}); move "
            f"{'it' if len(late) == 1 else 'them'} into that range or raise train.steps"
        )
    return [e for e in events if e not in beyond]


# --- names ----------------------------------------------------------------------------------------------------------


def rate_label(cfg: FaultsConfig) -> str:
    """The schedule with its rate, short enough for a run name and a table column: ``none``, ``explicit``,
    ``fixed-10steps``, ``exponential-20s``, ``weibull-8steps``, ``trace-p3-120s_per_step``. Jobs that differ only in
    their seed share a label, so a comparison averages over seeds."""
    if cfg.schedule not in _RATES:
        return cfg.schedule
    try:
        clock = clock_of(cfg)
    except FaultConfigError:  # the preflight refuses the schedule with its message; the run still needs a name
        return cfg.schedule
    in_steps, in_seconds = _RATES[cfg.schedule]
    value = getattr(cfg, in_steps if clock == STEPS else in_seconds)
    if cfg.schedule == "trace":
        pace = "real_time" if value is None else (f"{value:g}s_per_step" if clock == STEPS else f"x{value:g}")
        return f"trace-{Path(cfg.trace or '').stem}-{pace}"
    return f"{cfg.schedule}-{value:g}{'steps' if clock == STEPS else 's'}"
