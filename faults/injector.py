"""The fault injector: fires a schedule's events as real signals to real processes.

- Time events fire from one injector thread at their time (seconds since training started), wherever the
  iteration is. The thread lives as long as the job, because a node it starts is tied to it by PR_SET_PDEATHSIG.
- Step events without a phase fire when the coordinator is about to start that step.
- Step events with a phase are armed on the target worker, which stops at the start of that phase and reports
  AtPhase; the injector then kills it there. So "kill a node during the gradient reduction of step 7" happens
  exactly then, which tests need. Arms are sent again after every reconfiguration, since restarted workers are
  new processes.

Every fired event goes to ``events.jsonl`` with its wall time, kind and target, and to ``on_fault`` so the trainer
can measure detection and recovery from the moment of the kill.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from faults.schedules import FaultEvent
from runtime import messages as msg
from runtime.cluster import LocalCluster


@dataclass(frozen=True)
class Fired:
    event: FaultEvent
    at: float
    """time.monotonic() of the signal."""
    workers: tuple[int, ...]
    """The workers the fault took down (none for a join)."""


class Injector:
    def __init__(
        self,
        events: list[FaultEvent],
        cluster: LocalCluster,
        record: Callable[..., None],
        on_fault: Callable[[Fired], None],
    ) -> None:
        self.cluster = cluster
        self.record = record
        self.on_fault = on_fault
        self._timed = sorted((e for e in events if e.at_time_s is not None), key=lambda e: e.at_time_s or 0.0)
        self._stepped = [e for e in events if e.at_step is not None and e.phase is None]
        self._phased = [e for e in events if e.phase is not None]
        self._armed: dict[int, FaultEvent] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- clocks ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Training starts now: time events count from here."""
        started = time.monotonic()
        self._thread = threading.Thread(target=self._run_timed, args=(started,), daemon=True, name="fault-injector")
        self._thread.start()

    def _run_timed(self, started: float) -> None:
        for event in self._timed:
            delay = started + (event.at_time_s or 0.0) - time.monotonic()
            if self._stop.wait(max(0.0, delay)):
                return
            self.fire(event)
        self._stop.wait()  # keep the thread, and so the nodes it started, alive until the job ends

    def before_step(self, step: int) -> None:
        for event in [e for e in self._stepped if e.at_step == step]:
            self._stepped.remove(event)
            self.fire(event)

    def arm(self) -> None:
        """Arm every phase event not yet fired on its target (after each (re)configuration)."""
        self._armed.clear()
        for event in self._phased:
            worker = self._target_worker(event)
            if worker in self.cluster.alive_workers():
                self._armed[worker] = event
                self.cluster.send(worker, msg.ArmFault(event.at_step or 0, event.phase or ""))

    def at_phase(self, worker: int, message: msg.AtPhase) -> None:
        event = self._armed.pop(worker, None)
        if event is not None and event in self._phased:
            self._phased.remove(event)
            self.fire(event)

    def stop(self) -> None:
        self._stop.set()

    # -- firing ------------------------------------------------------------------------------------------------
    def _target_worker(self, event: FaultEvent) -> int:
        return self.cluster.workers_of(event.node)[event.worker or 0]

    def fire(self, event: FaultEvent) -> None:
        with self._lock:
            if event.kind == "join":
                self.cluster.start_node(event.node)
                if event.at_step is not None:
                    # "Joins at step k" means: is up by step k, whatever this machine's start-up time.
                    self.cluster.wait_for_workers(set(self.cluster.workers_of(event.node)), timeout_s=300)
                fired = Fired(event, time.monotonic(), ())
            elif event.kind == "node":
                if event.node not in self.cluster.alive_nodes():
                    self.record("fault_skipped", reason="node already dead", fault=event.to_dict())
                    return
                fired = Fired(event, time.monotonic(), tuple(self.cluster.workers_of(event.node)))
                self.cluster.kill_node(event.node)
            else:
                worker = self._target_worker(event)
                if worker not in self.cluster.alive_workers():
                    self.record("fault_skipped", reason="worker already dead", fault=event.to_dict())
                    return
                fired = Fired(event, time.monotonic(), (worker,))
                self.cluster.kill_worker(worker, signal.SIGSTOP if event.kind == "hang" else signal.SIGKILL)
            self.record("fault_injected", workers=list(fired.workers), fault=event.to_dict())
        self.on_fault(fired)
