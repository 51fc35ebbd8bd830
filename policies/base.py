"""The Policy interface: what a fault-tolerance policy decides, and nothing of how the runtime carries it out.

A policy is chosen by its Hydra config (``_target_``), so a new policy needs no change to the runtime. It sees the
job (model layers, cluster membership, training settings) and answers four questions: the first plan, each
worker's program, what to do when membership changes, and what to do after a committed step. The same code runs
on the real runtime and on the simulator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from runtime.config import PolicyConfig, TrainConfig
from runtime.instructions import Program
from runtime.model import LayerSpec, ModelConfig
from runtime.plan import Plan, grid_plan
from runtime.scheduler import one_f_one_b


@dataclass(frozen=True)
class Job:
    """What a policy plans for: the model, the training settings and who is alive now."""

    model: ModelConfig
    specs: tuple[LayerSpec, ...]
    train: TrainConfig
    workers_of_node: dict[int, tuple[int, ...]]
    """Alive nodes and their alive workers."""
    slots_of_node: dict[int, tuple[int, ...]]
    """Alive nodes and every worker they run after a restart (a killed process comes back; a lost node does not)."""
    device_memory_bytes: int

    @property
    def workers(self) -> list[int]:
        return sorted(w for ws in self.workers_of_node.values() for w in ws)

    @property
    def slots(self) -> list[int]:
        return sorted(w for ws in self.slots_of_node.values() for w in ws)


@dataclass(frozen=True)
class Change:
    """A membership change, seen at an iteration boundary (the iteration in flight was aborted)."""

    plan: Plan
    """The plan that was running."""
    step: int
    """The last committed step + 1: where every survivor's layers are."""
    failed_nodes: tuple[int, ...] = ()
    failed_workers: tuple[int, ...] = ()
    joined_nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class InPlace:
    """Survivors keep running: new plan, layers copied between workers, a new process-group generation."""

    plan: Plan
    transfers: tuple[tuple[int, int, int], ...] = ()
    """(layer, source worker, destination worker), each layer with its optimizer state."""


@dataclass(frozen=True)
class Restart:
    """Every worker is restarted and loads ``checkpoint`` (a committed checkpoint directory)."""

    plan: Plan
    checkpoint: str | None


@dataclass(frozen=True)
class Continue:
    """Keep the running plan (e.g. a node that joined waits for the next restart)."""


@dataclass(frozen=True)
class Stop:
    reason: str


Recovery = InPlace | Restart | Continue | Stop


@dataclass(frozen=True)
class SaveCheckpoint:
    """After-step action: write a checkpoint of the just-committed step."""

    directory: str
    keep: int = 2


Action = SaveCheckpoint


@dataclass
class Policy(ABC):
    settings: PolicyConfig = field(default_factory=PolicyConfig)

    @classmethod
    def from_settings(cls, **settings: Any) -> Policy:
        """The Hydra ``_target_`` of every policy: keyword settings become a typed PolicyConfig."""
        return cls(PolicyConfig(**{k: v for k, v in settings.items() if k != "_target_"}))

    @property
    def name(self) -> str:
        return self.settings.name

    @abstractmethod
    def plan(self, job: Job, generation: int = 0, step: int = 0) -> Plan: ...

    def programs(self, plan: Plan) -> dict[int, Program]:
        return one_f_one_b(plan)

    @abstractmethod
    def on_change(self, change: Change, job: Job) -> Recovery: ...

    def configured(self, plan: Plan) -> None:
        """Every worker of ``plan`` holds its layers: the plan is now the one to recover from."""

    def after_step(self, step: int, job: Job) -> list[Action]:
        """After ``step`` committed steps: a checkpoint every ``checkpoint_every`` steps, whatever the policy."""
        every = self.settings.checkpoint_every
        if every and step % every == 0:
            return [SaveCheckpoint(self.settings.checkpoint_dir, self.settings.keep_checkpoints)]
        return []


def default_grid(job: Job, generation: int = 0, step: int = 0) -> Plan:
    """The largest PP x DP grid of ``train.stages`` stages the alive workers allow."""
    t = job.train
    return grid_plan(job.workers, t.stages, len(job.specs), t.global_batch, t.micro_batch, generation, step)


class NoFaultTolerance(Policy):
    """``policy=none``: train on a PP x DP grid and stop cleanly at the first failure."""

    def plan(self, job: Job, generation: int = 0, step: int = 0) -> Plan:
        return default_grid(job, generation, step)

    def on_change(self, change: Change, job: Job) -> Recovery:
        lost = ", ".join(
            [f"node {n}" for n in change.failed_nodes] + [f"worker {w}" for w in change.failed_workers]
        )
        return Stop(
            f"{lost or 'a member'} failed at step {change.step} and policy=none does not recover; "
            f"choose policy=checkpoint_restart or policy=oobleck to survive failures"
        )
