"""REFT's in-memory snapshots, simulated as the runtime takes them (``runtime.processes.local_backend``, the worker's
``Snapshotter``): each writer's copy beside training, each node's memory, and what survives a failure.

- A snapshot returns at once. Each writer writes the records ``snapshot_layout.records_to_write`` gives it (their
  bytes from the layout's geometry over the layers' parameters), starting after ``sim.snapshot_launch_s`` and
  copying at the machine's copy rate beside training. Where the copies take the computation's resources (a shared
  host's cores), the iteration they overlap is timed with them beside it (``SimMachine.overlapped``, once per plan
  and set of writers), which says when each copy ends. Our choice: a copy is timed as overlapping an iteration even
  when a reconfiguration comes next instead (which then waits for it).
- A writer waits for its copy before it reports ready (the runtime's worker does), so a step's ready time is the
  later of its gradients and its copy (``step_ready``). It reports its records then (``completed``), or when it
  acknowledges an abort (survivors finish their copy first) or a configuration.
- Each node's memory holds the records reported on it, two slots per record name as on the runtime: a reported
  record replaces every slot of its name but the snapshot it must keep (``TakeSnapshot.keep``). (The runtime tears
  the overwritten slot when the copy starts, not when it is reported; no one can tell the difference, since the
  protection forgets every snapshot but the kept one when it asks for a new one.) A writer that dies before it
  reports loses its part (its copy dies with it); a killed node loses its memory, every record on it. ``verify``
  narrows a ``MemorySource`` to the records still in memory.

Writers whose copies begin and end together are one ``_Copy``: a snapshot of a thousand writers is simulated as a
few copies, not a thousand.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from ftlab.runtime.control.backend import PendingSnapshot, SaveProgress
from ftlab.runtime.core.contract import MemoryRecord, MemorySource, Source, TakeSnapshot
from ftlab.runtime.core.snapshot_layout import lost_shards, record_bytes, records_to_write
from ftlab.runtime.sim.clock import Clock
from ftlab.runtime.sim.machines import SimMachine
from ftlab.runtime.sim.timing import IterationTiming


@dataclass(frozen=True, eq=False)
class Part:
    """What one writer writes of each snapshot of a plan: its records, sized, and their names in memory. One object
    per writer and plan layout: a key by identity."""

    records: tuple[MemoryRecord, ...]
    names: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True, eq=False)
class Writers:
    """Writers of a snapshot whose copies begin and end together, and their parts, in worker order."""

    workers: tuple[int, ...]
    parts: tuple[Part, ...]
    members: frozenset[int]
    records: tuple[MemoryRecord, ...]
    """Every part's records, in worker order: what the writers report."""
    nbytes: int

    @staticmethod
    def of(pairs: list[tuple[int, Part]]) -> Writers:
        pairs = sorted(pairs, key=lambda pair: pair[0])
        parts = tuple(part for _, part in pairs)
        return Writers(
            tuple(w for w, _ in pairs), parts, frozenset(w for w, _ in pairs),
            tuple(r for part in parts for r in part.records), sum(part.nbytes for part in parts),
        )  # fmt: skip

    def without(self, gone: set[int] | frozenset[int]) -> Writers | None:
        """These writers but ``gone``; None if none is left."""
        kept = [(w, part) for w, part in zip(self.workers, self.parts) if w not in gone]
        return Writers.of(kept) if kept else None


@dataclass(frozen=True)
class Copy:
    """Writers' parts of a snapshot in flight, copied side by side."""

    step: int
    writers: Writers
    keep: int
    """The snapshot whose slots the copy must not overwrite."""
    begins: float
    ends: float

    def without(self, gone: set[int] | frozenset[int]) -> Copy | None:
        """This copy without the parts of ``gone``'s writers; None if none is left."""
        if self.writers.members.isdisjoint(gone):
            return self
        rest = self.writers.without(gone)
        return None if rest is None else replace(self, writers=rest)


Overlapping = Callable[[Mapping[int, Part]], "IterationTiming | None"]
"""The running plan's iteration with these writers' copies beside it, where the copies take its resources."""


class SnapshotMemory:
    def __init__(self, machine: SimMachine, clock: Clock) -> None:
        self.machine = machine
        self.clock = clock
        self.snapshots: dict[int, PendingSnapshot] = {}
        """Snapshots in flight, by step."""
        self.copies: list[Copy] = []
        """Writers' copies not reported yet, in the order they were launched."""
        self._memory: dict[int, dict[str, dict[int, MemoryRecord]]] = {}
        """Each node's memory: its records' slots by name, each slot by the step it holds; up to date once the slots
        written since are settled (``_settle``)."""
        self._written: dict[Part, dict[int, bool]] = {}
        """The slots each writer's part has written since the memory was settled, alike for all its records (one
        writer's records are written together, and no two parts of a layout share a record): step -> True for the
        part's own record of that step, False for whatever its records held at that step before (kept, if they held
        one). A snapshot of a thousand writers updates a few hundred of these, not every record in memory."""
        self._layout: tuple[TakeSnapshot, dict[int, Part], list[Writers]] | None = None
        """The writers' parts of the running plan's snapshots (the same for every snapshot of it), and the writers
        grouped by their part's size."""
        self._reduced_by: dict[Writers, float] = {}
        """When the first of a group of writers leaves its ReduceGrads in the running step's timing."""

    # -- a snapshot's copies -----------------------------------------------------------------------------------
    def launch(self, step: int, action: TakeSnapshot, alive: set[int], overlapping: Overlapping
               ) -> tuple[list[Copy], Mapping[int, Part]]:  # fmt: skip
        """Launch every live writer's copy of a snapshot; the copies and each writer's part."""
        parts, groups = self._parts(action)
        writing = parts if parts.keys() <= alive else {w: p for w, p in parts.items() if w in alive}
        rate = self.machine.copy_bytes_per_s(len(writing))
        self.snapshots[step] = PendingSnapshot(action, set(writing))
        launched = self.clock.now + self.machine.sim.snapshot_launch_s
        # A writer still copying the last snapshot starts this one after it (launched in order: its last ends last).
        busy = {w: c.ends for c in self.copies if c.ends > launched for w in c.writers.workers}
        overlapped = overlapping(writing) if self.machine.copies_take_compute and not busy else None
        if overlapped is not None:
            ends = overlapped.copy_end
            copies = [Copy(step, Writers.of(pairs), action.keep, launched, launched + ends[pairs[0][0]])
                      for pairs in _by_end(writing, ends)]  # fmt: skip
        elif writing is parts and not busy:
            copies = [Copy(step, writers, action.keep, launched, launched + writers.parts[0].nbytes / rate)
                      for writers in groups]  # fmt: skip
        else:
            starting: dict[tuple[float, int], list[tuple[int, Part]]] = {}
            for worker, part in writing.items():
                starting.setdefault((max(launched, busy.get(worker, launched)), part.nbytes), []).append((worker, part))
            copies = [Copy(step, Writers.of(pairs), action.keep, begins, begins + nbytes / rate)
                      for (begins, nbytes), pairs in starting.items()]  # fmt: skip
        self.copies.extend(copies)
        return copies, writing

    def _parts(self, action: TakeSnapshot) -> tuple[dict[int, Part], list[Writers]]:
        """Each writer's records of a snapshot (``snapshot_layout.records_to_write``), sized by the layout's
        geometry, and the writers grouped by their part's size; computed once per plan and mode."""
        if self._layout is not None:
            last, parts, groups = self._layout
            same = (last.mode, last.workers_per_node) == (action.mode, action.workers_per_node)
            if last.plan is action.plan and same:
                return parts, groups
        self._settle()  # the next layout's parts may write the same names
        parts = {}
        for worker, mine in records_to_write(action.plan, action.mode, action.workers_per_node).items():
            if mine:
                sized = tuple(replace(r, nbytes=record_bytes(r, self.machine.numel(r.layers))) for r in mine)
                parts[worker] = Part(sized, tuple(r.name for r in sized), sum(r.nbytes for r in sized))
        by_size: dict[int, list[tuple[int, Part]]] = {}
        for worker, part in parts.items():
            by_size.setdefault(part.nbytes, []).append((worker, part))
        groups = [Writers.of(pairs) for pairs in by_size.values()]
        self._layout = (action, parts, groups)
        self._reduced_by.clear()
        return parts, groups

    def copying(self, workers: set[int] | frozenset[int]) -> float:
        """How long until the copies in flight of ``workers`` are done."""
        now = self.clock.now
        return max([0.0, *(c.ends - now for c in self.copies if not c.writers.members.isdisjoint(workers))])

    def copies_of(self, step: int, worker: int) -> bool:
        """``worker`` is still copying its part of the snapshot of ``step``."""
        return any(c.step == step and worker in c.writers.members for c in self.copies)

    def step_ready(self, needs: frozenset[int], started: float, timing: IterationTiming) -> tuple[float, float | None]:
        """When a step that began at ``started`` on ``timing`` is ready (its writers' copies done too), and the
        longest a writer waited for its copy after its gradients were reduced (None: no copy in flight)."""
        ready = started + timing.ready_s
        longest: float | None = None
        for copy in self.copies:
            if needs.isdisjoint(copy.writers.members):
                continue
            ready = max(ready, copy.ends)
            wait = max(0.0, copy.ends - started - self._reduced(copy.writers, timing, needs))
            longest = wait if longest is None else max(longest, wait)
        return ready, longest

    def forget_reductions(self) -> None:
        """The step timing changed: the writers' ReduceGrads ends are the new one's."""
        self._reduced_by.clear()

    def _reduced(self, writers: Writers, timing: IterationTiming, needs: frozenset[int]) -> float:
        """When the first of ``writers`` that the step needs leaves its ReduceGrads (from the step's start)."""
        if not needs.issuperset(writers.members):
            return min(timing.reduce_end.get(w, timing.ready_s) for w in writers.workers if w in needs)
        if writers not in self._reduced_by:
            self._reduced_by[writers] = min(timing.reduce_end.get(w, timing.ready_s) for w in writers.workers)
        return self._reduced_by[writers]

    def beside_save(self, seconds: float, cpu_s: Mapping[int, float]) -> tuple[float, bool]:
        """A save of ``seconds`` (its writers' CPU ``cpu_s``) with the copies in flight beside it, as the machine
        shares them (``SimMachine.save_beside_copies``): the save's seconds, and whether the copies it slowed end
        within it. Left as is: a fault armed in a copy (the "snapshot" phase) keeps the moment its launch
        scheduled."""
        now = self.clock.now
        flight = [i for i, c in enumerate(self.copies) if c.ends > now]
        left = [(self._cpu_left(self.copies[i]), len(self.copies[i].writers.workers)) for i in flight]
        seconds, ends = self.machine.save_beside_copies(seconds, cpu_s, left)
        if ends is None:
            return seconds, False
        copy_ends = {i: now + end for i, end in zip(flight, ends, strict=True)}
        self.copies = [replace(c, ends=copy_ends[i]) if i in copy_ends else c for i, c in enumerate(self.copies)]
        return seconds, max(copy_ends.values()) <= now + seconds

    def _cpu_left(self, copy: Copy) -> float:
        """The CPU a writer of ``copy`` has left to copy, on a core of its own."""
        whole = copy.writers.parts[0].nbytes / self.machine.sim.snapshot_bytes_per_s
        if copy.begins >= self.clock.now:
            return whole
        return whole * (copy.ends - self.clock.now) / (copy.ends - copy.begins)

    # -- reports ---------------------------------------------------------------------------------------------
    def completed(self, hung: Mapping[int, float]) -> list[SaveProgress]:
        """The copies done by now, reported in order (a hung writer reports nothing)."""
        done: list[Copy] = []
        copying: list[Copy] = []
        for copy in self.copies:
            if copy.ends > self.clock.now:
                copying.append(copy)
                continue
            stuck = copy.writers.members.intersection(hung)
            if stuck:  # a hung writer reports nothing (its copy is dropped when it is fenced)
                stalled = copy.without(copy.writers.members - stuck)
                assert stalled is not None  # the hung writers' parts
                copying.append(stalled)
                reporting = copy.without(stuck)
                if reporting is None:
                    continue
                copy = reporting
            done.append(copy)
        self.copies = copying
        progress = []
        for copy in _in_report_order(done):
            for part in copy.writers.parts:  # two slots a record name: the kept snapshot's and this one's
                slots = self._written.get(part)
                if slots is None:
                    self._written[part] = {copy.keep: False, copy.step: True}
                elif copy.keep in slots:
                    self._written[part] = {copy.keep: slots[copy.keep], copy.step: True}
                else:
                    self._written[part] = {copy.step: True}
            snapshot = self.snapshots[copy.step]
            snapshot.waiting.difference_update(copy.writers.members)
            snapshot.nbytes += copy.writers.nbytes
            snapshot.copy_s = max(snapshot.copy_s, copy.ends - copy.begins)
            snapshot.cpu_s += copy.writers.nbytes / self.machine.sim.snapshot_bytes_per_s  # each on a core of its own
            if not snapshot.waiting:
                del self.snapshots[copy.step]
            progress.append(SaveProgress(
                copy.step, snapshot.action, copy.writers.workers, copy.writers.records, not snapshot.waiting,
                snapshot.nbytes, snapshot.copy_s, snapshot.cpu_s,
            ))  # fmt: skip
        return progress

    def _settle(self) -> None:
        """Bring every record's slots in memory up to date with what its part has written since."""
        for part, slots in self._written.items():
            for record, name in zip(part.records, part.names):
                memory = self._memory.setdefault(record.node, {})
                before = memory.get(name, {})
                memory[name] = {step: record if own else before[step] for step, own in slots.items()
                                if own or step in before}  # fmt: skip
        self._written.clear()

    def verify(self, source: Source, nodes: set[int]) -> Source | str:
        """Memory is lost with its node and slots are overwritten: a memory source keeps the records still in the
        memory of live ``nodes``, or is refused with why."""
        if not isinstance(source, MemorySource):
            return source
        self._settle()
        intact = tuple(
            r for r in source.records
            if r.node in nodes and source.step in self._memory.get(r.node, {}).get(r.name, {})
        )  # fmt: skip
        lost = lost_shards(source.plan, intact)
        if lost:
            return f"the records left in memory cannot rebuild {'; '.join(lost)}"
        return replace(source, records=intact)

    # -- failures ----------------------------------------------------------------------------------------------
    def lose_writer(self, worker: int) -> None:
        """``worker`` died: its copy dies with it, unreported, and the snapshots it wrote stay incomplete."""
        self.copies = [c for c in (copy.without({worker}) for copy in self.copies) if c is not None]
        copying = {c.step for c in self.copies}
        self.snapshots = {s: snap for s, snap in self.snapshots.items() if s in copying}

    def lose_node(self, node: int) -> None:
        """``node`` died: its host memory, and every record in it, is gone."""
        self._settle()
        self._memory.pop(node, None)

    def restart(self) -> None:
        """Every worker process ended: the copies in flight die with them, and those snapshots stay incomplete."""
        self.snapshots.clear()
        self.copies.clear()


def _by_end(writing: Mapping[int, Part], ends: Mapping[int, float]) -> list[list[tuple[int, Part]]]:
    """The writers whose copies end together, with their parts."""
    together: dict[float, list[tuple[int, Part]]] = {}
    for worker, part in writing.items():
        together.setdefault(ends[worker], []).append((worker, part))
    return list(together.values())


def _in_report_order(done: list[Copy]) -> list[Copy]:
    """Completed copies in the order their writers report: by the end of their copy, then by worker. Copies that
    end together are merged, their writers in worker order."""
    by_end: dict[tuple[float, int], list[Copy]] = {}
    for copy in done:
        by_end.setdefault((copy.ends, copy.step), []).append(copy)
    ordered = []
    for (ends, step), copies in sorted(by_end.items()):
        if len(copies) == 1:
            ordered.append(copies[0])
        else:
            first = copies[0]
            merged = Writers.of([pair for c in copies for pair in zip(c.writers.workers, c.writers.parts)])
            ordered.append(Copy(step, merged, first.keep, min(c.begins for c in copies), ends))
    return ordered
