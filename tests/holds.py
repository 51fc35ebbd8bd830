"""Jobs driven by holds (``runtime.processes.hold``): a test runs a job on a thread and acts when a process stands at
a named point, never after a guessed sleep.

A join is the common case: a joining node boots beside training, so whether it is up before a job of a few steps
ends depends on this machine's speed. ``up_before`` makes it certain: the coordinator waits before a given step
until every worker of the joining node has registered, and the node is offered at the next iteration boundary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

import pytest

from ftlab.runtime.processes.hold import HOLD_DIR_ENV, registered_point, step_point

T = TypeVar("T")

HANG_S = 300
"""How long a test waits for a process to reach a point before it calls that a hang (as ``cluster.start`` does)."""
_POLL_S = 0.01


@pytest.fixture
def holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's hold directory, in the environment of the coordinator (the test's process) and of every agent."""
    directory = tmp_path / "holds"
    directory.mkdir()
    monkeypatch.setenv(HOLD_DIR_ENV, str(directory))
    yield directory
    for gate in directory.glob("*.hold"):
        gate.unlink()  # whatever a failed test left held goes on


def hold_at(holds: Path, point: str) -> None:
    (holds / f"{point}.hold").touch()


def release(holds: Path, point: str) -> None:
    (holds / f"{point}.hold").unlink(missing_ok=True)


class JobThread(Generic[T]):
    """A job run on a thread of its own, so that the test can act while it runs."""

    def __init__(self, job: Callable[[], T]) -> None:
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._body, args=(job,), name="job", daemon=True)
        self._thread.start()

    def _body(self, job: Callable[[], T]) -> None:
        try:
            self._result = job()
        except BaseException as exc:  # noqa: BLE001 - handed to the test by ``result``
            self._error = exc

    def reached(self, holds: Path, point: str) -> int:
        """Wait until a process stands at the held ``point``; its pid. A job that ends first fails the wait."""
        mark = holds / f"{point}.reached"
        deadline = time.monotonic() + HANG_S
        while not mark.exists():
            if not self._thread.is_alive():
                self.result()  # raises the job's error, if it had one
                raise AssertionError(f"the job ended before any process reached {point}")
            assert time.monotonic() < deadline, f"no process reached {point}"
            time.sleep(_POLL_S)
        return int(mark.read_text())

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


def up_before(holds: Path, workers: Iterable[int], step: int, job: Callable[[], T]) -> T:
    """Run ``job`` with the joining node's ``workers`` (their first start) registered before the coordinator starts
    ``step``: it is offered to the policy at the boundary of ``step + 1`` at the latest, however slowly it starts."""
    workers = list(workers)
    for worker in workers:
        hold_at(holds, registered_point(worker, 0))
    hold_at(holds, step_point(step))
    running = JobThread(job)
    for worker in workers:
        running.reached(holds, registered_point(worker, 0))
        release(holds, registered_point(worker, 0))
    release(holds, step_point(step))
    return running.result()
