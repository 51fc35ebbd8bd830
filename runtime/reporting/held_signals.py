"""Stop signals held while a call to the MLflow store runs, and delivered once it is done.

Ctrl-C raises ``KeyboardInterrupt`` (and ``ftlab``'s SIGTERM and SIGHUP raise ``Stopped``) wherever the main thread
is. Raised inside a write to a SQLite store, it leaves that write's connection holding the database's lock: the
write that marks the run FAILED then waits for the lock forever, and the interrupted job hangs with its run RUNNING
(a loop of ``log_batch`` interrupted at a random moment hangs its next ``set_tag``). A call to the store is short, so the signal waits for its end and is then delivered to the handler it was meant for.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import ParamSpec, TypeVar

HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold the stop signals that a Python handler answers (SIG_DFL and SIG_IGN ones act as they would anyway) for
    the body, then deliver each one that came. Only the main thread runs signal handlers, so elsewhere it holds
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        if signum not in came:
            came.append(signum)

    handlers = {sig: handler for sig in HELD if callable(handler := signal.getsignal(sig))}
    for sig in handlers:
        signal.signal(sig, hold)
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for sig in came:
            signal.raise_signal(sig)  # its handler runs now, in this thread: it raises here


def store_access(access: Callable[P, R]) -> Callable[P, R]:
    """``access``, a function that reads or writes the MLflow store, run with the stop signals held (a read holds
    SQLite's shared lock, which keeps every writer out as long as it is left held)."""

    @functools.wraps(access)
    def held(*args: P.args, **kwargs: P.kwargs) -> R:
        with signals_held():
            return access(*args, **kwargs)

    return held
