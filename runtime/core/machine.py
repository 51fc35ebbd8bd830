"""What the platform a job runs on answers to a policy: how long a step of a plan takes, and how long carrying out a
decision pauses training.

A ``Machine`` is built once per job from its cluster, where the job is assembled (``experiments.job``), and reaches a
policy through the job (``Job.machine``). The simulator charges its simulated time with the same object
(``runtime.sim.machines``), so a policy's prediction and the simulator's charge are one computation, never two
copies of a formula. Which platform it models (one device per worker, or every worker a process on one shared host)
is the machine's own business: nothing that asks it knows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ftlab.runtime.core.instructions import Program
from ftlab.runtime.core.plan import Plan

if TYPE_CHECKING:
    from ftlab.runtime.core.contract import Change, Decision, Job


class Machine(ABC):
    """The time a job's work takes on its platform."""

    @abstractmethod
    def step_s(self, plan: Plan, programs: Mapping[int, Program], snapshot: Mapping[int, int] | None = None,
               every: int = 1) -> float:  # fmt: skip
        """One committed step of ``plan``: its programs until every worker has reduced, the commit and the slowest
        optimizer step; with ``snapshot`` (the bytes each worker copies per snapshot, taken every ``every`` steps),
        what the copies add to the step they overlap, spread over the steps between snapshots."""

    @abstractmethod
    def pause_s(self, decision: Decision, change: Change, job: Job) -> float:
        """From a change's signal until training runs again on ``decision.plan``: for a failure its detection and
        the abort, then restarting processes, configuring the plan, copying, building and restoring layers."""
