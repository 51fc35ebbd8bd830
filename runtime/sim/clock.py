"""Simulated time: a clock that advances by events, never by ticks, and the timers that fire on the way."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable

NEVER = math.inf


class Clock:
    """The simulated clock and its timers (the fault injector's, and the backend's phase faults)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._sequence = itertools.count()
        self._cancelled: set[int] = set()

    def call_at(self, at: float, action: Callable[[], None]) -> int:
        """Run ``action`` when the clock reaches ``at``; the timer's id, to cancel it."""
        ident = next(self._sequence)
        heapq.heappush(self._timers, (at, ident, action))
        return ident

    def cancel(self, idents: Iterable[int]) -> None:
        self._cancelled.update(idents)

    def next_timer(self) -> float:
        """When the next timer fires (``NEVER``: none is set)."""
        while self._timers and self._timers[0][1] in self._cancelled:
            self._cancelled.discard(heapq.heappop(self._timers)[1])
        return self._timers[0][0] if self._timers else NEVER

    def fire_next(self) -> None:
        at, _, action = heapq.heappop(self._timers)
        self.now = max(self.now, at)
        action()

    def advance(self, until: float) -> None:
        """Move the clock to ``until``, firing timers on the way."""
        while self.next_timer() <= until:
            self.fire_next()
        self.now = max(self.now, until)
