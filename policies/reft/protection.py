"""``protection=reft``: in-memory snapshots in the nodes' host memory, protected across each sharding group, and a
flush to storage at a lower frequency (the paper's Sections 4.1 to 4.3).

Every ``interval`` committed steps the protection asks for a ``TakeSnapshot`` of the running plan: each holder of a
run of layers copies its shard of their state, and its protection (``runtime.core.snapshot_layout``), into its node's
memory while training goes on. The writers' reports come back record by record (``saved``), so the protection knows
for every snapshot which records exist and where. Every ``flush_every`` steps it also asks for an ordinary
checkpoint to storage.

After a failure it offers (``restore_source``) the newest snapshot whose every shard can still be rebuilt from the
records on live nodes (as they are, from a peer's copy, or decoded from parity); when none can, the newest flush,
with the reason. Losing one node per sharding group is survived; two nodes of one group lose its state in memory.
Records on a failed node are forgotten. Snapshots newer than the state a restore goes back to are forgotten too:
the steps after it are computed again. A snapshot the backend could not verify (a record failed its checksum) is
dropped, and the next offer is the next best.

What the paper leaves open, and the choice made:
- The snapshot a new one must not overwrite (``TakeSnapshot.keep``) is the newest complete one: the two slots of a
  record file hold it and the one being written.
- A layer with a single holder (a plan after failures may have one) gets its shard written but no protection: its
  snapshot is lost with its node and the flush is the fallback. The first plan must protect every layer
  (``check_plan``), and its records, two slots each, must fit ``host_memory_gb`` on every node.
"""

from __future__ import annotations

from ftlab.policies.reft.interval import choose_interval
from ftlab.runtime.core.contract import (
    Action, Change, ConfigError, Job, MemoryRecord, MemorySource, Protection, SaveCheckpoint, Source, StorageSource,
    TakeSnapshot,
)  # fmt: skip
from ftlab.runtime.core.failed_saves import FailedSaves, checkpoint_bytes
from ftlab.runtime.core.plan import Plan
from ftlab.runtime.core.program_check import simulate
from ftlab.runtime.core.scheduler import one_f_one_b
from ftlab.runtime.core.snapshot_layout import MODES, groups_of, lost_shards, record_bytes, records_to_write

GIB = 2**30
SLOTS = 2


class ReftProtection(Protection):
    def __init__(self, settings: object) -> None:
        super().__init__(settings)
        self.directory = ""
        self.workers_per_node = 1
        self.interval = 1
        self.choice = ""
        self.storage: Source | None = None
        """The newest complete flush to storage."""
        self.snapshots: dict[int, _Snapshot] = {}
        """Snapshots whose records may still be in memory, by step."""
        self._expected: tuple[int, int] = (-1, 0)
        """(plan generation, records a snapshot of it writes): counted once per plan, not per snapshot."""
        self.failures = FailedSaves(settings.max_failed_saves, 0, settings.keep)  # type: ignore[attr-defined]
        """Flushes that storage refused in a row (``runtime.core.failed_saves``)."""
        self.lost_snapshots: list[int] = []
        """Steps of the snapshots in a row that host memory refused (a writer's copy failed: full)."""
        self.node_memory: dict[int, int] = {}
        """The host memory each node's records take under the first plan (set by ``check_plan``)."""

    # -- checks ------------------------------------------------------------------------------------------------
    def check(self, job: Job) -> None:
        s = self.settings
        if s.mode not in MODES:
            raise ConfigError(f"protection.mode={s.mode!r}: use one of {', '.join(MODES)}")
        if s.mode == "aor" and job.train.zero != 1:
            raise ConfigError(
                "protection.mode=aor protects the optimizer chunks of ZeRO-1, and train.zero is 0: set train.zero=1, "
                "or use protection.mode=arc (or aec) without optimizer sharding"
            )
        if s.mode != "aor" and job.train.zero == 1:
            raise ConfigError(
                f"protection.mode={s.mode} copies a peer's whole state, which with train.zero=1 no member holds (each "
                f"owns one chunk of the optimizer state): use protection.mode=aor"
            )
        if s.interval != "auto" and (not isinstance(s.interval, int) or s.interval < 1):
            raise ConfigError(f"protection.interval={s.interval!r}: snapshot every 1 or more committed steps, or auto")
        if s.flush_every < 1 or s.keep < 1 or s.max_failed_saves < 1:
            raise ConfigError(f"protection.flush_every={s.flush_every}, protection.keep={s.keep} and "
                              f"protection.max_failed_saves={s.max_failed_saves} must be at least 1")  # fmt: skip
        self.failures.one_bytes = checkpoint_bytes(job.specs, job.model.seq_len)
        if s.host_memory_gb <= 0:
            raise ConfigError(f"protection.host_memory_gb={s.host_memory_gb}: give each node's host memory in GiB")
        self.directory = job.train.checkpoint_dir
        self.workers_per_node = job.workers_per_node
        self.storage = job.start

    def check_plan(self, plan: Plan, job: Job) -> None:
        alone = [g for g in groups_of(plan) if g.members == 1]
        if alone:
            g = alone[0]
            raise ConfigError(
                f"protection=reft mode={self.settings.mode} protects each shard on another holder of the same layers, "
                f"and {g.describe()} have a single holder: raise cluster.nodes or lower train.stages so that every "
                f"stage has at least two replicas, or use protection=storage"
            )
        need = self._node_bytes(plan, job)
        node, most = max(need.items(), key=lambda item: item[1])
        self.node_memory = {n: int(b) for n, b in need.items()}
        if most > self.settings.host_memory_gb * GIB:
            raise ConfigError(
                f"snapshots of {job.model.name} in mode {self.settings.mode} need {most / GIB:.2f} GiB of host memory "
                f"on node {node} (two slots per record) but protection.host_memory_gb={self.settings.host_memory_gb}: "
                f"raise it, or use more nodes (smaller shards) or mode=aec (smaller redundancy)"
            )
        if self.settings.interval == "auto":
            self._choose_interval(plan, job, need)
        else:
            self.interval = self.settings.interval

    def _written(self, plan: Plan, job: Job) -> dict[int, list[tuple[MemoryRecord, int]]]:
        """Each writer's records of a snapshot of ``plan``, with their bytes."""
        return {
            worker: [(r, record_bytes(r, sum(job.specs[i].params for i in r.layers))) for r in records]
            for worker, records in records_to_write(plan, self.settings.mode, job.workers_per_node).items()
        }

    def _node_bytes(self, plan: Plan, job: Job) -> dict[int, int]:
        """Host memory each node's records take, two slots each."""
        need: dict[int, int] = {}
        for records in self._written(plan, job).values():
            for r, nbytes in records:
                need[r.node] = need.get(r.node, 0) + SLOTS * nbytes
        return need

    def copies_beside_training(self, plan: Plan, job: Job) -> tuple[dict[int, int], int]:
        copied = {worker: sum(nbytes for _, nbytes in records) for worker, records in self._written(plan, job).items()}
        return copied, self.interval

    def _choose_interval(self, plan: Plan, job: Job, need: dict[int, int]) -> None:
        iteration_s = simulate(one_f_one_b(plan), job.costs.durations(plan), plan)
        choice = choose_interval(
            iteration_s=iteration_s, snapshot_bytes=max(need.values()) // SLOTS // job.workers_per_node,
            failure_rate=job.failure_rate, nodes=len(job.slots_of_node),
            group_size=min(g.members for g in groups_of(plan)), flush_every=self.settings.flush_every,
            threshold=self.settings.threshold,
        )  # fmt: skip
        self.interval, self.choice = choice.steps, choice.reason

    def runtime_options(self) -> dict[str, object]:
        return {"aor": self.settings.mode == "aor"}

    def describe(self) -> dict[str, str]:
        described = {"interval": str(self.interval)}
        if self.choice:
            described["interval_reason"] = self.choice
        return described

    # -- saving ------------------------------------------------------------------------------------------------
    def after_commit(self, step: int, plan: Plan) -> list[Action]:
        actions: list[Action] = []
        if step % self.interval == 0:
            keep = self._newest_complete()
            # Every record's slots now hold the kept snapshot and this one: forget the rest.
            self.snapshots = {s: snap for s, snap in self.snapshots.items() if s == keep}
            if self._expected[0] != plan.generation:
                expected = records_to_write(plan, self.settings.mode, self.workers_per_node)
                self._expected = (plan.generation, sum(len(r) for r in expected.values()))
            self.snapshots[step] = _Snapshot(plan, self._expected[1])
            actions.append(TakeSnapshot(plan, self.settings.mode, self.workers_per_node, keep))
        if step % self.settings.flush_every == 0:
            actions.append(SaveCheckpoint(self.directory, self.settings.keep))
        return actions

    def saved(self, action: Action, step: int, records: tuple[MemoryRecord, ...] = ()) -> None:
        if isinstance(action, SaveCheckpoint):
            self.storage = StorageSource(step, f"{action.directory}/step-{step:06d}")
            self.failures.succeeded()
        elif isinstance(action, TakeSnapshot) and step in self.snapshots:
            snap = self.snapshots[step]
            snap.records.extend(records)
            snap.crcs.update({(r.layers, r.index): r.crc for r in records if r.kind == "shard"})
            if snap.complete:
                self.lost_snapshots.clear()

    def newest_on_storage(self) -> StorageSource | None:
        return self.storage if isinstance(self.storage, StorageSource) else None

    def unsaved(self, action: Action, step: int, reason: str) -> str | None:
        flushed = self.newest_on_storage()
        newest = flushed.directory if flushed else None
        if isinstance(action, SaveCheckpoint):
            return self.failures.failed(step, reason, self.name, self.directory, newest)
        if step not in self.lost_snapshots:  # each of its writers whose copy failed reports it
            self.lost_snapshots.append(step)
        if len(self.lost_snapshots) < self.settings.max_failed_saves:
            return None
        resume = f"resume with train.resume_from={newest}" if newest else "start the job again (no flush was written)"
        return (
            f"protection=reft: {len(self.lost_snapshots)} snapshots in a row could not be copied into host memory "
            f"(steps {', '.join(map(str, self.lost_snapshots))}; the last: {reason}). A node's records take "
            f"{max(self.node_memory.values(), default=0) / GIB:.2f} GiB (two slots each): free that much memory under /dev/shm on every node, "
            f"and {resume}"
        )

    def storage_footprint(self) -> tuple[int, bool]:
        return self.settings.keep, self.settings.allow_low_space

    def host_memory_footprint(self) -> dict[int, int]:
        return self.node_memory

    def _newest_complete(self) -> int:
        return max((s for s, snap in self.snapshots.items() if snap.complete), default=-1)

    # -- restoring ---------------------------------------------------------------------------------------------
    def restore_source(self, change: Change | None = None) -> Source | None:
        failed = set(change.failed_nodes) if change is not None else set()
        for snap in self.snapshots.values():
            snap.records = [r for r in snap.records if r.node not in failed]
        why_not = []
        memory: MemorySource | None = None
        for step in sorted(self.snapshots, reverse=True):
            snap = self.snapshots[step]
            lost = lost_shards(snap.plan, snap.records)
            if not lost:
                memory = self._memory_source(step, snap, why_not)
                break
            nodes = f" with nodes {sorted(failed)}" if failed else ""
            why_not.append(f"the snapshot of step {step} lost {'; '.join(lost)}{nodes}")
        source: Source | None = memory
        if self.storage is not None and (memory is None or self.storage.step > memory.step):
            flush = f"the newest flush to storage is step {self.storage.step}"
            source = StorageSource(self.storage.step, self.storage.directory,  # type: ignore[attr-defined]
                                   reason="; ".join([*why_not, flush]) if why_not else flush)  # fmt: skip
        if source is not None:  # the steps after it are computed again: later snapshots are stale
            self.snapshots = {s: snap for s, snap in self.snapshots.items() if s <= source.step}
        if isinstance(source, MemorySource):
            self.snapshots[source.step].restored = True  # what training resumes from: the next one keeps it
        return source

    def _memory_source(self, step: int, snap: _Snapshot, why_not: list[str]) -> MemorySource:
        records = tuple(snap.records)
        crcs = tuple(sorted((layers, index, crc) for (layers, index), crc in snap.crcs.items()))
        decoded = lost_shards(snap.plan, [r for r in records if r.kind != "parity"])
        how = f"shards {'; '.join(decoded)} are decoded from parity" if decoded else "every shard is on a live node"
        reason = "; ".join([*why_not, f"the snapshot of step {step} survives: {how}"])
        return MemorySource(step, plan=snap.plan, workers_per_node=self.workers_per_node, records=records,
                            shard_crcs=crcs, reason=reason)  # fmt: skip

    def unusable(self, source: Source, reason: str) -> None:
        if isinstance(source, MemorySource):
            self.snapshots.pop(source.step, None)
        elif self.storage is not None and source.step == self.storage.step:
            self.storage = None


class _Snapshot:
    """What the protection knows of one snapshot: its plan, the records reported (on live nodes) and the checksum
    of every shard as its owner wrote it (kept when the owner's node is lost, to check a shard rebuilt for it)."""

    def __init__(self, plan: Plan, expected: int) -> None:
        self.plan = plan
        self.expected = expected
        self.records: list[MemoryRecord] = []
        self.crcs: dict[tuple[tuple[int, ...], int], int] = {}
        self.restored = False
        """Training resumed from it: it must survive the next snapshot even if a record of it was never written."""

    @property
    def complete(self) -> bool:
        return self.restored or len(self.records) >= self.expected
