"""The contract between the coordinator and the fault-tolerance code: what a policy and a protection see, and what
they answer.

Two concerns, composed freely (``policy=... protection=...``):

- a **Policy** says how the cluster reconfigures: the first plan, and what to do when membership changes;
- a **Protection** says where state is kept between failures: which saves to make after a committed step, and the
  newest complete saved state a restart can restore from.

A policy that needs saved state asks its protection for a ``Source``; no code is written per pair. Every answer of a
policy is a ``Decision`` that carries everything needed to carry it out (the plan, every worker's program, the layer
transfers, whether processes restart, where missing state is restored from) or a ``Keep`` or ``Stop``: the
coordinator never calls back into the policy to complete one.

This module, plans, instructions, schedules, the program checker and the cost model import no torch, transformers,
DeepSpeed or Hydra (``tests/test_contract.py``), so the simulator and the real runtime share them, and a job is
planned and checked before anything heavy loads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from ftlab.runtime.core.config import TrainConfig
from ftlab.runtime.core.costs import CostModel, ModelProfile
from ftlab.runtime.core.instructions import Program
from ftlab.runtime.core.machine import Machine
from ftlab.runtime.core.model_spec import LayerSpec, ModelConfig
from ftlab.runtime.core.plan import Plan


class ConfigError(ValueError):
    """A job that cannot work as configured; the message says what to change."""


# -- what the policies see -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FailureRate:
    """The whole cluster's mean time between failures, on the clock the fault schedule runs on: steps (the same
    faults at the same steps on any machine) or seconds. One of the two is set."""

    mean_steps: float | None = None
    mean_s: float | None = None
    shape: float = 1.0
    """The Weibull shape of the times between failures (1: exponential)."""

    def __post_init__(self) -> None:
        if (self.mean_steps is None) == (self.mean_s is None):
            raise ValueError("a failure rate is in steps or in seconds: give mean_steps or mean_s")

    def per_s(self, iteration_s: float) -> float:
        """Expected failures per second of training at this iteration time."""
        return 1.0 / self.mean_s if self.mean_s is not None else 1.0 / (self.mean_steps * iteration_s)  # type: ignore[operator]

    def steps_between(self, iteration_s: float) -> float:
        """Expected committed steps between two failures at this iteration time."""
        return self.mean_steps if self.mean_steps is not None else self.mean_s / iteration_s  # type: ignore[operator]


@dataclass(frozen=True)
class Job:
    """What a policy plans for: the model, the training settings and who is alive now."""

    model: ModelConfig
    specs: tuple[LayerSpec, ...]
    train: TrainConfig
    workers_of_node: Mapping[int, tuple[int, ...]]
    """Alive nodes and their alive workers."""
    slots_of_node: Mapping[int, tuple[int, ...]]
    """Alive nodes and every worker they run after a restart (a killed process comes back; a lost node does not)."""
    device_memory_bytes: int
    profile: Callable[[], ModelProfile] = field(compare=False, repr=False)
    """The per-layer costs of this model on this cluster's devices (measured or analytic; cached by the caller)."""
    machine: Callable[[], Machine] = field(compare=False, repr=False)
    """The platform's answers to what a step or a recovery takes (``runtime.core.machine``; built once from the
    cluster and cached by the caller): the simulator charges with the same machine a policy predicts with."""
    start: Source | None = None
    """Saved state the first plan starts from (``train.resume_from``), or None for a fresh model."""
    failure_rate: FailureRate | None = None
    """How often the cluster is expected to fail (None: the fault schedule does not say, e.g. an explicit list or no
    faults). Protections that tune their interval to it and policies that weigh a recovery's future cost read it."""

    @property
    def workers(self) -> list[int]:
        return sorted(w for ws in self.workers_of_node.values() for w in ws)

    @property
    def slots(self) -> list[int]:
        return sorted(w for ws in self.slots_of_node.values() for w in ws)

    @property
    def workers_per_node(self) -> int:
        return max((len(ws) for ws in self.slots_of_node.values()), default=1)

    @property
    def start_step(self) -> int:
        return self.start.step if self.start is not None else 0

    @cached_property
    def costs(self) -> CostModel:
        return CostModel(self.profile())


@dataclass(frozen=True)
class Change:
    """A membership change, seen at an iteration boundary (the iteration in flight was aborted)."""

    plan: Plan
    """The plan every worker was last configured for."""
    step: int
    """Committed steps: where every survivor's layers are."""
    generation: int
    """The generation an answer's plan must have: one more than any plan tried so far (a plan whose configuration a
    further failure interrupted used up its generation, whose rendezvous keys are stale)."""
    failed_nodes: tuple[int, ...] = ()
    failed_workers: tuple[int, ...] = ()
    """Workers that died on nodes that live on (a process crash or a fenced hang)."""
    joined_nodes: tuple[int, ...] = ()
    holdings: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """The layers each surviving worker holds at ``step``, with their optimizer state."""

    @property
    def is_failure(self) -> bool:
        return bool(self.failed_nodes or self.failed_workers)

    @property
    def is_review(self) -> bool:
        """No member failed or joined: the policy reviews the running plan (``Policy.review``)."""
        return not (self.is_failure or self.joined_nodes)

    def describe(self) -> str:
        parts = [f"node {n}" for n in self.failed_nodes] + [f"worker {w}" for w in self.failed_workers]
        if parts:
            return ", ".join(parts) + f" failed at step {self.step}"
        if self.joined_nodes:
            return f"nodes {list(self.joined_nodes)} joined at step {self.step}"
        return f"review at step {self.step}"


@dataclass(frozen=True)
class PreemptionWarning:
    """A preemption notice (a spot instance's grace period), seen by the policy between iterations: ``nodes`` are
    killed ``grace_s`` seconds after the notice, on the backend's clock, whatever the policy does; ``left_s`` of it
    remain now. The policy may act first (``Policy.on_warning``)."""

    plan: Plan
    """The running plan."""
    step: int
    """Committed steps: what a save made now holds."""
    nodes: tuple[int, ...]
    grace_s: float
    left_s: float

    def describe(self) -> str:
        return f"nodes {list(self.nodes)} preempted in {self.left_s:.2f} s (warned at step {self.step})"


# -- where state comes from ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """Saved state of a committed step, and where it is."""

    kind: ClassVar[str]
    step: int
    reason: str = field(default="", kw_only=True, compare=False)
    """Why the protection offers this state (e.g. why memory was not enough), for the event log."""


@dataclass(frozen=True)
class StorageSource(Source):
    """A committed checkpoint directory (``runtime.state.checkpoint``)."""

    kind: ClassVar[str] = "storage"
    directory: str


@dataclass(frozen=True)
class MemoryRecord:
    """One record of an in-memory snapshot in a node's host memory (``runtime.core.snapshot_layout`` says what each
    kind holds): a shard of a sharding group's state, a redundant copy of one, or an XOR parity."""

    node: int
    layers: tuple[int, ...]
    """The sharding group's layers (the group's state is theirs, split into ``members`` shards)."""
    members: int
    index: int
    """The shard's index (kinds shard and copy), or the index of the member that wrote the parity."""
    kind: str
    """shard | copy | parity"""
    crc: int = 0
    """The checksum of the record's bytes as written (XXH3-64, ``runtime.state.shm``)."""
    nbytes: int = 0

    @property
    def name(self) -> str:
        """Its file name in the node's memory: records of the same group, index and kind replace each other."""
        runs: list[list[int]] = []
        for layer in self.layers:
            if runs and runs[-1][-1] == layer - 1:
                runs[-1].append(layer)
            else:
                runs.append([layer])
        span = "_".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
        return f"L{span}.m{self.members}.{self.kind}{self.index}"


@dataclass(frozen=True)
class MemorySource(Source):
    """An in-memory snapshot (REFT): records in the host memory of live nodes, from which every shard of every
    sharding group of ``plan`` is read, copied from a peer, or decoded from parity."""

    kind: ClassVar[str] = "memory"
    plan: Plan
    """The plan the snapshot was taken on: its sharding groups are the holders of each run of layers."""
    workers_per_node: int
    records: tuple[MemoryRecord, ...]
    """Every intact record of step ``step`` on a live node."""
    shard_crcs: tuple[tuple[tuple[int, ...], int, int], ...] = ()
    """(group layers, shard index, checksum) of every shard as its owner wrote it: a shard rebuilt from a copy or
    parity is checked against it, so a restore is bit-exact or fails."""


# -- what the policies answer --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerTransfer:
    """Copy ``layer`` with its optimizer state from worker ``source`` to worker ``destination``."""

    layer: int
    source: int
    destination: int


@dataclass(frozen=True)
class Decision:
    """A plan and everything needed to carry it out."""

    plan: Plan
    programs: Mapping[int, Program]
    """Every worker's program for one iteration of ``plan``."""
    transfers: tuple[LayerTransfer, ...] = ()
    """Layers copied between live workers before the plan runs (in place: no process restarts)."""
    restart: bool = False
    """End every worker process and start fresh ones on the live nodes first (their layers are then lost)."""
    restore: Source | None = None
    """Where a worker that lacks a layer of its stage (and receives no transfer of it) loads it from."""
    reason: str = ""
    """Why, in words, for the event log."""
    details: Mapping[str, Any] = field(default_factory=dict)
    """The policy's particulars (template sizes, reroutes, ...), for the event log."""
    predicted_pause_s: float | None = None
    """For a policy that predicts: from the failure's signal until training runs again on ``plan`` (detection,
    abort, restart, layer copies, restore), on the one cost model; logged beside the measured recovery."""
    predicted_iter_s: float | None = None
    """For a policy that predicts: one iteration of ``plan``, logged beside the measured ``perf/iter_s``."""

    @property
    def kind(self) -> str:
        if self.restart:
            return "restart"
        return "reconfigure" if self.transfers else "replan"


@dataclass(frozen=True)
class Keep:
    """Keep the running plan (e.g. a node that joined waits for the next restart)."""

    reason: str
    details: Mapping[str, Any] = field(default_factory=dict)
    """What the policy weighed (e.g. each alternative's predicted cost), for the event log."""


@dataclass(frozen=True)
class Stop:
    """Stop the job; the coordinator saves the survivors' state if they still hold every layer."""

    reason: str


Outcome = Decision | Keep | Stop


@dataclass(frozen=True)
class Heed:
    """What a policy does about a preemption warning before the kill: saves to make now, at the warned step (the
    coordinator carries them out as a protection's, and the protection hears of them through ``saved``), and why."""

    reason: str
    actions: tuple[Action, ...] = ()


# -- what a protection asks for after a committed step ------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    """Something to save after a committed step."""


@dataclass(frozen=True)
class SaveCheckpoint(Action):
    """Write a checkpoint of the just-committed step to ``directory``, keeping the newest ``keep``."""

    directory: str
    keep: int = 2


@dataclass(frozen=True)
class TakeSnapshot(Action):
    """Copy the just-committed step's state into the host memory of the workers' nodes, sharded over each group of
    holders of the same layers and protected by ``mode`` (``runtime.core.snapshot_layout``), without stopping training:
    the copies overlap the next iteration and complete asynchronously, each writer reporting its records."""

    plan: Plan
    mode: str
    """arc | aec | aor | arc+aec"""
    workers_per_node: int
    keep: int
    """The newest complete snapshot's step (-1: none): no writer overwrites it, whatever happens to this one."""


# -- the two roles -------------------------------------------------------------------------------------------------
class Protection(ABC):
    """Where state is kept between failures."""

    keeps_state: ClassVar[bool] = True
    """False for the protection that saves nothing: a policy that restarts from saved state cannot use it."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    @property
    def name(self) -> str:
        return self.settings.name

    def check(self, job: Job) -> None:
        """Raise ConfigError if this protection cannot protect ``job``."""

    def check_plan(self, plan: Plan, job: Job) -> None:
        """Raise ConfigError if this protection cannot protect the first plan of ``job`` (checked before any worker
        starts)."""

    def describe(self) -> dict[str, str]:
        """Choices the protection made from the job (e.g. an interval tuned to the failure rate), recorded with the
        run."""
        return {}

    def runtime_options(self) -> dict[str, Any]:
        """What every worker must do from the first step on for this protection (e.g. AOR's exchange of gradient
        chunks), sent with the job's settings."""
        return {}

    @abstractmethod
    def after_commit(self, step: int, plan: Plan) -> list[Action]:
        """What to save now that ``step`` steps are committed."""

    def copies_beside_training(self, plan: Plan, job: Job) -> tuple[dict[int, int], int]:
        """The bytes each worker of ``plan`` copies beside training per snapshot, and the steps between snapshots
        (a cost a policy predicts with ``Machine.step_s``); none by default."""
        return {}, 1

    def saved(self, action: Action, step: int, records: tuple[MemoryRecord, ...] = ()) -> None:
        """The coordinator carried out ``action`` for ``step``: completely, or, for an asynchronous snapshot, one
        writer's part of it (the ``records`` that writer completed)."""

    def restore_source(self, change: Change | None = None) -> Source | None:
        """The newest complete saved state that survives ``change``, or None."""
        return None

    def unusable(self, source: Source, reason: str) -> None:
        """``source`` (which this protection offered) cannot be loaded after all (a record failed its checksum):
        offer something else next time."""

    def unsaved(self, action: Action, step: int, reason: str) -> str | None:
        """The coordinator abandoned ``action`` for ``step``: storage refused a write (``reason``), nothing of the
        save is left, and the previous saved state stays the newest. Why the job must stop now (the message for
        the user), or None to train on."""
        return None

    def newest_on_storage(self) -> StorageSource | None:
        """The newest checkpoint on storage this protection wrote or started from: what a stopped job resumes from
        (state in the nodes' memory ends with the job); None by default."""
        return None

    def storage_footprint(self) -> tuple[int, bool]:
        """(Checkpoints of the whole model this protection keeps on storage at once, whether a checkpoint folder
        with room for fewer than that plus the one being written may be used anyway); (0, False) for none. Checked
        against the folder's free space before any worker starts."""
        return 0, False

    def host_memory_footprint(self) -> dict[int, int]:
        """Bytes of host memory this protection's records take on each node under the first plan (known once
        ``check_plan`` ran); none by default. Nodes on one machine share its memory: checked against its free space
        before any worker starts."""
        return {}


@dataclass(frozen=True)
class Roles:
    """What a policy can be used for, declared by the policy itself (``Policy.roles``). Code that runs policies side
    by side finds them (``ftlab.policies.catalog``) and selects them by these roles, never by a list of names: the
    soak campaign, ``policy=adaptive``'s candidates, the benches."""

    recovers: bool = True
    """Carries a job on past a failure (``policy=none`` stops at the first one)."""
    in_place: bool = False
    """Recovers without restarting a process or losing a committed step while enough replicas survive: every
    survivor keeps its state. Adaptive's reviews may switch to such a candidate without a failure."""
    restarts: bool = False
    """With a protection that keeps state, recovers from any failure that leaves a live node whose devices hold the
    model (``train.stages`` stages, or one per live worker where fewer live), by restarting processes from that state
    (always, or where it cannot recover in place)."""
    candidate: str | None = None
    """The recovery this policy offers ``policy=adaptive`` as a candidate, by the name ``policy.candidates`` uses:
    ``reroute`` (ReCycle), ``reconfigure`` (Oobleck), ``restart`` (checkpoint-restart), or a new name; unique among
    policies. None: no candidate."""
    chooses: bool = False
    """Recovers by choosing among other policies' answers (adaptive): compared with the best policy that does not."""
    state_copies: int = 1
    """Stages' model states a worker holds: its own, and any it keeps of other stages (Bamboo: 2, its own and its
    successor's). A harness that sizes device memory for one stage's state scales it by this, and gives the job at
    least this many stages (a copy of another stage needs another stage)."""

    @property
    def restarts_only(self) -> bool:
        """Recovers by restarting from saved state and nothing else: the baseline in-place recovery is measured
        against."""
        return self.recovers and self.restarts and not self.in_place and not self.chooses


class Policy(ABC):
    """How the cluster reconfigures when its membership changes."""

    roles: ClassVar[Roles] = Roles()
    """What this policy can be used for (``Roles``); a policy package sets its own."""
    moves_layers: ClassVar[bool] = False
    """Copies layers with their optimizer state between live workers (in place), which ZeRO-1 (train.zero=1)
    splits across replicas: such a policy cannot run with it."""
    heeds_warnings_at_once: ClassVar[bool] = False
    """Hears a preemption warning as it comes, the iteration in flight given up, not at the next iteration boundary,
    which may come after the kill: for a policy that saves when warned. Until the iteration commits, every worker
    holds the committed step's state, so the save holds the same either way; the iteration is run again after it."""
    plans_own_depth: ClassVar[bool] = False
    """Chooses its pipelines' depth itself (templates, morphing): ``train.stages`` shapes none of its plans, and a
    job that sets it is warned that it is not used."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings

    @property
    def name(self) -> str:
        return self.settings.name

    def check(self, protection: Protection) -> None:
        """Raise ConfigError if this policy cannot work with ``protection``."""

    @abstractmethod
    def plan(self, job: Job, protection: Protection) -> Decision:
        """The first plan, starting at ``job.start`` (restore from it when set)."""

    @abstractmethod
    def on_change(self, change: Change, job: Job, protection: Protection) -> Outcome:
        """What to do about a membership change."""

    @property
    def review_every(self) -> int:
        """Committed steps of a plan between two reviews of it (``review``); 0: the policy never reviews."""
        return 0

    def on_warning(self, warning: PreemptionWarning, job: Job, protection: Protection) -> Heed:
        """What to do before a warned preemption: a ``Heed`` whose actions are carried out at once (the kill comes
        when the warning said, whatever they are), at the iteration boundary it is heard at (or mid-iteration,
        ``heeds_warnings_at_once``). The default ignores it: the failure is handled when it comes."""
        return Heed("this policy does not act on preemption warnings")

    def review(self, change: Change, job: Job, protection: Protection) -> Decision | Keep:
        """Whether to leave the running plan although membership has not changed (``change.is_review``): a Decision
        is carried out as a join's is (survivors keep their state; no step is lost, so it must start at
        ``change.step`` and restart nothing), a Keep goes on. Asked after every ``review_every`` committed steps of
        a plan, at the step boundary, with the plan's holdings."""
        return Keep("this policy does not review its plans")
