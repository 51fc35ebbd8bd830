"""The fault injector: fires a schedule's events on a backend's machines (real signals on real processes locally).

- Time events fire at their time (seconds since training started), wherever the iteration is. On real processes
  they fire from one injector thread on the wall clock; the thread lives as long as the job, because a node it
  starts is tied to it by PR_SET_PDEATHSIG. A backend with a clock of its own (the simulator) passes ``clock`` and
  ``schedule``: the events are then handed to its timers and fire in its time.
- Step events without a phase fire when the coordinator is about to start that step.
- A join (``kind: join``) starts the node at its time or step and returns at once: the node boots in the
  background while training goes on, and the coordinator offers it to the policy at the first iteration boundary
  after its workers have registered (``Backend.joined``). "Joins at step k" means "starts at step k", as a
  replacement node on a real cluster boots for minutes beside the job it joins.
- A warned preemption (``warning_s``) is announced when it fires (``PreemptionWarned``; the coordinator asks the
  policy at the next iteration boundary, or at once for a policy that heeds warnings at once) and the node is killed
  ``warning_s`` later on the backend's clock, from a timer (the simulator's own timers where it has them), whatever
  the policy did meanwhile.
- A hang with ``for_s`` (a stall) resumes its worker ``for_s`` after it stopped it, from a timer like a warned
  preemption's kill; a worker fenced meanwhile stays dead.
- Step events with a phase are armed on the target worker, which stops at the start of that phase and reports it;
  the injector then kills it there. So "kill a node during the gradient reduction of step 7" happens exactly then,
  which tests need. Arms are sent again after every configuration, since restarted workers are new processes.

The injector follows the job's event stream (step starts, configured plans, workers stopped at a phase) and
publishes every fault it fires, with the time taken just before the signal, so detection and recovery are measured
from the moment of the kill.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ftlab.faults.schedules import FaultEvent
from ftlab.runtime.control import events as ev
from ftlab.runtime.control.backend import FaultTarget


Schedule = Callable[[float, Callable[[], None]], object]
"""Run a callable at a time of the backend's clock (``SimBackend.call_at``)."""


class Injector:
    def __init__(
        self,
        events: list[FaultEvent],
        target: FaultTarget,
        bus: ev.EventBus,
        clock: Callable[[], float] = time.monotonic,
        schedule: Schedule | None = None,
    ) -> None:
        self.target = target
        self.bus = bus
        self.clock = clock
        """The backend's clock: fault times are taken from it."""
        self.schedule = schedule
        self._started = False
        self._timed = sorted((e for e in events if e.at_time_s is not None), key=lambda e: e.at_time_s or 0.0)
        self._stepped = [e for e in events if e.at_step is not None and e.phase is None]
        self._phased = [e for e in events if e.phase is not None]
        self._pending = list(events)
        """Not fired yet (fired or skipped events leave it): what the job ends without, see ``pending``."""
        self._armed: dict[int, FaultEvent] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timers: list[threading.Timer] = []
        """The kills of warned preemptions and the ends of stalls, pending on the wall clock."""
        self._thread: threading.Thread | None = None
        bus.subscribe(self.on_event)

    def on_event(self, event: ev.Event) -> None:
        match event:
            case ev.StepStarting(step=step):
                if not self._started:
                    self._start()
                for fault in [e for e in self._stepped if e.at_step == step]:
                    self._stepped.remove(fault)
                    self.fire(fault)
            case ev.PlanConfigured():
                self._arm()
            case ev.WorkerAtPhase(worker=worker):
                fault = self._armed.pop(worker, None)
                if fault is not None and fault in self._phased:
                    self._phased.remove(fault)
                    self.fire(fault)

    # -- clocks ------------------------------------------------------------------------------------------------
    def _start(self) -> None:
        """Training starts now: time events count from here."""
        self._started = True
        started = self.clock()
        if self.schedule is not None:
            for fault in self._timed:
                self.schedule(started + (fault.at_time_s or 0.0), lambda fault=fault: self.fire(fault))
            return
        self._thread = threading.Thread(target=self._run_timed, args=(started,), daemon=True, name="fault-injector")
        self._thread.start()

    def _run_timed(self, started: float) -> None:
        for fault in self._timed:
            delay = started + (fault.at_time_s or 0.0) - self.clock()
            if self._stop.wait(max(0.0, delay)):
                return
            self.fire(fault)
        self._stop.wait()  # keep the thread, and so the nodes it started, alive until the job ends

    def _arm(self) -> None:
        """Arm every phase event not yet fired on its target (after each configuration)."""
        self._armed.clear()
        alive = set(self.target.alive_workers())
        for fault in self._phased:
            worker = self._target_worker(fault)
            if worker in alive:
                self._armed[worker] = fault
                self.target.arm(worker, fault.at_step or 0, fault.phase or "")

    def stop(self) -> None:
        self._stop.set()
        for timer in self._timers:
            timer.cancel()

    def pending(self) -> list[FaultEvent]:
        """The events that have not fired (the job ended first, or never entered their phase)."""
        with self._lock:
            return list(self._pending)

    # -- firing ------------------------------------------------------------------------------------------------
    def _target_worker(self, fault: FaultEvent) -> int:
        return self.target.workers_of(fault.node)[fault.worker or 0]

    def fire(self, fault: FaultEvent) -> None:
        if fault.warning_s is not None:
            self._warn(fault)
            return
        # Published after the lock is released: the coordinator's thread may hold the event bus and wait for it.
        self.bus.publish(self._cause(fault))

    def _warn(self, fault: FaultEvent) -> None:
        """Give notice of a preemption now and kill the node when its grace period ends."""
        if fault.node not in self.target.alive_nodes():
            with self._lock:
                self._pending.remove(fault)
            self.bus.publish(ev.FaultSkipped(at=self.clock(), fault=fault.to_dict(), reason="node already dead"))
            return
        at, grace = self.clock(), fault.warning_s or 0.0
        self._later(at + grace, lambda: self.bus.publish(self._cause(fault)))
        self.bus.publish(ev.PreemptionWarned(at=at, fault=fault.to_dict(), nodes=(fault.node,), grace_s=grace))

    def _later(self, at: float, action: Callable[[], None]) -> None:
        """Run ``action`` at ``at`` on the backend's clock: on its own timers where it has them, else the wall's."""
        if self.schedule is not None:
            self.schedule(at, action)
            return
        timer = threading.Timer(max(0.0, at - self.clock()), action)
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _cause(self, fault: FaultEvent) -> ev.Event:
        with self._lock:
            if fault in self._pending:
                self._pending.remove(fault)
            if fault.kind == "join":
                self.target.start_node(fault.node)  # returns at once: the node boots beside training
                return self._injected(self.clock(), fault, ())
            if fault.kind == "node":
                if fault.node not in self.target.alive_nodes():
                    return ev.FaultSkipped(at=self.clock(), fault=fault.to_dict(), reason="node already dead")
                at, workers = self.clock(), tuple(self.target.workers_of(fault.node))
                self.target.kill_node(fault.node)
                return self._injected(at, fault, workers)
            worker = self._target_worker(fault)
            if worker not in self.target.alive_workers():
                return ev.FaultSkipped(at=self.clock(), fault=fault.to_dict(), reason="worker already dead")
            at = self.clock()
            if fault.kind == "hang":
                self.target.hang_worker(worker)
                if fault.for_s is not None:
                    self._later(at + fault.for_s, lambda: self.target.resume_worker(worker))
            else:
                self.target.kill_worker(worker)
            return self._injected(at, fault, (worker,))

    @staticmethod
    def _injected(at: float, fault: FaultEvent, workers: tuple[int, ...]) -> ev.FaultInjected:
        return ev.FaultInjected(at=at, fault=fault.to_dict(), fault_kind=fault.kind, workers=workers)
