"""Data-parallel replicas of one layout: the plan they form, and new replicas healed from live ones."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ftlab.runtime.core.contract import Job, LayerTransfer
from ftlab.runtime.core.plan import Pipeline, Plan, Stage

Spans = tuple[tuple[int, int], ...]


def room(job: Job) -> int:
    """The most replicas the global batch feeds: one micro-batch each at least."""
    return job.train.global_batch // job.train.micro_batch


def replicas_plan(chains: Sequence[Sequence[int]], spans: Spans, job: Job, generation: int, step: int) -> Plan:
    """One pipeline per chain (its workers stage by stage), the micro-batches dealt round-robin over them."""
    t, micro = job.train, room(job)
    pipelines = tuple(
        Pipeline(tuple(Stage(w, a, b) for w, (a, b) in zip(chain, spans)), tuple(range(r, micro, len(chains))))
        for r, chain in enumerate(chains)
    )
    plan = Plan(generation, len(job.specs), t.global_batch, t.micro_batch, pipelines, step=step)
    plan.validate()
    return plan


def heal(
    idle: Sequence[int], spans: Spans, count: int, holdings: Mapping[int, frozenset[int]], kept: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[LayerTransfer]] | None:
    """``count`` new replicas of ``spans`` from ``idle`` workers and the layer copies that fill them, or None when a
    layer they lack is held by no worker that keeps it: the ``kept`` replicas' and the new ones' workers that stay
    at a stage whose layers they hold (a worker that changes stage is no source: its old layers are on their way out).

    ``holdings`` are the layers each worker holds at the committed step. An idle worker that already holds a stage's
    layers (a survivor of a dropped replica) takes that stage, so it needs no copy; the rest fill the other stages in
    order. Copies of one layer are spread over its holders, so no single live replica serves every newcomer.
    """
    free = list(idle)
    slots: list[list[int]] = [[] for _ in spans]
    for s, (a, b) in enumerate(spans):
        for w in [w for w in free if set(range(a, b)) <= holdings.get(w, frozenset())][:count]:
            slots[s].append(w)
            free.remove(w)
    for column in slots:
        while len(column) < count:
            column.append(free.pop(0))
    chains = [[slots[s][r] for s in range(len(spans))] for r in range(count)]
    keeps = {w: frozenset(range(a, b)) & holdings.get(w, frozenset())
             for chain in [*kept, *chains] for w, (a, b) in zip(chain, spans)}  # fmt: skip
    transfers: list[LayerTransfer] = []
    for chain in chains:
        for w, (a, b) in zip(chain, spans):
            for layer in range(a, b):
                if layer in holdings.get(w, frozenset()):
                    continue
                holders = [h for h, layers in keeps.items() if layer in layers]
                if not holders:
                    return None
                transfers.append(LayerTransfer(layer, holders[len(transfers) % len(holders)], w))
    return chains, transfers
