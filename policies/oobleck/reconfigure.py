"""Dynamic reconfiguration (Oobleck, SOSP'23, Section 5.1): new pipelines after failures or joins, and the layer
copies that fill them from the surviving replicas.

Everything here is a pure function of (current pipelines, lost or joined node ids, templates).

Failures follow the paper's three steps, pipeline by pipeline:
1. reinstantiate: a pipeline that lost nodes but keeps ``n0`` or more runs the template of its surviving count;
2. borrow: a pipeline left with fewer than ``n0`` takes nodes, one at a time, from the largest pipeline that can
   spare one (more than ``n0``), which then runs the template one node smaller;
3. merge: when no pipeline can spare a node, the short pipeline merges with the smallest other pipeline (a short
   one first), which a template always fits when ``N - f n0 >= 2 n0 - 1`` (Appendix B).
Pipelines that lost nothing and lent nothing keep their nodes and positions. If the steps end with fewer than
``f + 1`` pipelines, or a merge has no template (only when templates stop short of ``2 n0 - 1`` nodes), every
survivor is re-instantiated from the templates (Section 4.2), which Theorem A.1 guarantees to succeed.

Recovery in place is impossible, and the result says so, when a layer lost every replica or fewer than
``(f + 1) n0`` nodes survive (the paper stops the job there).

Joins re-instantiate all nodes from the templates.

Where a changed pipeline's nodes sit is chosen to copy the fewest bytes: an assignment problem (nodes to
positions, cost = bytes of the layers the position needs and the node lacks), solved exactly by scipy's
``linear_sum_assignment``. A copy comes from the same node when another of its GPUs holds the layer, else from the
surviving holder that has been given the fewest bytes to send so far, so sources spread over the replicas.
Copies are per GPU: with a tensor-parallel stage a copy names one GPU of the source stage for the layer.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from ftlab.policies.oobleck.instantiate import InstantiationError, PipelineInstance, instantiate
from ftlab.policies.oobleck.templates import PipelineTemplate, TemplateSet

Slot = tuple[int, int]  # (node id, local GPU)


@dataclass(frozen=True)
class LayerCopy:
    """Copy ``layer`` (weights and optimizer state) from a GPU that holds it to one that needs it."""

    layer: int
    src_node: int
    src_gpu: int
    dst_node: int
    dst_gpu: int


@dataclass(frozen=True)
class Reconfigured:
    pipelines: tuple[PipelineInstance, ...]
    copies: tuple[LayerCopy, ...]
    actions: tuple[str, ...]
    """What was done, in words, for the event log."""


@dataclass(frozen=True)
class Impossible:
    reason: str


def holdings(pipelines: Iterable[PipelineInstance]) -> dict[Slot, range]:
    """The layers each GPU holds."""
    return {slot: layers for p in pipelines for slot, layers in p.held}


def _lost_layers(held: dict[Slot, range], num_layers: int) -> list[int]:
    alive = set().union(*held.values()) if held else set()
    return [layer for layer in range(num_layers) if layer not in alive]


def _place(
    templates: Sequence[PipelineTemplate], nodes: Sequence[int], held: dict[Slot, range], layer_bytes: np.ndarray
) -> list[PipelineInstance]:
    """Put ``nodes`` on the positions of ``templates`` (as many positions as nodes) copying the fewest bytes."""
    held_by_node = np.zeros((len(nodes), len(layer_bytes)), dtype=bool)
    row = {node: i for i, node in enumerate(nodes)}
    for (node, _), layers in held.items():
        if node in row:
            held_by_node[row[node], layers.start : layers.stop] = True
    positions = [(t, pos) for t in range(len(templates)) for pos in range(templates[t].num_nodes)]
    need = np.zeros((len(positions), len(layer_bytes)))
    for i, (t, pos) in enumerate(positions):
        layers = templates[t].node_layers(pos)
        need[i, layers.start : layers.stop] = layer_bytes[layers.start : layers.stop]
    cost = (~held_by_node).astype(float) @ need.T  # [node, position]: bytes the node would have to receive
    rows, cols = linear_sum_assignment(cost)
    at = {positions[c]: nodes[r] for r, c in zip(rows, cols)}
    return [PipelineInstance(t, tuple(at[(i, pos)] for pos in range(t.num_nodes))) for i, t in enumerate(templates)]


def _copies(moved: Sequence[PipelineInstance], held: dict[Slot, range], layer_bytes: np.ndarray) -> tuple[LayerCopy, ...]:
    """The copies that give the GPUs of ``moved`` (the new pipelines that are not running already: the others' GPUs
    hold their layers) the layers they lack."""
    needed: list[tuple[Slot, int]] = []  # (GPU, layer) it lacks
    for dst, layers in holdings(moved).items():
        have = held.get(dst, range(0))
        if have.start <= layers.start and layers.stop <= have.stop and have:
            continue
        needed.extend((dst, layer) for layer in layers if layer not in have)
    needed.sort()  # by GPU, then layer
    wanted = {layer for _, layer in needed}
    slots_of: dict[range, list[Slot]] = defaultdict(list)  # a thousand GPUs hold a few dozen distinct ranges
    for slot, layers in held.items():
        slots_of[layers].append(slot)
    holders: dict[int, list[Slot]] = defaultdict(list)
    for layers, slots in slots_of.items():
        for layer in wanted.intersection(layers):
            holders[layer].extend(slots)
    for slots in holders.values():
        slots.sort()
    sent: dict[Slot, float] = dict.fromkeys(held, 0.0)
    nbytes = layer_bytes.tolist()
    copies = []
    for dst, layer in needed:
        slots = holders[layer]
        first = bisect.bisect_left(slots, (dst[0],))  # the first GPU of dst's node that holds the layer, if any
        local = first < len(slots) and slots[first][0] == dst[0]
        src = slots[first] if local else _least_sent(slots, sent)
        sent[src] += nbytes[layer]
        copies.append(LayerCopy(layer, src[0], src[1], dst[0], dst[1]))
    return tuple(copies)


def _least_sent(holders: list[Slot], sent: dict[Slot, float]) -> Slot:
    """The holder that has been given the fewest bytes to send, the lowest among equals (``holders`` are sorted).
    Most have sent nothing yet, and the first of those is the answer: no scan of every holder for every copy."""
    for slot in holders:
        if not sent[slot]:
            return slot
    return min(holders, key=lambda s: (sent[s], s))


def reinstantiate(
    nodes: Sequence[int], held: dict[Slot, range], templates: TemplateSet, max_pipelines: int | None, why: str
) -> Reconfigured | Impossible:
    """Every one of ``nodes`` re-instantiated from the templates, the layers each GPU lacks copied from the GPUs that
    hold them (``held``, from any layout: another policy's plan under ``policy=adaptive``)."""
    gone = _lost_layers(held, len(templates.layer_bytes))
    if gone:
        return Impossible(f"{why}, and layers {gone} have no live replica: restart from saved state")
    return _reinstantiate_all(nodes, held, templates, max_pipelines, why)


def _reinstantiate_all(
    nodes: Sequence[int], held: dict[Slot, range], templates: TemplateSet, max_pipelines: int | None, why: str,
    current: Iterable[PipelineInstance] = (),
) -> Reconfigured | Impossible:
    """``current``: the pipelines running now; a new pipeline equal to one of them is that one, whose GPUs hold their
    layers already (a join re-places a thousand GPUs mostly where they were: only the others are looked at)."""
    try:
        counts = instantiate(templates, len(nodes), max_pipelines)
    except InstantiationError as error:
        return Impossible(f"{why}, and re-instantiating {len(nodes)} nodes failed: {error}")
    chosen = [templates.for_nodes(size) for size in sorted(counts, reverse=True) for _ in range(counts[size])]
    layer_bytes = np.asarray(templates.layer_bytes, dtype=float)
    running = {p: p for p in current}
    new, moved = [], []
    for placed in _place(chosen, sorted(nodes), held, layer_bytes):
        same = running.get(placed)
        new.append(same or placed)
        if same is None:
            moved.append(placed)
    action = f"{why}: re-instantiated {len(nodes)} nodes as pipelines of {sorted(counts.items())} (size, count)"
    return Reconfigured(tuple(new), _copies(moved, held, layer_bytes), (action,))


@dataclass(eq=False)
class _Group:
    """Nodes that will form one pipeline, in their old pipeline order."""

    nodes: list[int]
    changed: bool


def _repair(
    pipelines: Sequence[PipelineInstance], lost: set[int], templates: TemplateSet
) -> tuple[list[_Group], list[str]] | None:
    """The paper's three steps: the groups of nodes and what was done; None when a merge has no template."""
    n0 = templates.min_nodes
    groups: list[_Group] = []
    actions: list[str] = []
    for p in pipelines:
        alive = [n for n in p.nodes if n not in lost]
        if alive:
            groups.append(_Group(alive, changed=len(alive) < len(p.nodes)))
            if groups[-1].changed and len(alive) >= n0:
                actions.append(f"reinstantiate the pipeline on nodes {alive}")
    while short := [g for g in groups if len(g.nodes) < n0]:
        needy = min(short, key=lambda g: len(g.nodes))
        donors = [g for g in groups if len(g.nodes) > n0]
        if donors:
            donor = max(donors, key=lambda g: len(g.nodes))
            node = donor.nodes.pop()
            actions.append(f"borrow node {node} for the pipeline on nodes {needy.nodes}")
            needy.nodes.append(node)
            donor.changed = needy.changed = True
            continue
        others = [g for g in groups if g is not needy]
        if not others:
            return None
        partner = min(others, key=lambda g: (len(g.nodes) >= n0, len(g.nodes)))
        if templates.for_nodes(len(needy.nodes) + len(partner.nodes)) is None:
            return None
        actions.append(f"merge the pipelines on nodes {needy.nodes} and {partner.nodes}")
        groups.remove(partner)
        needy.nodes.extend(partner.nodes)
    return groups, actions


def on_failure(
    pipelines: Sequence[PipelineInstance],
    lost_nodes: Iterable[int],
    templates: TemplateSet,
    max_pipelines: int | None = None,
) -> Reconfigured | Impossible:
    """New pipelines on the surviving nodes and the layer copies that complete them."""
    lost = set(lost_nodes)
    old = holdings(pipelines)
    held = {slot: layers for slot, layers in old.items() if slot[0] not in lost}
    gone = _lost_layers(held, len(templates.layer_bytes))
    if gone:
        return Impossible(f"layers {gone} lost every replica with nodes {sorted(lost)}: restart from a checkpoint")
    survivors = sorted({n for p in pipelines for n in p.nodes} - lost)
    least = (templates.fault_threshold + 1) * templates.min_nodes
    if len(survivors) < least:
        return Impossible(
            f"{len(survivors)} nodes survive; f + 1 = {templates.fault_threshold + 1} pipelines need at least {least}"
        )
    repaired = _repair(pipelines, lost, templates)
    if repaired is None or len(repaired[0]) < templates.fault_threshold + 1:
        why = "a merged pipeline has no template" if repaired is None else "too few pipelines after merging"
        return _reinstantiate_all(survivors, held, templates, max_pipelines, why, pipelines)
    groups, actions = repaired
    layer_bytes = np.asarray(templates.layer_bytes, dtype=float)
    kept = {p.nodes: p for p in pipelines}
    new, moved = [], []
    for group in groups:
        if group.changed:
            moved.extend(_place([templates.for_nodes(len(group.nodes))], group.nodes, held, layer_bytes))
            new.append(moved[-1])
        else:
            new.append(kept[tuple(group.nodes)])
    return Reconfigured(tuple(new), _copies(moved, held, layer_bytes), tuple(actions))


def on_join(
    pipelines: Sequence[PipelineInstance],
    joined_nodes: Iterable[int],
    templates: TemplateSet,
    max_pipelines: int | None = None,
) -> Reconfigured | Impossible:
    """Re-instantiate every node, old and new, from the templates; new nodes receive their layers by copy."""
    nodes = sorted({n for p in pipelines for n in p.nodes} | set(joined_nodes))
    why = f"nodes {sorted(joined_nodes)} joined"
    return _reinstantiate_all(nodes, holdings(pipelines), templates, max_pipelines, why, pipelines)
