"""Oobleck's planning: node specification, GPU-to-stage mapping, instantiation, batch distribution,
reconfiguration and plans, checked against brute force and against the paper's guarantees."""

from __future__ import annotations

import dataclasses
import itertools
import math
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ftlab.policies.oobleck.batch import BatchError, distribute_batch, microbatch_count, nearest_feasible_batch
from ftlab.policies.oobleck.costs import stage_costs
from ftlab.policies.oobleck.instantiate import InstantiationError, PipelineInstance, assign_nodes, instantiate
from ftlab.policies.oobleck.mapping import StageMapper
from ftlab.policies.oobleck.reconfigure import Impossible, Reconfigured, holdings, on_failure, on_join
from ftlab.policies.oobleck.templates import (
    TemplatePlanner,
    TemplateSet,
    generate_templates,
    node_specification,
    uncovered_node_counts,
)
from ftlab.policies.oobleck.to_plan import to_plan, worker_transfers
from ftlab.runtime.core.plan import PlanError
from ftlab.runtime.core.costs import CostModel, LayerProfile, ModelProfile

GB = 1 << 30
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def uniform_profile(layers: int, memory: int = 80 * GB, static: int = GB // 4, saved: int = GB // 64) -> ModelProfile:
    layer = LayerProfile(0.01, 0.01, 0.01, static // 4, static - static // 4, 8 << 20, saved)
    return ModelProfile("uniform", "test", 1, 1, (layer,) * layers, memory, 25e9, 300e9, 25e9)


@st.composite
def profiles(draw: st.DrawFn, max_layers: int = 8) -> ModelProfile:
    """Random per-layer costs; memory from roomy to so tight that few layouts fit."""
    n = draw(st.integers(2, max_layers))
    time = st.floats(0.1, 1.0)
    layers = tuple(
        LayerProfile(draw(time), draw(time), draw(time), draw(st.integers(1, 100)), draw(st.integers(1, 300)),
                     draw(st.integers(1, 50)), draw(st.integers(1, 50)))
        for _ in range(n)
    )
    static = sum(layer.param_bytes + layer.optimizer_bytes for layer in layers)
    memory = int(static * draw(st.sampled_from([0.3, 0.6, 1.0, 5.0])))
    p2p, allreduce = draw(st.floats(50, 500)), draw(st.floats(100, 1000))
    return ModelProfile("random", "test", 1, 1, layers, memory, p2p, allreduce, 100.0)


def paper_time(times: list[float], microbatches: int) -> float:
    """T1 + T2 + T3 (Eq. 1-4) of a pipeline whose stages take ``times``; k* is the last slowest stage."""
    slowest = max(times)
    k = max(i for i, t in enumerate(times) if t == slowest)
    return sum(times) + (microbatches - len(times) + k - 1) * slowest + sum(times[k:])


# ------------------------------------------------------------------------------------------ node specification


def most_pipelines(sizes: range, total: int) -> int:
    """Coin change by brute force: the most templates summing to ``total`` exactly (-1 if none)."""
    best = [-1] * (total + 1)
    best[0] = 0
    for m in range(1, total + 1):
        best[m] = max((best[m - s] + 1 for s in sizes if s <= m and best[m - s] >= 0), default=-1)
    return best[total]


@given(n0=st.integers(1, 6), f=st.integers(0, 4), extra=st.integers(0, 40))
@settings(max_examples=150, deadline=None)
def test_templates_cover_every_feasible_node_count(n0: int, f: int, extra: int) -> None:
    """Theorem A.1: every N' in [(f+1) n0, N] is a sum of at least f + 1 template sizes."""
    total = (f + 1) * n0 + extra
    sizes = node_specification(total, f, n0)
    assert sizes.start == n0 and sizes.stop - 1 == max(total - f * n0, 2 * n0 - 1)
    for nodes in range((f + 1) * n0, total + 3 * n0):  # past N too: joins stay covered
        assert most_pipelines(sizes, nodes) >= f + 1, nodes
    assert uncovered_node_counts(sizes, total, f) == []


@given(a=st.integers(1, 6), width=st.integers(0, 8), f=st.integers(0, 3), total=st.integers(1, 60))
@settings(max_examples=150, deadline=None)
def test_uncovered_counts_match_brute_force_for_truncated_ranges(a: int, width: int, f: int, total: int) -> None:
    sizes = range(a, a + width + 1)
    expected = [m for m in range((f + 1) * a, total + 1) if most_pipelines(sizes, m) < f + 1]
    assert uncovered_node_counts(sizes, total, f) == expected


def test_too_few_nodes_for_f_plus_one_pipelines_is_refused() -> None:
    with pytest.raises(ValueError, match="use at least 6 nodes"):
        node_specification(5, 2, 2)


# ------------------------------------------------------------------------------------------ GPU-to-stage mapping


def reference_mapping(profile: ModelProfile, gpus: int, degrees: tuple[int, ...], nodes: int) -> float | None:
    """The mapping recursion written plainly: node runs as "first stage | rest", pipelines as "first node | rest",
    one best (T1, slowest, k*, T3) per sub-problem; the least T / (4 S) over S."""
    costs = stage_costs(profile, degrees)
    layers = costs.num_layers
    fits = {g: costs.max_in_flight(g) for g in degrees}

    def time(g: int, u: int, w: int) -> float:
        return float(costs.time[g][u, w])

    def total(parts: tuple, stages: int) -> float:
        return parts[0] + (3 * stages + parts[2] - 1) * parts[1] + parts[3]

    @cache
    def run(g: int, i: int, u: int, w: int) -> tuple | None:
        if i == 1:
            if w <= u or fits[g][u, w] < 1:
                return None
            return (time(g, u, w), time(g, u, w), 0, time(g, u, w), int(fits[g][u, w]))
        best, best_total = None, math.inf
        for x in range(u + 1, w):
            rest = run(g, i - 1, x, w)
            if fits[g][u, x] < i or rest is None or rest[4] < i - 1:
                continue
            a = time(g, u, x)
            parts = (a + rest[0], rest[1], 1 + rest[2], rest[3]) if rest[1] >= a else (a + rest[0], a, 0, a + rest[0])
            if total(parts, i) < best_total:
                best, best_total = parts + (min(int(fits[g][u, x]), 1 + rest[4]),), total(parts, i)
        return best

    @cache
    def suffix(j: int, u: int, stages: int) -> tuple | None:
        if j == 1:
            for g in degrees:
                r = run(g, stages, u, layers) if gpus // g == stages else None
                if r is not None and r[4] >= stages:
                    return r[:4]
            return None
        best, best_total = None, math.inf
        for g in degrees:
            q = gpus // g
            for w in range(u + 1, layers + 1):
                a = run(g, q, u, w)
                b = suffix(j - 1, w, stages - q) if stages > q else None
                if a is None or a[4] < stages or b is None:
                    continue
                if b[1] >= a[1]:
                    parts = (a[0] + b[0], b[1], q + b[2], b[3])
                else:
                    parts = (a[0] + b[0], a[1], a[2], a[3] + b[0])
                if total(parts, stages) < best_total:
                    best, best_total = parts, total(parts, stages)
        return best

    found = [
        total(r, s) / (4 * s) for s in range(1, min(layers, nodes * gpus) + 1) if (r := suffix(nodes, 0, s)) is not None
    ]
    return min(found) if found else None


def exhaustive_mapping(profile: ModelProfile, gpus: int, degrees: tuple[int, ...], nodes: int) -> float | None:
    """The least T / (4 S) over every pipeline with equal degrees per node that fits in memory."""
    costs = stage_costs(profile, degrees)
    layers, best = costs.num_layers, math.inf
    for cuts in itertools.combinations(range(1, layers), nodes - 1):
        bounds = (0, *cuts, layers)
        per_node = []
        for u, w in zip(bounds, bounds[1:]):
            runs = []
            for g in degrees:
                for inner in itertools.combinations(range(u + 1, w), gpus // g - 1):
                    edges = (u, *inner, w)
                    runs.append([(a, b, g) for a, b in zip(edges, edges[1:])])
            per_node.append(runs)
        for combo in itertools.product(*per_node):
            stages = [s for run in combo for s in run]
            n = len(stages)
            if all(costs.memory(a, b, g, n - i) <= costs.capacity for i, (a, b, g) in enumerate(stages)):
                best = min(best, paper_time([float(costs.time[g][a, b]) for a, b, g in stages], 4 * n) / (4 * n))
    return best if best < math.inf else None


def mapped(profile: ModelProfile, gpus: int, degrees: tuple[int, ...], nodes: int) -> float | None:
    costs = stage_costs(profile, degrees)
    placements = StageMapper(costs, gpus, degrees).best(nodes)
    if placements is None:
        return None
    times = [float(costs.time[p.degree][p.start, p.stop]) for p in placements]
    return paper_time(times, 4 * len(times)) / (4 * len(times))


@given(profile=profiles(max_layers=9), shape=st.sampled_from([(1, (1,)), (2, (1, 2)), (4, (1, 2, 4)), (4, (2, 4))]),
       nodes=st.integers(1, 4))
@FAST
def test_vectorised_mapping_equals_the_plain_recursion(profile: ModelProfile, shape: tuple, nodes: int) -> None:
    gpus, degrees = shape
    assume(nodes <= profile.num_layers)
    expected = reference_mapping(profile, gpus, degrees, nodes)
    got = mapped(profile, gpus, degrees, nodes)
    assert (got is None) == (expected is None)
    if got is not None:
        assert got == pytest.approx(expected, rel=1e-9)


@given(profile=profiles(max_layers=6), shape=st.sampled_from([(1, (1,)), (2, (1, 2))]), nodes=st.integers(1, 3))
@FAST
def test_mapping_finds_a_layout_whenever_one_fits_and_never_beats_exhaustive_search(
    profile: ModelProfile, shape: tuple, nodes: int
) -> None:
    gpus, degrees = shape
    assume(nodes <= profile.num_layers)
    optimum = exhaustive_mapping(profile, gpus, degrees, nodes)
    got = mapped(profile, gpus, degrees, nodes)
    if optimum is None:
        assert got is None
    elif got is not None:  # the paper's search keeps one solution per sub-problem: it may miss under tight memory
        assert got >= optimum * (1 - 1e-9)


@given(profile=profiles(max_layers=12), gpus=st.sampled_from([1, 2, 4]), nodes=st.integers(1, 5),
       tensor_parallel=st.booleans())
@FAST
def test_templates_are_well_formed_and_fit_in_memory(
    profile: ModelProfile, gpus: int, nodes: int, tensor_parallel: bool
) -> None:
    template = TemplatePlanner(profile, gpus, tensor_parallel).template(nodes)
    assume(template is not None)
    assert template.stages[0].start == 0 and template.stages[-1].stop == profile.num_layers
    assert all(a.stop == b.start for a, b in zip(template.stages, template.stages[1:]))
    assert [s.node for s in template.stages] == sorted(s.node for s in template.stages)
    for position in range(nodes):  # stages never span nodes; every GPU of every node runs exactly one stage
        gpus_used = sorted(g for s in template.node_stages(position) for g in s.gpus)
        assert gpus_used == list(range(gpus))
    if not tensor_parallel:
        assert all(len(s.gpus) == 1 for s in template.stages)
    costs = stage_costs(profile, tuple(range(1, gpus + 1)))
    for i, s in enumerate(template.stages):  # 1F1B: stage i of S holds S - i micro-batches
        need = costs.memory(s.start, s.stop, len(s.gpus), template.num_stages - i)
        assert s.memory_bytes == int(need) <= profile.device_memory_bytes
    times = [s.time_s for s in template.stages]
    for nb in (1, template.num_stages, 4 * template.num_stages, 50):
        assert template.iteration_time(nb) == pytest.approx(paper_time(times, nb), rel=1e-12)


@given(profile=profiles(), precision=st.sampled_from(["fp32", "bf16", "fp16"]), checkpointing=st.booleans())
@FAST
def test_a_stage_s_memory_is_the_preflight_check_s(profile: ModelProfile, precision: str, checkpointing: bool) -> None:
    """The templates count a stage's memory as the check before any worker starts does (``CostModel.stage_memory``,
    ``stage_footprint``): with autocast's copy of the weights under bf16 and fp16 too, or a template the search
    found to fit would be refused (as a 7-of-8-layer stage of gpt2-tiny on 40 MB devices was)."""
    profile = dataclasses.replace(profile, precision=precision, activation_checkpointing=checkpointing)
    costs, reference = stage_costs(profile, (1,)), CostModel(profile)
    n = profile.num_layers
    for start, stop in itertools.combinations(range(n + 1), 2):
        for in_flight in (1, 2, n):
            want = reference.stage_memory(start, stop, in_flight)
            assert costs.memory(start, stop, 1, in_flight) == pytest.approx(want, rel=1e-12)


def test_uniform_layers_are_split_evenly() -> None:
    template = TemplatePlanner(uniform_profile(24), gpus_per_node=1).template(8)
    assert [(s.start, s.stop) for s in template.stages] == [(3 * i, 3 * i + 3) for i in range(8)]


def test_minimum_nodes_come_from_memory() -> None:
    # 8 layers of 1 GiB of weights and optimizer state; 3 GiB per GPU, 2 GPUs per node: 8 GiB need 2 nodes.
    profile = uniform_profile(8, memory=3 * GB, static=GB, saved=1)
    assert TemplatePlanner(profile, gpus_per_node=2).min_nodes(limit=8) == 2
    assert TemplatePlanner(profile, gpus_per_node=2).template(1) is None


# ------------------------------------------------------------------------------------------ instantiation


def enumerate_counts(sizes: range, nodes: int, least: int) -> list[dict[int, int]]:
    """The paper's Eq. 5: every combination of template counts using exactly ``nodes`` nodes."""
    table: list[list[dict[int, int]]] = [[{}]] + [[] for _ in range(nodes)]
    for size in sizes:
        for m in range(size, nodes + 1):
            table[m] += [{**x, size: x.get(size, 0) + 1} for x in table[m - size]]
    return [x for x in table[nodes] if sum(x.values()) >= least]


@given(layers=st.integers(6, 12), gpus=st.sampled_from([1, 2]), f=st.integers(0, 2), extra=st.integers(0, 8),
       fed=st.integers(1, 12))
@settings(max_examples=25, deadline=None)
def test_instantiation_uses_all_nodes_and_matches_enumeration(
    layers: int, gpus: int, f: int, extra: int, fed: int
) -> None:
    # Slightly uneven layers so that templates of different sizes differ in rate.
    base = uniform_profile(layers)
    ragged = tuple(
        LayerProfile(l.fwd_s * (1 + 0.1 * (i % 3)), l.bwd_input_s, l.bwd_weight_s, l.param_bytes, l.optimizer_bytes,
                     l.output_bytes, l.saved_bytes) for i, l in enumerate(base.layers)
    )
    profile = ModelProfile(**{**base.__dict__, "layers": ragged})
    nodes = (f + 1) + extra
    templates = generate_templates(profile, nodes, f, gpus)
    options = [
        x for x in enumerate_counts(templates.sizes, nodes, f + 1) if sum(x.values()) <= fed
    ]
    if not options:
        with pytest.raises(InstantiationError):
            instantiate(templates, nodes, max_pipelines=fed)
        return
    counts = instantiate(templates, nodes, max_pipelines=fed)
    assert sum(size * c for size, c in counts.items()) == nodes
    assert f + 1 <= sum(counts.values()) <= fed
    rate = lambda x: sum(templates.for_nodes(s).rate * c for s, c in x.items())  # noqa: E731
    assert rate(counts) == pytest.approx(max(rate(x) for x in options), rel=1e-6)
    pipelines = assign_nodes(templates, counts, list(range(100, 100 + nodes)))
    assert sorted(n for p in pipelines for n in p.nodes) == list(range(100, 100 + nodes))


def test_instantiation_refuses_too_few_nodes() -> None:
    templates = generate_templates(uniform_profile(8), 6, 1, 1)
    with pytest.raises(InstantiationError, match="f \\+ 1 = 2"):
        instantiate(templates, 1)


# ------------------------------------------------------------------------------------------ batch distribution


def small_templates() -> list:
    """Three templates of different speeds and fill times."""
    planner = TemplatePlanner(uniform_profile(12), gpus_per_node=1)
    return [planner.template(n) for n in (1, 2, 3)]


def compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield [b - a for a, b in zip(edges, edges[1:])]


@given(kinds=st.lists(st.integers(0, 2), min_size=1, max_size=4), extra=st.integers(0, 10))
@settings(max_examples=30, deadline=None)
def test_minmax_distribution_is_optimal(kinds: list[int], extra: int) -> None:
    templates = small_templates()
    pipelines = [templates[k] for k in kinds]
    total = len(pipelines) + extra
    split = distribute_batch(pipelines, global_batch=2 * total, micro_batch=2)
    assert sum(split.microbatches) == total and min(split.microbatches) >= 1
    best = min(max(p.iteration_time(n) for p, n in zip(pipelines, c)) for c in compositions(total, len(pipelines)))
    assert split.iteration_s == pytest.approx(best, rel=1e-6)


def test_variance_distribution_solves_equation_6() -> None:
    templates = small_templates()
    pipelines = [templates[0], templates[1], templates[2], templates[2]]
    total = 13

    def variance(counts: list[int]) -> float:
        times = [p.iteration_time(n) for p, n in zip(pipelines, counts)]
        return float(np.var(times))

    split = distribute_batch(pipelines, global_batch=total, micro_batch=1, method="variance")
    assert sum(split.microbatches) == total
    assert variance(list(split.microbatches)) == pytest.approx(min(map(variance, compositions(total, 4))), abs=1e-9)


@given(batch=st.integers(1, 200), micro=st.integers(1, 9), pipelines=st.integers(1, 12))
@settings(max_examples=200, deadline=None)
def test_an_unsplittable_batch_gets_the_nearest_splittable_one(batch: int, micro: int, pipelines: int) -> None:
    feasible = lambda b: b % micro == 0 and b // micro >= pipelines  # noqa: E731
    if feasible(batch):
        assert microbatch_count(batch, micro, pipelines) == batch // micro
        return
    with pytest.raises(BatchError, match="use global batch") as error:
        microbatch_count(batch, micro, pipelines)
    suggested = error.value.suggested
    assert suggested == nearest_feasible_batch(batch, micro, pipelines) and feasible(suggested)
    candidates = range(1, 2 * (batch + micro * pipelines))
    assert not [b for b in candidates if feasible(b) and abs(b - batch) < abs(suggested - batch)]
    assert str(suggested) in str(error.value)


# ------------------------------------------------------------------------------------------ reconfiguration


def check_reconfigured(
    result: Reconfigured, before: list[PipelineInstance], alive: set[int], templates: TemplateSet, f: int
) -> None:
    nodes = [n for p in result.pipelines for n in p.nodes]
    assert sorted(nodes) == sorted(alive), "every surviving node is used exactly once"
    assert len(result.pipelines) >= f + 1
    for p in result.pipelines:
        assert p.template == templates.for_nodes(len(p.nodes))
    held = {slot: layers for slot, layers in holdings(before).items() if slot[0] in alive}
    copied = {(c.layer, (c.dst_node, c.dst_gpu)): c for c in result.copies}
    assert len(copied) == len(result.copies), "no layer is copied twice to one GPU"
    for slot, layers in holdings(result.pipelines).items():
        for layer in layers:
            if layer in held.get(slot, ()):
                assert (layer, slot) not in copied
            else:
                copy = copied[(layer, slot)]  # every missing layer has a source ...
                assert layer in held[(copy.src_node, copy.src_gpu)]  # ... that survived and holds it


def check_impossible(
    result: Impossible, before: list[PipelineInstance], alive: set[int], templates: TemplateSet
) -> None:
    """In-place recovery fails only when a layer lost every replica, too few nodes survive, or (templates cut
    short by the number of layers) no combination of templates uses the survivors."""
    held = {slot: layers for slot, layers in holdings(before).items() if slot[0] in alive}
    lost = [l for l in range(len(templates.layer_bytes)) if not any(l in r for r in held.values())]
    too_few = len(alive) < (templates.fault_threshold + 1) * templates.min_nodes
    uncovered = most_pipelines(templates.sizes, len(alive)) < templates.fault_threshold + 1
    assert lost or too_few or uncovered, result.reason
    if lost:
        assert "lost every replica" in result.reason
    elif too_few:
        assert "survive" in result.reason


@given(
    layers=st.integers(4, 10), gpus=st.sampled_from([1, 2]), tight=st.booleans(), f=st.integers(0, 2),
    extra=st.integers(0, 8), data=st.data(),
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_failure_sequences_recover_in_place_or_say_why(
    layers: int, gpus: int, tight: bool, f: int, extra: int, data: st.DataObject
) -> None:
    # tight: a node holds half the model, so n0 = 2 and borrowing and merging come into play.
    static = GB // 4
    memory = (layers * static) // (2 * gpus) + static if tight else 64 * GB
    profile = uniform_profile(layers, memory=memory, static=static, saved=1)
    n0 = TemplatePlanner(profile, gpus).min_nodes(limit=layers)
    total = (f + 1) * n0 + extra
    templates = generate_templates(profile, total, f, gpus)
    pipelines = assign_nodes(templates, instantiate(templates, total), list(range(total)))
    alive = set(range(total))
    for _ in range(6):
        if not alive:
            break
        lost = set(data.draw(st.lists(st.sampled_from(sorted(alive)), min_size=1, max_size=3, unique=True)))
        if data.draw(st.booleans()):  # sometimes a node comes back or a new one joins instead
            joined = {max(alive | lost) + 1 + i for i in range(len(lost))}
            result = on_join(pipelines, joined, templates)
            if isinstance(result, Impossible):
                assert most_pipelines(templates.sizes, len(alive | joined)) < f + 1, result.reason
                break
            check_reconfigured(result, pipelines, alive | joined, templates, f)
            alive |= joined
        else:
            alive -= lost
            result = on_failure(pipelines, lost, templates)
            if isinstance(result, Impossible):
                check_impossible(result, pipelines, alive, templates)
                break
            check_reconfigured(result, pipelines, alive, templates, f)
        pipelines = list(result.pipelines)


@pytest.fixture
def two_node_templates():
    """n0 = 2 (a node holds half the model), f = 1, templates of 2..4 nodes."""
    profile = uniform_profile(8, memory=5 * GB, static=GB, saved=1)
    return generate_templates(profile, 6, 1, 1)


def test_failure_reinstantiates_the_affected_pipeline_only(two_node_templates) -> None:
    t = two_node_templates
    pipelines = [PipelineInstance(t.for_nodes(3), (0, 1, 2)), PipelineInstance(t.for_nodes(3), (3, 4, 5))]
    result = on_failure(pipelines, {1}, t)
    assert isinstance(result, Reconfigured)
    assert result.pipelines[1] is pipelines[1]
    assert sorted(result.pipelines[0].nodes) == [0, 2] and result.pipelines[0].template.num_nodes == 2
    assert any("reinstantiate" in a for a in result.actions)


def test_a_short_pipeline_borrows_a_node(two_node_templates) -> None:
    t = two_node_templates
    pipelines = [PipelineInstance(t.for_nodes(2), (0, 1)), PipelineInstance(t.for_nodes(4), (2, 3, 4, 5))]
    result = on_failure(pipelines, {0}, t)
    assert isinstance(result, Reconfigured)
    assert sorted(len(p.nodes) for p in result.pipelines) == [2, 3]
    assert any("borrow" in a for a in result.actions)


def test_short_pipelines_merge_when_no_pipeline_can_lend(two_node_templates) -> None:
    t = two_node_templates
    pipelines = [PipelineInstance(t.for_nodes(2), (0, 1)), PipelineInstance(t.for_nodes(2), (2, 3)),
                 PipelineInstance(t.for_nodes(2), (4, 5))]
    result = on_failure(pipelines, {0}, t)
    assert isinstance(result, Reconfigured)
    assert sorted(len(p.nodes) for p in result.pipelines) == [2, 3]
    assert any("merge" in a for a in result.actions)


def test_a_merge_without_a_template_reinstantiates_every_survivor() -> None:
    # A node holds 3 of 8 layers, so n0 = 3; keep only the 3- and 4-node templates, as when a model cannot spread
    # further: merging a 2-node remnant with a 3-node pipeline would need a 5-node template.
    full = generate_templates(uniform_profile(8, memory=GB * 7 // 2, static=GB, saved=1), 9, 1, 1)
    assert full.min_nodes == 3
    cut = TemplateSet(full.fault_threshold, full.templates[:2], full.layer_bytes)
    pipelines = [PipelineInstance(cut.for_nodes(3), tuple(range(3 * i, 3 * i + 3))) for i in range(3)]
    result = on_failure(pipelines, {0}, cut)
    assert isinstance(result, Reconfigured) and "re-instantiated" in result.actions[0]
    assert sorted(len(p.nodes) for p in result.pipelines) == [4, 4]
    check_reconfigured(result, pipelines, set(range(1, 9)), cut, f=1)


def test_losing_every_replica_of_a_layer_is_reported(two_node_templates) -> None:
    t = two_node_templates
    pipelines = [PipelineInstance(t.for_nodes(3), (0, 1, 2)), PipelineInstance(t.for_nodes(3), (3, 4, 5))]
    result = on_failure(pipelines, {0, 3}, t)  # both first nodes: layers 0.. of both replicas
    assert isinstance(result, Impossible) and "lost every replica" in result.reason


def test_copies_spread_over_the_surviving_replicas() -> None:
    templates = generate_templates(uniform_profile(8), 12, 3, 1)
    pipelines = [PipelineInstance(templates.for_nodes(4), tuple(range(4 * i, 4 * i + 4))) for i in range(3)]
    result = on_join(pipelines, [12, 13, 14, 15], templates)
    assert isinstance(result, Reconfigured)
    sources = {c.src_node for c in result.copies}
    assert len(sources) > 4, "copies come from more than one replica"


# ------------------------------------------------------------------------------------------ plans


def test_instantiation_becomes_a_valid_runtime_plan() -> None:
    profile = uniform_profile(8)
    templates = generate_templates(profile, 4, 1, gpus_per_node=2, tensor_parallel=False)
    counts = instantiate(templates, 4, max_pipelines=8)
    pipelines = assign_nodes(templates, counts, [0, 1, 2, 3])
    split = distribute_batch([p.template for p in pipelines], global_batch=16, micro_batch=2)
    workers = {node: [2 * node, 2 * node + 1] for node in range(4)}
    plan = to_plan(pipelines, split.microbatches, workers, 16, 2, generation=3, step=7)
    assert plan.workers == tuple(range(8)) and plan.generation == 3 and plan.step == 7
    assert [len(p.microbatches) for p in plan.pipelines] == list(split.microbatches)

    result = on_failure(pipelines, {pipelines[0].nodes[0]}, templates)
    assert isinstance(result, Reconfigured)
    survivors = {n: w for n, w in workers.items() if n != pipelines[0].nodes[0]}
    split = distribute_batch([p.template for p in result.pipelines], 16, 2)
    after = to_plan(result.pipelines, split.microbatches, survivors, 16, 2, generation=4)
    assert set(after.workers) == {w for ws in survivors.values() for w in ws}
    moves = worker_transfers(result.copies, survivors)
    for layer, src, dst in moves:  # from a worker that held the layer to one that holds it now
        assert src in plan.holders(layer) and dst in after.holders(layer)
    gained = {(w, layer) for layer in range(8) for w in after.holders(layer) if w not in plan.holders(layer)}
    assert gained == {(dst, layer) for layer, _, dst in moves}


def test_tensor_parallel_templates_have_no_runtime_plan() -> None:
    templates = generate_templates(uniform_profile(8), 2, 1, gpus_per_node=2)
    pipelines = assign_nodes(templates, instantiate(templates, 2), [0, 1])
    wide = any(len(s.gpus) > 1 for p in pipelines for s in p.template.stages)
    assert wide, "uniform layers with a fast intra-node link choose tensor-parallel stages"
    with pytest.raises(PlanError, match="tensor_parallel=False"):
        to_plan(pipelines, [1] * len(pipelines), {0: [0, 1], 1: [2, 3]}, len(pipelines), 1)


def test_min_nodes_raises_the_smallest_template() -> None:
    """A model that fits one node gets templates from one node; ``min_nodes`` (a study's stated pipeline depth) starts
    them there instead, up to the same largest."""
    free = generate_templates(uniform_profile(8), 8, 1, 1)
    deep = generate_templates(uniform_profile(8), 8, 1, 1, min_nodes=2)
    assert free.min_nodes == 1 and deep.min_nodes == 2
    assert min(t.num_nodes for t in deep.templates) == 2
    assert max(t.num_nodes for t in deep.templates) == 8 - 2
