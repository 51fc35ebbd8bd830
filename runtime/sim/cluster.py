"""The simulated cluster: who is alive, what each worker holds, and when the coordinator notices a failure.

It is the fault injector's target (``FaultTarget``): kills, hangs and joins change it at once, and the coordinator
learns of them by the local runtime's rules: a killed worker or node is noticed ``sim.detect_s`` after the kill (a
closed connection), a hung worker after ``cluster.heartbeat_timeout_s`` of silence (then fenced); after the first
notice the coordinator waits ``sim.failure_window_s`` for the rest of the failure. A worker that is dead or hung
blocks whatever waits for it, so the wait lasts until its failure is noticed (``wait``).

A join starts a node beside training, as on the runtime: its workers register ``sim.node_start_s`` plus their
processes' start (``SimMachine.start_s``) later, and the node is offered (``joined``) at the first iteration boundary
after that; until then it is in no membership, so no plan, restart or wait counts on it and the clock never stops for
it. A joining node killed before it is offered is given up (``NodeLostWhileStarting``), no failure of the job.
"""

from __future__ import annotations

from collections.abc import Callable

from ftlab.runtime.control import events as ev
from ftlab.runtime.control.backend import Failure, FaultTarget, Interrupted, Membership
from ftlab.runtime.sim.clock import NEVER, Clock
from ftlab.runtime.sim.machines import SimMachine


class HorizonReached(Exception):
    """The simulated clock reached ``sim.horizon_s``: the job ends there."""


class SimCluster(FaultTarget):
    def __init__(
        self, nodes: int, workers_per_node: int, machine: SimMachine, heartbeat_timeout_s: float, bus: ev.EventBus,
        clock: Clock, lose_writer: Callable[[int], None], lose_memory: Callable[[int], None],
    ) -> None:  # fmt: skip
        self.workers_per_node = workers_per_node
        self.machine = machine
        self.sim = machine.sim
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.bus = bus
        self.clock = clock
        self.horizon = NEVER if self.sim.horizon_s is None else self.sim.horizon_s
        self.lose_writer = lose_writer
        """Called when a worker dies: the snapshot copy it was writing dies with it."""
        self.lose_memory = lose_memory
        """Called when a node dies: its host memory, every record in it, is gone."""
        self.nodes: set[int] = set(range(nodes))
        """Nodes whose agent is alive."""
        self.joining: dict[int, float] = {}
        """Nodes started and not offered yet (alive agents outside the membership), and when their workers
        register."""
        self.alive: set[int] = {w for n in range(nodes) for w in self.workers_of(n)}
        self.held: dict[int, set[int]] = {w: set() for w in self.alive}
        """The layers each live worker holds."""
        self.dead_unnoticed: dict[int, float] = {}
        """Dead workers nobody has noticed yet, and when the coordinator will."""
        self.nodes_unnoticed: dict[int, float] = {}
        self.hung: dict[int, float] = {}
        """Hung workers (alive to everyone) and when their silence is noticed."""
        self.armed: dict[int, tuple[int, str]] = {}
        """Phase faults: worker -> (step, phase) where it stops."""
        self._membership: Membership | None = None

    # -- who is who --------------------------------------------------------------------------------------------
    def workers_of(self, node: int) -> list[int]:
        return list(range(node * self.workers_per_node, (node + 1) * self.workers_per_node))

    def node_of(self, worker: int) -> int:
        return worker // self.workers_per_node

    def alive_nodes(self) -> list[int]:
        return sorted(self.nodes)

    def alive_workers(self) -> list[int]:
        return sorted(self.alive)

    def membership(self) -> Membership:
        if self._membership is None:
            slots = {n: tuple(self.workers_of(n)) for n in sorted(self.members())}
            alive = self.alive
            workers = {n: ws if alive.issuperset(ws) else tuple(w for w in ws if w in alive) for n, ws in slots.items()}
            self._membership = Membership(
                workers_of_node={n: ws for n, ws in workers.items() if ws}, slots_of_node=slots
            )
        return self._membership

    def members(self) -> set[int]:
        """Live nodes that are members: every live node but those still joining."""
        return self.nodes - self.joining.keys() if self.joining else self.nodes

    def changed(self) -> None:
        self._membership = None

    def restart(self) -> None:
        """Every member node's worker processes ended and started fresh, holding nothing (joining nodes start on)."""
        workers = [w for n in sorted(self.members()) for w in self.workers_of(n)]
        self.alive = set(workers)
        self.held = {w: set() for w in workers}
        self.hung.clear()  # every worker process is ended, hung ones too
        self.changed()

    def joined(self) -> list[int]:
        """The joining nodes whose workers have registered by now, each offered once: members from here on."""
        now = self.clock.now
        ready = sorted(n for n, registered in self.joining.items() if registered <= now)
        for node in ready:
            del self.joining[node]
            for worker in self.workers_of(node):
                self.alive.add(worker)
                self.held[worker] = set()
        if ready:
            self.changed()
        return ready

    # -- faults (the injector's side) --------------------------------------------------------------------------
    def kill_node(self, node: int) -> None:
        if node not in self.nodes:
            return
        self.nodes.discard(node)
        if self.joining.pop(node, None) is not None:  # in no plan yet: given up, the job goes on
            self.bus.publish(ev.NodeLostWhileStarting(at=self.clock.now, node=node, reason="killed while it started"))
            return
        self.lose_memory(node)
        noticed = self.clock.now + self.sim.detect_s
        self.nodes_unnoticed[node] = noticed
        self.changed()
        for worker in self.workers_of(node):
            self.hung.pop(worker, None)
            if worker in self.alive:
                self.lose(worker, noticed)

    def kill_worker(self, worker: int) -> None:
        if worker in self.alive:
            self.hung.pop(worker, None)
            self.lose(worker, self.clock.now + self.sim.detect_s)

    def hang_worker(self, worker: int) -> None:
        if worker in self.alive and worker not in self.hung:
            self.hung[worker] = self.clock.now + self.heartbeat_timeout_s

    def resume_worker(self, worker: int) -> None:
        """A stall ends before its hang was noticed: the waits it held go on from now. Operations timing out on it
        (``cluster.comm_timeout_s``) are not simulated: the stall costs its length, as it does under the defaults."""
        self.hung.pop(worker, None)

    def start_node(self, node: int) -> None:
        """The node boots beside training: the clock goes on, and ``joined`` offers it once its workers are up."""
        self.nodes.add(node)
        self.joining[node] = self.clock.now + self.sim.node_start_s + self.machine.start_s(self.workers_per_node)

    def arm(self, worker: int, step: int, phase: str) -> None:
        self.armed[worker] = (step, phase)

    def lose(self, worker: int, noticed: float) -> None:
        """``worker`` is dead; the coordinator notices at ``noticed``."""
        self.alive.discard(worker)
        self.held.pop(worker, None)
        self.lose_writer(worker)
        self.dead_unnoticed[worker] = noticed
        self.changed()

    # -- noticing failures -------------------------------------------------------------------------------------
    def wait(
        self, until: float, needs: set[int] | frozenset[int], interrupted: Callable[[], bool] = lambda: False
    ) -> Failure | Interrupted | None:
        """Move the clock to ``until`` unless a failure is noticed first (then: that failure, the clock at its
        notice plus the failure window), or Interrupted as soon as ``interrupted`` answers True (asked first, and
        again after each timer fires). A dead or hung worker of ``needs`` holds the wait until it is noticed."""
        clock = self.clock
        while True:
            if interrupted():
                return Interrupted()
            blocked = any(w in needs for w in self.hung) or any(w in needs for w in self.dead_unnoticed)
            end = NEVER if blocked else until
            notice = min([*self.dead_unnoticed.values(), *self.hung.values()], default=NEVER)
            timer = clock.next_timer()
            if min(notice, timer, end) == NEVER and self.horizon == NEVER:
                raise RuntimeError("the simulation waits for something that never happens")
            if min(notice, timer, end) > self.horizon:
                clock.now = max(clock.now, self.horizon)
                raise HorizonReached(f"the simulated clock reached sim.horizon_s={self.horizon:g}")
            if notice <= timer and notice <= end:
                clock.now = max(clock.now, notice)
                return self._gather()
            if timer <= end:
                clock.fire_next()
                continue
            clock.now = max(clock.now, end)
            return None

    def _gather(self) -> Failure:
        """The failure noticed now, with every other sign that arrives within the failure window."""
        end = self.clock.now + self.sim.failure_window_s
        self.clock.advance(end)
        failure = Failure()
        for worker, noticed in sorted(self.hung.items()):
            if noticed <= end:
                self.bus.publish(ev.HangDetected(at=noticed, worker=worker, timeout_s=self.heartbeat_timeout_s))
                del self.hung[worker]
                self.lose(worker, noticed)  # fenced: a hung worker must never come back
        for node, noticed in list(self.nodes_unnoticed.items()):
            if noticed <= end:
                failure.nodes[node] = self.nodes_unnoticed.pop(node)
        for worker, noticed in list(self.dead_unnoticed.items()):
            if noticed <= end:
                failure.workers[worker] = self.dead_unnoticed.pop(worker)
        return failure
