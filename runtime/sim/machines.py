"""The machine models: what a job's work costs on its platform, for the simulator's charges and the policies'
predictions alike (``runtime.core.machine.Machine``).

Two platforms, one class each:
- ``DeviceMachine``: one device per worker and a host per node (GPU clusters). A step is the plan's programs on the
  profile's per-layer costs, each pipeline on its own devices; a snapshot's copy runs on a copy engine beside the
  computation; a node's workers start on their own host; layers move as device tensors, so building and encoding
  them cost nothing beyond the links' and the storage's bandwidths.
- ``SharedHostMachine``: every worker a process on one host of a few cores (the local runtime on one machine). The
  processes share the cores (``runtime.sim.shared_host``): a step, its snapshot copies and a checkpoint's encoding
  take cores from one another, processes that start or configure together slow each other, and the runtime's own
  costs per layer, per message and per byte of layer state are charged as measured (``conf/sim``).

``machine_for`` chooses once, from the cluster: a shared host where the workers are processes of the local launcher
computing on this machine's CPU; a device per worker everywhere else (CUDA, a GPU type of ``runtime.core.devices``,
or hosts of their own through the ssh and SLURM launchers). Nothing else in the project makes that choice.

What both share (``SimMachine``): a recovery's pause and a step's time, composed from what differs. The simulated
backend charges a configuration with ``configuring`` and a restart with ``restart_s``; ``pause_s`` adds the same
parts up for a policy that predicts, so the two agree by construction (``tests/test_machines.py``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from ftlab.runtime.core import instructions as ins
from ftlab.runtime.core.config import ClusterConfig, SimConfig
from ftlab.runtime.core.contract import MemoryRecord, MemorySource, Source, StorageSource
from ftlab.runtime.core.costs import CostModel
from ftlab.runtime.core.machine import Machine
from ftlab.runtime.core.model_spec import FP32
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.core.program_check import timeline
from ftlab.runtime.core.scheduler import storage_read_chains, transfer_programs
from ftlab.runtime.core.snapshot_layout import Fetch, load_plan
from ftlab.runtime.sim.shared_host import HostCores, contention_on, host_of, shared_ends
from ftlab.runtime.sim.timing import IterationTimer, IterationTiming

if TYPE_CHECKING:
    from ftlab.runtime.core.contract import Change, Decision, Job

INFINITE = float("inf")


@dataclass(frozen=True)
class Configuring:
    """What configuring a plan costs, from the moment every worker it needs is free."""

    configure_s: float
    """Programs, process groups and buffers, before any layer moves."""
    layers_s: float
    """Then the slowest worker's layers: received (copied from a live worker), decoded, built; and the restore."""
    restore_s: float
    """Of ``layers_s``: reading what the workers restore from saved state."""
    gaining: tuple[int, ...]
    """Workers that lack some layer of their stage."""
    received: Mapping[int, list[int]] = field(default_factory=dict)
    restored: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    unprovided: tuple[int, int] | None = None
    """A (worker, layer) that nothing provides: no transfer, no saved state."""

    @property
    def seconds(self) -> float:
        return self.configure_s + self.layers_s


SourceCost = Callable[[Source, Mapping[int, tuple[int, ...]], "SimMachine", Plan, Sequence[int]], float]
_SOURCES: dict[type[Source], SourceCost] = {}


def register_source(kind: type[Source], cost: SourceCost) -> None:
    """Teach the machines what restoring from a kind of saved state costs: ``cost(source, readers, machine, plan,
    serving)`` seconds, ``readers`` mapping each worker to the layers it restores on ``plan`` and ``serving`` the
    live workers outside it (which serve their nodes' memory)."""
    _SOURCES[kind] = cost


class SimMachine(Machine):
    """What both platforms compose their answers from; subclasses say what differs."""

    codec_bytes_per_s: float
    """Encoding or decoding layer state for a copy or a checkpoint."""
    build_bytes_per_s: float
    """Building a layer's weights and optimizer state on a worker that did not hold it."""
    copies_take_compute: bool
    """A snapshot's copies slow the iteration they overlap (``overlapped`` times it); otherwise they run beside it
    untouched, each at ``copy_bytes_per_s``."""

    def __init__(self, costs: CostModel, sim: SimConfig, timer: IterationTimer) -> None:
        self.costs = costs
        self.sim = sim
        self.timer = timer

    # -- what differs ------------------------------------------------------------------------------------------
    @abstractmethod
    def contention(self, at_once: int) -> float:
        """How much slower each of ``at_once`` processes started, configured or copying together is than one
        alone."""

    @abstractmethod
    def restarting(self, slots_of_node: Mapping[int, tuple[int, ...]]) -> int:
        """How many worker processes start together on one host when every live node's workers restart."""

    @abstractmethod
    def overlapped(self, plan: Plan, programs: Mapping[int, ins.Program], copies_s: Mapping[int, float]
                   ) -> IterationTiming | None:  # fmt: skip
        """An iteration with snapshot copies beside it (each worker's in seconds alone) where the copies take its
        resources: the timing with each copy's end; None where a copy leaves the iteration alone."""

    @abstractmethod
    def save_beside_copies(self, seconds: float, cpu_s: Mapping[int, float], copies: Sequence[tuple[float, int]]
                           ) -> tuple[float, list[float] | None]:  # fmt: skip
        """A save of ``seconds`` whose writers spend ``cpu_s`` each, with snapshot copies in flight beside it (each
        copy's seconds left per writer and its number of writers): the save's seconds, and when each copy then ends
        from now (None: the copies are not slowed)."""

    # -- shared ----------------------------------------------------------------------------------------------------
    def iteration(self, plan: Plan, programs: Mapping[int, ins.Program]) -> IterationTiming:
        return self.timer.time(plan, programs)

    def start_s(self, at_once: int) -> float:
        """Starting ``at_once`` worker processes together on one host until they register."""
        return self.sim.process_start_s * self.contention(at_once)

    def restart_s(self, slots_of_node: Mapping[int, tuple[int, ...]]) -> float:
        """Every live node's workers started again."""
        return self.start_s(self.restarting(slots_of_node))

    def copy_bytes_per_s(self, at_once: int) -> float:
        """One worker's copy into or out of its node's memory while ``at_once`` workers copy."""
        return self.sim.snapshot_bytes_per_s / self.contention(at_once)

    def configuration_s(self, plan: Plan) -> float:
        """Configuring ``plan`` before any layer moves: the slowest worker's own configuration (``sim.configure_s``)
        and ``sim.configure_group_s`` for each gradient reduce group it is in, every worker of the plan at once."""
        group_of = {layer: i for i, (_, layers) in enumerate(plan.reduction_groups()) for layer in layers}
        # Workers of one range of layers are in the same groups.
        groups = [len({group_of[i] for i in range(*held) if i in group_of}) for held in plan.workers_by_range()]
        own = self.sim.configure_s + self.sim.configure_group_s * max(groups, default=0)
        return own * self.contention(len(plan.workers))

    def checkpoint_bytes(self, layers: Iterable[int]) -> float:
        """What a checkpoint, a restore or a transfer of ``layers`` (layer indices) carries."""
        return sum(map(self._layer_checkpoint_bytes.__getitem__, layers))

    @cached_property
    def _layer_checkpoint_bytes(self) -> tuple[float, ...]:
        # A restart at 16,384 GPUs asks for millions of layers' bytes: a lookup each, not a cost-model call.
        return tuple(self.costs.checkpoint_bytes(layer, layer + 1) for layer in range(self.costs.num_layers))

    def numel(self, layers: tuple[int, ...]) -> int:
        """Parameters of ``layers`` (a snapshot's geometry is in float32 elements)."""
        return int(sum(self.costs.profile.layers[layer].param_bytes for layer in layers)) // FP32

    def copies_ready_s(self, plan: Plan, programs: Mapping[int, ins.Program], copies_s: Mapping[int, float]) -> float:
        """From a step's start until every worker has reduced and finished its snapshot copy (a writer reports ready
        once both are done)."""
        overlapped = self.overlapped(plan, programs, copies_s) if self.copies_take_compute else None
        if overlapped is not None:
            return max(overlapped.ready_s, *overlapped.copy_end.values())
        return max(self.iteration(plan, programs).ready_s, *copies_s.values())

    def period_s(self, timing: IterationTiming) -> float:
        """A step of ``timing`` with nothing beside it: until every worker has reduced, the commit, the slowest
        optimizer step."""
        return timing.ready_s + self.sim.control_s + timing.optimizer_s

    def step_s(self, plan: Plan, programs: Mapping[int, ins.Program], snapshot: Mapping[int, int] | None = None,
               every: int = 1) -> float:  # fmt: skip
        timing = self.iteration(plan, programs)
        plain = self.period_s(timing)
        if not snapshot:
            return plain
        copies_s = {worker: nbytes / self.sim.snapshot_bytes_per_s for worker, nbytes in snapshot.items()}
        ready = self.copies_ready_s(plan, programs, copies_s)
        return plain + (ready - timing.ready_s + self.sim.snapshot_launch_s) / max(1, every)

    def configuring(
        self, plan: Plan, transfers: Mapping[int, ins.Program], restore: Source | None,
        held: Mapping[int, Set[int]], serving: Sequence[int],
    ) -> Configuring:  # fmt: skip
        """Configuring ``plan`` on workers that hold ``held``, with layer copies ``transfers`` (their programs) and
        what they still lack restored from ``restore`` (``serving``: live workers outside the plan)."""
        arrival, received = self._transfer_times(transfers)
        restored: dict[int, tuple[int, ...]] = {}
        unprovided: tuple[int, int] | None = None
        slowest = 0.0
        gaining = []
        nothing: frozenset[int] = frozenset()
        for worker, (start, stop) in plan.layer_ranges().items():
            have = held.get(worker, nothing)
            if have.issuperset(range(start, stop)):
                continue  # holds its stage already: nothing to build, receive or restore
            gaining.append(worker)
            new = set(range(start, stop)) - have
            missing = new - set(received.get(worker, ()))
            if missing and restore is None and unprovided is None:
                unprovided = (worker, min(missing))
            if missing and restore is not None:
                restored[worker] = tuple(sorted(missing))
            decoded = self.checkpoint_bytes(received.get(worker, ())) / self.codec_bytes_per_s
            built = self.checkpoint_bytes(new) / self.build_bytes_per_s
            slowest = max(slowest, arrival.get(worker, 0.0) + decoded + built)
        reading = self.restore_s(restore, restored, plan, serving) if restored else 0.0
        return Configuring(self.configuration_s(plan), slowest + reading, reading, tuple(gaining), received, restored,
                           unprovided)  # fmt: skip

    def restore_s(self, source: Source | None, readers: Mapping[int, tuple[int, ...]], plan: Plan,
                  serving: Sequence[int]) -> float:  # fmt: skip
        assert source is not None
        cost = _SOURCES.get(type(source))
        if cost is None:
            raise NotImplementedError(
                f"the simulator has no cost for restoring from {type(source).__name__}: register one with "
                f"runtime.sim.machines.register_source"
            )
        return cost(source, readers, self, plan, serving)

    def pause_s(self, decision: Decision, change: Change, job: Job) -> float:
        """As the simulated backend charges it: the failure noticed and the iteration aborted, the processes
        restarted, then the plan configured (``configuring``) on what the survivors hold."""
        sim = self.sim
        seconds = sim.detect_s + sim.failure_window_s + sim.abort_s if change.is_failure else 0.0
        if decision.restart:
            seconds += self.restart_s(job.slots_of_node)
            held: Mapping[int, Set[int]] = {}
            live = job.slots
        else:
            held = {worker: frozenset(layers) for worker, layers in change.holdings.items()}
            live = job.workers
        plan = decision.plan
        inside = set(plan.workers)
        serving = [worker for worker in live if worker not in inside]
        transfers = transfer_programs(decision.transfers)
        return seconds + self.configuring(plan, transfers, decision.restore, held, serving).seconds

    def _transfer_times(self, transfers: Mapping[int, ins.Program]) -> tuple[dict[int, float], dict[int, list[int]]]:
        """When each worker has received its layers, and which layers it receives. A worker's sends go out one after
        another on its link, so the k-th arrives after the first k layers' bytes."""
        if not transfers:
            return {}, {}
        sent: dict[tuple[int, int, int], float] = {}
        for worker, program in transfers.items():
            busy = 0.0
            for instruction in program:
                if isinstance(instruction, ins.SendLayer):
                    busy += self.costs.transfer_s(instruction.layer)
                    sent[(worker, instruction.layer, instruction.peer)] = busy

        def duration(worker: int, instruction: ins.Instruction) -> float:
            if isinstance(instruction, ins.SendLayer):
                return sent[(worker, instruction.layer, instruction.peer)]
            return 0.0

        arrival: dict[int, float] = {}
        received: dict[int, list[int]] = {}
        for event in timeline(transfers, duration):
            if isinstance(event.instruction, ins.RecvLayer):
                arrival[event.worker] = max(arrival.get(event.worker, 0.0), event.end)
                received.setdefault(event.worker, []).append(event.instruction.layer)
        return arrival, received


class DeviceMachine(SimMachine):
    """One device per worker, one host per node: a node's workers start on their own host, a snapshot's copy runs on
    a copy engine beside the computation, and layers move as device tensors (no encoding or building beyond the
    bandwidths)."""

    codec_bytes_per_s = INFINITE
    build_bytes_per_s = INFINITE
    copies_take_compute = False

    def __init__(self, costs: CostModel, sim: SimConfig, workers_per_node: int) -> None:
        super().__init__(costs, sim, IterationTimer(costs, check=sim.check_programs, step_cpu_s=sim.step_cpu_s,
                                                    allreduce_cpu_bytes_per_s=sim.allreduce_cpu_bytes_per_s))
        self.workers_per_node = workers_per_node

    def contention(self, at_once: int) -> float:
        return 1.0

    def restarting(self, slots_of_node: Mapping[int, tuple[int, ...]]) -> int:
        return self.workers_per_node

    def overlapped(self, plan: Plan, programs: Mapping[int, ins.Program], copies_s: Mapping[int, float]) -> None:
        return None

    def save_beside_copies(self, seconds: float, cpu_s: Mapping[int, float], copies: Sequence[tuple[float, int]]
                           ) -> tuple[float, None]:  # fmt: skip
        return seconds, None


class SharedHostMachine(SimMachine):
    """Every worker a process on one host of ``sim.host_cores`` cores (``runtime.sim.shared_host``): processes that
    compute, copy, start or configure together share the cores, and the runtime's own costs per layer, per message
    and per byte of layer state are the measured ones of ``conf/sim``. With no cores named (``host_cores`` 0) the
    processes do not slow each other."""

    def __init__(self, costs: CostModel, sim: SimConfig) -> None:
        self.host: HostCores | None = host_of(sim)
        timer = IterationTimer(
            costs, check=sim.check_programs, cores=self.host, layer_overhead_s=sim.layer_overhead_s,
            step_cpu_s=sim.step_cpu_s, message_cpu_s=sim.message_cpu_s,
            allreduce_cpu_bytes_per_s=sim.allreduce_cpu_bytes_per_s, layer_speed=sim.host_layer_speed,
            message_cpu_own_core_s=sim.message_cpu_own_core_s,
        )  # fmt: skip
        super().__init__(costs, sim, timer)
        self.codec_bytes_per_s = sim.codec_bytes_per_s
        self.build_bytes_per_s = sim.build_bytes_per_s
        self.copies_take_compute = self.host is not None

    def contention(self, at_once: int) -> float:
        return contention_on(self.host, at_once)

    def restarting(self, slots_of_node: Mapping[int, tuple[int, ...]]) -> int:
        return sum(len(slots) for slots in slots_of_node.values())  # every process of the job, on the one host

    def overlapped(self, plan: Plan, programs: Mapping[int, ins.Program], copies_s: Mapping[int, float]
                   ) -> IterationTiming | None:  # fmt: skip
        return self.timer.time(plan, programs, copies_s) if self.host is not None else None

    def save_beside_copies(self, seconds: float, cpu_s: Mapping[int, float], copies: Sequence[tuple[float, int]]
                           ) -> tuple[float, list[float] | None]:  # fmt: skip
        """The writers' CPU and what is left of each copy share the cores, each done when its work is (the rates
        are measured alone: only the sharing slows them here)."""
        if self.host is None or not cpu_s or not copies:
            return seconds, None
        threads = [i for i, (_, writers) in enumerate(copies) for _ in range(writers)]  # a writer copies on a thread
        writing = list(cpu_s.values())
        alone = self.host.slowdown(1)
        ends = [end / alone for end in shared_ends([*writing, *(copies[i][0] for i in threads)], self.host)]
        copy_ends = [0.0] * len(copies)
        for i, end in zip(threads, ends[len(writing) :], strict=True):
            copy_ends[i] = max(copy_ends[i], end)
        return seconds - max(writing) + max(ends[: len(writing)]), copy_ends


def machine_for(cluster: ClusterConfig, sim: SimConfig, costs: CostModel) -> SimMachine:
    """The machine a job of ``cluster`` runs on: a shared host for the local launcher's processes computing on this
    machine's CPU, a device per worker otherwise."""
    if cluster.launcher == "local" and cluster.device == "cpu":
        return SharedHostMachine(costs, sim)
    return DeviceMachine(costs, sim, cluster.workers_per_node)


# -- restoring saved state -----------------------------------------------------------------------------------------
def _nic_workers(m: SimMachine) -> int:
    """How many workers share one network link: a device machine's node has one NIC for its GPUs; each process of a
    shared host has its own (its measured p2p figure is one process's)."""
    return m.workers_per_node if isinstance(m, DeviceMachine) else 1


def _network_s(m: SimMachine, sent: Mapping[int, float], received: Mapping[int, float]) -> float:
    """The busiest link's traffic, bytes ``sent`` and ``received`` per link (``worker // _nic_workers``), each
    direction on its own (full duplex), at the node's network (a measured profile's is its p2p figure), one message
    latency included."""
    busiest = max([*sent.values(), *received.values()], default=0.0)
    return m.costs.profile.latency_s + busiest / m.costs.node_network_bytes_per_s if busiest else 0.0


def _storage_read(source: Source, readers: Mapping[int, tuple[int, ...]], m: SimMachine, plan: Plan,
                  serving: Sequence[int]) -> float:  # fmt: skip
    """Restoring from a checkpoint in storage: each layer is read once, by the first worker (in worker order) that
    restores it, which decodes it and passes it on to the others restoring it, as the workers do
    (``scheduler.storage_read_chains``: a stage is read once, not once per data-parallel replica). The readers share
    the storage's bandwidth (``sim.storage_read_bytes_per_s``); the chain crosses each link with a receiver once, out
    of the reader's link once (a node's GPUs pass it on among themselves); the reads, the decoding and the passing on
    follow one another."""
    per_link = _nic_workers(m)
    chains = storage_read_chains(readers)
    read: dict[int, list[int]] = {}
    sent: dict[int, float] = {}
    received: dict[int, float] = {}
    for layer, (reader, *_) in chains.items():
        read.setdefault(reader, []).append(layer)
        others = {worker // per_link for worker in chains[layer]} - {reader // per_link}
        nbytes = m.checkpoint_bytes((layer,))
        if others:
            sent[reader // per_link] = sent.get(reader // per_link, 0.0) + nbytes
        for link in others:
            received[link] = received.get(link, 0.0) + nbytes
    storage_s = m.checkpoint_bytes(chains) / m.sim.storage_read_bytes_per_s
    decode_s = max(m.checkpoint_bytes(layers) for layers in read.values()) / m.codec_bytes_per_s
    return storage_s + decode_s + _network_s(m, sent, received)


def _memory_read(source: Source, readers: Mapping[int, tuple[int, ...]], m: SimMachine, plan: Plan,
                 serving: Sequence[int]) -> float:  # fmt: skip
    """Restoring from REFT's snapshot in memory on ``plan``, as ``snapshot_layout.load_plan`` has the runtime's
    workers do it. Assumptions, kept simple:
    - a record on the reader's own node is read at ``sim.snapshot_bytes_per_s`` (a copy out of host memory with its
      checksum, the rate a snapshot is written at);
    - a record only another node holds is read there by that node's serving worker, at the same rate and once for
      all the workers it is sent to, and sent over the network: every send and every receive of a node's workers
      goes through the node's one NIC (``_network_s``), as on the paper's nodes;
    - a shard no live node holds is rebuilt from the parities of the other members (fetched as above) and the other
      shards: XOR at the machine's codec rate over the shard's bytes;
    - the workers loading at once share the machine's copy rate (``copy_bytes_per_s``).
    The restore takes as long as the busiest worker's reads and decoding, then the busiest NIC's traffic; building
    the layers from the loaded state is charged by ``configuring`` as for any restore."""
    assert isinstance(source, MemorySource)
    loads = load_plan(source, plan, list(serving))
    rate = m.copy_bytes_per_s(len(readers))
    busy: dict[int, float] = {}
    sent: dict[int, float] = {}
    received: dict[int, float] = {}
    served: set[tuple[int, MemoryRecord]] = set()
    per_link = _nic_workers(m)

    def fetched(worker: int, fetch: Fetch) -> None:
        nbytes, sender = fetch.record.nbytes, fetch.sender
        if sender is None or (sender, fetch.record) not in served:
            reader = worker if sender is None else sender
            busy[reader] = busy.get(reader, 0.0) + nbytes / rate
        if sender is not None:
            served.add((sender, fetch.record))
            sent[sender // per_link] = sent.get(sender // per_link, 0.0) + nbytes
            received[worker // per_link] = received.get(worker // per_link, 0.0) + nbytes

    for worker in sorted(readers):
        for group in loads[worker].groups:
            for fetch in group.shards.values():
                fetched(worker, fetch)
            for fetches in group.decode.values():
                for fetch in fetches:
                    fetched(worker, fetch)
                shard = sum(f.record.nbytes for f in fetches)  # q parities of one sub-chunk each
                busy[worker] = busy.get(worker, 0.0) + shard * (group.group.members - 1) / m.codec_bytes_per_s
    return max(busy.values(), default=0.0) + _network_s(m, sent, received)


register_source(StorageSource, _storage_read)
register_source(MemorySource, _memory_read)
