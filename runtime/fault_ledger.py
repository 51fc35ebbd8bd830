"""What each fault cost: detection time, recovery time, committed steps lost.

- ``ft/detect_s``: from the signal to the coordinator noticing the failure (a closed connection, an agent's report,
  or a missed heartbeat for a hang).
- ``ft/recover_s``: from the signal to the next committed step after recovery.
- ``ft/lost_steps``: committed steps whose work was thrown away (the step the failure found committed minus the
  step training resumed from). The iteration in flight is never counted: no policy can keep it.

Faults that no injector fired (a real crash) are measured from the moment they were noticed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class FaultRecord:
    kind: str
    workers: frozenset[int]
    fired_at: float | None
    noticed_at: float | None = None
    committed_step: int | None = None
    resumed_step: int | None = None
    recovered_at: float | None = None
    transfer_bytes: int = 0

    @property
    def detect_s(self) -> float | None:
        if self.fired_at is None or self.noticed_at is None:
            return None
        return self.noticed_at - self.fired_at

    @property
    def recover_s(self) -> float | None:
        start = self.fired_at if self.fired_at is not None else self.noticed_at
        if start is None or self.recovered_at is None:
            return None
        return self.recovered_at - start

    @property
    def lost_steps(self) -> int | None:
        if self.committed_step is None or self.resumed_step is None:
            return None
        return self.committed_step - self.resumed_step


class FaultLedger:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # the injector thread adds, the trainer's thread reads
        self.records: list[FaultRecord] = []

    def fired(self, kind: str, workers: tuple[int, ...], at: float) -> None:
        with self._lock:
            self.records.append(FaultRecord(kind, frozenset(workers), at))

    def noticed(self, workers: set[int], at: float) -> list[FaultRecord]:
        """Attach a failure to the faults that caused it; a failure nobody injected gets a record of its own."""
        with self._lock:
            matched = [r for r in self.records if r.noticed_at is None and r.workers & workers]
            if not matched:
                matched = [FaultRecord("unplanned", frozenset(workers), None)]
                self.records.append(matched[0])
            for record in matched:
                record.noticed_at = at
            return matched

    def resumed(self, records: list[FaultRecord], committed: int, resumed: int) -> None:
        for record in records:
            record.committed_step, record.resumed_step = committed, resumed

    def transferred(self, nbytes: int) -> None:
        """Layer bytes copied to recover from the faults now in recovery (split evenly among them)."""
        with self._lock:
            open_records = [r for r in self.records if r.noticed_at is not None and r.recovered_at is None]
            for record in open_records:
                record.transfer_bytes += nbytes // len(open_records)

    def recovered(self, at: float) -> list[FaultRecord]:
        """Mark every fault waiting for a committed step as recovered; returns them."""
        with self._lock:
            done = [r for r in self.records if r.noticed_at is not None and r.recovered_at is None]
            for record in done:
                record.recovered_at = at
            return done
