"""What each fault cost, read off the event stream: detection time, recovery time, committed steps lost.

- ``ft/detect_s``: from the signal to the coordinator noticing the failure (a closed connection, an agent's report,
  or a missed heartbeat for a hang).
- ``ft/recover_s``: from the signal to the next committed step after recovery.
- ``ft/lost_steps``: committed steps whose work was thrown away (the step the failure found committed minus the
  step training resumed from). The iteration in flight is never counted: no policy can keep it.
- ``ft/transfer_bytes``: layer state copied between workers to recover.

Faults that no injector fired (a real crash) are measured from the moment they were noticed. When the first step
after a fault commits, the ledger publishes a ``Recovered`` event with the fault's figures.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ftlab.runtime.control import events as ev


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
    def __init__(self, bus: ev.EventBus) -> None:
        self.bus = bus
        self._lock = threading.Lock()  # the injector's thread adds, the coordinator's reads
        self.records: list[FaultRecord] = []
        self._waiting: list[FaultRecord] = []
        """Noticed and not yet recovered (a short list: every committed step looks at it)."""
        bus.subscribe(self.on_event)

    def on_event(self, event: ev.Event) -> None:
        match event:
            case ev.FaultInjected(fault_kind=kind, workers=workers) if workers:
                with self._lock:
                    self.records.append(FaultRecord(kind, frozenset(workers), event.at))
            case ev.FailureDetected(workers=workers, noticed_at=noticed):
                self._noticed(set(workers), noticed)
            case ev.Decided(committed_step=committed, resume_step=resumed) if resumed is not None:
                for record in self._open():  # each fault resumes with the first decision after it was noticed
                    if record.resumed_step is None:
                        record.committed_step, record.resumed_step = committed, resumed
            case ev.LayersCopied(nbytes=nbytes):
                open_records = self._open()
                for record in open_records:
                    record.transfer_bytes += nbytes // len(open_records)
            case ev.StepCommitted():
                self._recovered(event.at)

    def _open(self) -> list[FaultRecord]:
        """Faults noticed and not yet recovered from."""
        with self._lock:
            return [r for r in self._waiting if r.recovered_at is None]

    def _noticed(self, workers: set[int], at: float) -> None:
        """Attach a failure to the faults that caused it; a failure nobody injected gets a record of its own."""
        with self._lock:
            matched = [r for r in self.records if r.noticed_at is None and r.workers & workers]
            if not matched:
                matched = [FaultRecord("unplanned", frozenset(workers), None)]
                self.records.append(matched[0])
            for record in matched:
                record.noticed_at = at
                self._waiting.append(record)

    def _recovered(self, at: float) -> None:
        """Every fault waiting for a committed step is recovered now."""
        recovered = self._open()
        with self._lock:
            self._waiting.clear()
        for record in recovered:
            record.recovered_at = at
            self.bus.publish(
                ev.Recovered(
                    at=at, fault=self._index(record), fault_kind=record.kind, detect_s=record.detect_s,
                    recover_s=record.recover_s, lost_steps=record.lost_steps, transfer_bytes=record.transfer_bytes,
                )
            )  # fmt: skip

    def _index(self, record: FaultRecord) -> int:
        """Where ``record`` is in ``records``, found by identity (two faults may have equal fields) and from the end,
        where the faults being recovered from are (a day of a thousand GPUs has hundreds of records)."""
        with self._lock:
            return next(i for i in range(len(self.records) - 1, -1, -1) if self.records[i] is record)
