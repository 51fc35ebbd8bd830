"""Stopping ``ftlab`` from outside: Ctrl-C, ``kill``, a closed terminal, a scheduler's ``scancel`` or CI's timeout.

Python answers SIGINT with ``KeyboardInterrupt``, but SIGTERM and SIGHUP end the process on the spot: no ``finally``
runs, so the job's MLflow run would stay RUNNING forever, a sweep's parent run too, and the node memories of
/dev/shm would stay behind. ``stop_on_signals`` makes SIGTERM and SIGHUP unwind the main thread the way Ctrl-C does
(``Stopped``): the job's run is marked FAILED with the signal's name, the workers are shut down, the memory is freed,
an unfinished sweep's parent is closed as KILLED and its children still running as FAILED (``sweep``: a launcher's
job processes are killed outright). Once: a second signal while that happens ends the process at once, as a second
Ctrl-C would be expected to.
"""

from __future__ import annotations

import signal
from types import FrameType

STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """The process was told to stop by ``signum``. A ``BaseException``, as ``KeyboardInterrupt`` is: no ``except
    Exception`` (a sweep's, which records one job's failure and goes on) may swallow it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def _stop(signum: int, frame: FrameType | None) -> None:
    for sig in STOPPING_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    raise Stopped(signum)


def stop_on_signals() -> None:
    """From now on SIGTERM and SIGHUP raise ``Stopped`` in the main thread (call it from there)."""
    for sig in STOPPING_SIGNALS:
        signal.signal(sig, _stop)


def exit_status(exc: BaseException) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (130 for Ctrl-C)."""
    signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
    return 128 + int(signum)
