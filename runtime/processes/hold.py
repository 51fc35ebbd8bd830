"""Holds: a test stops a process at a named point of its start and lets it go on, so that a race happens by an event.

A race between a starting process and something else (a second restart, a lost node) is made to happen at a known
point instead of after a guessed sleep: the test names a directory in ``FTLAB_HOLD_DIR`` (inherited by the agents
and their workers through the environment) and creates ``<point>.hold`` there. A process that reaches ``<point>``
writes ``<point>.reached`` (its pid) and waits until the ``.hold`` file is removed. Without the variable, or without
the ``.hold`` file, ``hold`` returns at once: a job never waits on it.

Points:
- ``worker_point``: a worker after its imports (torch among them) and before it registers with the coordinator, by
  worker id and incarnation;
- ``registered_point``: the coordinator once it has admitted a worker's registration (its membership counts it),
  before it reads the worker's messages;
- ``step_point``: the coordinator before it starts a step on the workers, after that boundary's joins were offered.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HOLD_DIR_ENV = "FTLAB_HOLD_DIR"
_POLL_S = 0.01
"""How often a held process looks for its release: a file, so that a test in another process can give it."""


def worker_point(worker: int, incarnation: int) -> str:
    """The point a worker reaches once its imports are done, before it registers."""
    return f"register-worker{worker}-{incarnation}"


def registered_point(worker: int, incarnation: int) -> str:
    """The point the coordinator reaches once it has admitted ``worker``'s registration."""
    return f"registered-worker{worker}-{incarnation}"


def step_point(step: int) -> str:
    """The point the coordinator reaches before it starts ``step`` on the workers."""
    return f"step{step}"


def hold(point: str) -> None:
    """Wait at ``point`` while a test holds it (see the module's docstring); return at once otherwise."""
    root = os.environ.get(HOLD_DIR_ENV)
    if not root:
        return
    gate = Path(root) / f"{point}.hold"
    if not gate.exists():
        return
    reached = Path(root) / f"{point}.reached"
    partial = reached.with_suffix(".partial")
    partial.write_text(str(os.getpid()))
    partial.rename(reached)  # whole or absent: the test reads the pid as soon as the file is there
    while gate.exists():
        time.sleep(_POLL_S)
