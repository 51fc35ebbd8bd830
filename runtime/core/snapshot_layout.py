"""Where a REFT snapshot's pieces live, and how a restart finds them. Torch-free: the protection, the backend, the
agents and the workers all reason with it.

**Sharding groups.** The workers holding the same run of layers form a group (a stage's replicas in a grid; in
Oobleck's heterogeneous pipelines, the holders of each run of layers, ``Plan.holders``). Every member holds the
group's state bit for bit (their gradients are all-reduced and their optimizers step alike), so each can write any
part of it with no communication. The state is one flat float32 vector per kind (parameters, Adam's two moments,
``runtime.state.snapshot``), padded to ``members * q`` elements and cut into ``members`` chunks; shard i is chunk i of
the parameters with chunk i of both moments and the optimizer's step: 3 C + q elements, C = padded / members.
This is also ZeRO-1's partition of the optimizer state, so with ``train.zero: 1`` a member's own shard is exactly
the optimizer chunk it owns.

**Records** (``contract.MemoryRecord``), each written by one member into its node's memory:
- ``shard`` i: the member i's shard (every mode; a group of one member has only this, and no protection);
- ``copy`` of shard i+d mod m, by member i (ARC: each member also keeps a peer's shard; AOR: the peer's optimizer
  chunk recomputed on this member's host from the peer's gradient chunk, so the copy is the peer's shard). d is 1
  when every member has a node of its own; where a node runs several members of a group, d is the most any node
  runs (``copy_distance``), so a copy never shares its shard's node and a node's loss is survived (with d = 1 the
  next member's copy sat beside the shard, and a node lost both). AOR keeps d = 1: its copy is computed from the
  gradient chunk its next member sends it;
- ``parity`` p_k, by member k (AEC): each shard is cut into q = m - 1 sub-chunks; sub-chunk j of shard i is
  protected by the parity of member ``others(i)[j]`` (the members other than i, in order), which XORs one
  sub-chunk of every shard but its own: p_k = XOR over i != k of s_i[others(i).index(k)]. Each parity is C / q
  elements, 1 / (m (m - 1)) of the group's state as the paper says, and a lost shard i is the XOR of the parities
  of the others with the surviving shards' sub-chunks. One lost member per group is survived, as with ARC.

**Loading** (REFT-load): every worker of the new plan needs the whole state of each old group that overlaps its
layers. A shard is read from the worker's own node if a shard or copy record of it is there; else one worker on a
node that holds one reads it there and sends it (over the new generation's group); else it is decoded from parity.
Every worker computes the same plan from the same inputs, so senders and receivers agree without messages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ftlab.runtime.core.contract import MemoryRecord, MemorySource
from ftlab.runtime.core.plan import Plan

MODES = ("arc", "aec", "aor", "arc+aec")


class Unrecoverable(RuntimeError):
    """The snapshot cannot be rebuilt from the records left; the message says which shards are lost."""


@dataclass(frozen=True)
class Group:
    """Workers holding the same layers, in worker order (member i owns shard i)."""

    layers: tuple[int, ...]
    holders: tuple[int, ...]

    @property
    def members(self) -> int:
        return len(self.holders)

    @property
    def q(self) -> int:
        """Sub-chunks per shard: m - 1 (each protected by another member's parity), at least 1."""
        return max(1, self.members - 1)

    def describe(self) -> str:
        return f"layers {layer_runs(self.layers, '..', ', ')} (workers {list(self.holders)})"


def layer_runs(layers: Sequence[int], to: str = "-", sep: str = "_") -> str:
    """Runs of consecutive layers: (0, 1, 2, 5) -> '0-2_5'."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][-1] == layer - 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return sep.join(f"{r[0]}{to}{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


@dataclass(frozen=True)
class Geometry:
    """Sizes of a group's flat state and of its records, in float32 elements."""

    numel: int
    """Parameters of the group's layers."""
    members: int
    q: int

    @property
    def chunk(self) -> int:
        """C: the padded parameter count over the members (a multiple of q)."""
        unit = self.members * self.q
        return -(-self.numel // unit) * unit // self.members

    @property
    def shard(self) -> int:
        return 3 * self.chunk + self.q

    @property
    def sub_chunk(self) -> int:
        return self.shard // self.q

    def record(self, kind: str) -> int:
        return self.sub_chunk if kind == "parity" else self.shard


def groups_of(plan: Plan) -> list[Group]:
    """The plan's sharding groups: the layers of each set of holders (as ``Plan.reduction_groups``, whose gradient
    buckets, and ZeRO-1's chunks, have the same layout), by first layer; single holders included."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for layer in range(plan.num_layers):
        groups.setdefault(plan.holders(layer), []).append(layer)
    return [Group(tuple(layers), holders) for holders, layers in groups.items()]


def others(members: int, index: int) -> list[int]:
    return [k for k in range(members) if k != index]


def parity_sources(members: int, k: int) -> list[tuple[int, int]]:
    """(shard, sub-chunk) pairs XORed into member ``k``'s parity."""
    return [(i, others(members, i).index(k)) for i in others(members, k)]


def records_to_write(plan: Plan, mode: str, workers_per_node: int) -> dict[int, list[MemoryRecord]]:
    """Each worker's records of a snapshot of ``plan`` under ``mode`` (without their checksums yet)."""
    if mode not in MODES:
        raise ValueError(f"unknown snapshot mode {mode!r}; use one of {', '.join(MODES)}")
    written: dict[int, list[MemoryRecord]] = {w: [] for w in plan.workers}
    for group in groups_of(plan):
        m = group.members
        # AOR's copy is the next member's, whose gradient chunk it is sent (runtime.processes.zero); ARC's may be any member's
        ahead = 1 if mode == "aor" else copy_distance(group, workers_per_node)
        for i, worker in enumerate(group.holders):
            node = worker // workers_per_node
            mine = [MemoryRecord(node, group.layers, m, i, "shard")]
            if m > 1 and mode in ("arc", "aor", "arc+aec"):
                mine.append(MemoryRecord(node, group.layers, m, (i + ahead) % m, "copy"))
            if m > 1 and mode in ("aec", "arc+aec"):
                mine.append(MemoryRecord(node, group.layers, m, i, "parity"))
            written[worker] += mine
    return written


def copy_distance(group: Group, workers_per_node: int) -> int:
    """How many members ahead of itself an ARC member copies a shard from, so that no copy sits on its shard's node.

    Members are in worker order, so those of one node are consecutive, at most ``c`` of them: a member c ahead (mod
    m) is on another node whenever m >= 2c. A node running more than half of the group has more shards than the
    other nodes have copies, and its loss is not survived whatever the choice: then 1, the paper's neighbour."""
    most = max(Counter(worker // workers_per_node for worker in group.holders).values())
    return most if 2 * most <= group.members else 1


def record_bytes(record: MemoryRecord, numel: int) -> int:
    """The bytes of ``record`` for a group of ``numel`` parameters."""
    return Geometry(numel, record.members, max(1, record.members - 1)).record(record.kind) * 4


def unprotected_groups(plan: Plan) -> list[Group]:
    """Groups of a single holder: their snapshot lives on one node and is lost with it."""
    return [g for g in groups_of(plan) if g.members == 1]


# -- what survives -------------------------------------------------------------------------------------------------
class _Found:
    """Records by what they hold, indexed once: a restore of a thousand workers asks for every shard of every group
    (scanning every record for each was quadratic in the cluster's size)."""

    def __init__(self, records: Iterable[MemoryRecord]) -> None:
        self._holding: dict[tuple[tuple[int, ...], int, int], list[MemoryRecord]] = {}
        self._parities: dict[tuple[tuple[int, ...], int], dict[int, list[MemoryRecord]]] = {}
        for r in records:
            if r.kind in ("shard", "copy"):
                self._holding.setdefault((r.layers, r.members, r.index), []).append(r)
            elif r.kind == "parity":
                self._parities.setdefault((r.layers, r.members), {}).setdefault(r.index, []).append(r)
        for found in self._holding.values():
            found.sort(key=lambda r: (r.kind != "shard", r.node))

    def holding(self, group: Group, index: int) -> list[MemoryRecord]:
        """Records that hold shard ``index`` of ``group`` as it is (its shard or a copy), shards first, by node."""
        return self._holding.get((group.layers, group.members, index), [])

    def parities(self, group: Group) -> dict[int, list[MemoryRecord]]:
        """``group``'s parity records, by member."""
        return self._parities.get((group.layers, group.members), {})


def lost_shards(plan: Plan, records: Sequence[MemoryRecord]) -> list[str]:
    """What of a snapshot of ``plan`` cannot be rebuilt from ``records`` (empty: it can be, wholly)."""
    lost = []
    found = _Found(records)
    for group in groups_of(plan):
        missing = [i for i in range(group.members) if not found.holding(group, i)]
        if not missing:
            continue
        parities = found.parities(group)
        decodable = len(missing) == 1 and group.members > 1 and all(k in parities for k in others(group.members, missing[0]))
        if not decodable:
            lost.append(f"shards {missing} of {group.describe()}")
    return lost


def decodes(source: MemorySource) -> bool:
    """Whether some shard of ``source`` can only be rebuilt from parity."""
    found = _Found(source.records)
    return any(not found.holding(group, i) for group in groups_of(source.plan) for i in range(group.members))


# -- the load plan ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fetch:
    """One record a worker needs: read on its own node (``sender`` None) or sent by ``sender``, which reads it on
    its node, with tags ``tag`` and ``tag + 1`` (``GenerationComm.send_bytes``)."""

    record: MemoryRecord
    sender: int | None
    tag: int


@dataclass
class GroupLoad:
    """How a worker gets the whole state of one old group."""

    group: Group
    shards: dict[int, Fetch] = field(default_factory=dict)
    decode: dict[int, list[Fetch]] = field(default_factory=dict)
    """A shard no live node holds: the parities of the other members, XORed with the other shards."""


@dataclass
class WorkerLoad:
    groups: list[GroupLoad] = field(default_factory=list)
    sends: list[tuple[MemoryRecord, int, int]] = field(default_factory=list)
    """(record, receiver, tag): records on this worker's node that it reads and sends to others."""


def load_plan(source: MemorySource, plan: Plan, helpers: Sequence[int] = ()) -> dict[int, WorkerLoad]:
    """What each worker of ``plan`` (and each helper: a live worker outside the plan, which only serves its node's
    records) reads, receives, sends and decodes to restore ``source``. Raises Unrecoverable if a shard is lost."""
    wpn = source.workers_per_node
    serving = sorted({*plan.workers, *helpers})
    server_of_node: dict[int, int] = {}
    for worker in serving:
        server_of_node.setdefault(worker // wpn, worker)
    loads = {w: WorkerLoad() for w in serving}
    tags = iter(range(0, 1 << 30, 2))

    def fetch(worker: int, candidates: list[MemoryRecord]) -> Fetch | None:
        node = worker // wpn
        local = [r for r in candidates if r.node == node]
        if local:
            return Fetch(local[0], None, 0)
        remote = [r for r in candidates if r.node in server_of_node]
        if not remote:
            return None
        record = remote[0]
        sender, tag = server_of_node[record.node], next(tags)
        loads[sender].sends.append((record, worker, tag))
        return Fetch(record, sender, tag)

    ranges = plan.layer_ranges()
    found, old_groups = _Found(source.records), groups_of(source.plan)
    for worker in plan.workers:
        start, stop = ranges[worker]
        for group in old_groups:
            if group.layers[-1] < start or group.layers[0] >= stop:
                continue
            load = GroupLoad(group)
            for i in range(group.members):
                shard = fetch(worker, found.holding(group, i))
                if shard is not None:
                    load.shards[i] = shard
            missing = [i for i in range(group.members) if i not in load.shards]
            if len(missing) == 1 and group.members > 1:
                parities = found.parities(group)
                fetches = [fetch(worker, parities.get(k, [])) for k in others(group.members, missing[0])]
                if all(f is not None for f in fetches):
                    load.decode[missing[0]] = fetches  # type: ignore[assignment]
            if len(load.shards) + len(load.decode) < group.members:
                lost = [i for i in missing if i not in load.decode]
                raise Unrecoverable(f"worker {worker} cannot rebuild shards {lost} of {group.describe()} from the "
                                    f"records on live nodes")  # fmt: skip
            loads[worker].groups.append(load)
    return loads
