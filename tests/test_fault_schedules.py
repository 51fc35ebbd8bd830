"""Fault schedules: the events each schedule produces, trace replay, every validation error, the shipped configs."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from ftlab.faults import (
    BUNDLED_TRACES,
    ClusterShape,
    FaultConfigError,
    FaultEvent,
    FaultEventConfig,
    FaultsConfig,
    build_schedule,
    faults_config_from_dict,
    read_trace,
)
from ftlab.experiments.job import compose_config
from ftlab.faults.schedules import beyond_job, check_reach

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "faults"
TRACE_DIR = Path(__file__).resolve().parents[1] / "faults" / "traces"
FOUR = ClusterShape(nodes=4, workers_per_node=1)


def explicit(*events: FaultEventConfig) -> FaultsConfig:
    return FaultsConfig(schedule="explicit", events=list(events))


def write_trace(tmp_path: Path, text: str) -> str:
    path = tmp_path / "t.csv"
    path.write_text(text)
    return str(path)


def survivors_ok(events: list[FaultEvent], cluster: ClusterShape) -> bool:
    """An independent replay: faults hit live nodes, and some node outlives every node fault."""
    alive = set(range(cluster.nodes))
    for e in events:
        if e.kind == "join":
            alive.add(e.node)
        elif e.node not in alive:
            return False
        elif e.kind == "node":
            alive.remove(e.node)
            if not alive:
                return False
    return True


# --- explicit --------------------------------------------------------------------------------------------------


def test_explicit_events_come_back_sorted_and_serialisable() -> None:
    cfg = explicit(
        FaultEventConfig("node", 3, at_step=20),
        FaultEventConfig("process", 0, worker=1, at_step=5, phase="backward"),
        FaultEventConfig("join", 4, at_step=30),
        FaultEventConfig("hang", 2, worker=0, at_step=12),
    )
    events = build_schedule(cfg, ClusterShape(nodes=4, workers_per_node=2))
    assert events == [
        FaultEvent("process", 0, worker=1, at_step=5, phase="backward"),
        FaultEvent("hang", 2, worker=0, at_step=12),
        FaultEvent("node", 3, at_step=20),
        FaultEvent("join", 4, at_step=30),
    ]
    assert events[0].to_dict() == {"kind": "process", "node": 0, "worker": 1, "at_step": 5, "phase": "backward"}
    assert events[2].to_dict() == {"kind": "node", "node": 3, "at_step": 20}


def test_a_joined_node_can_be_hit_and_keeps_the_cluster_alive() -> None:
    cfg = explicit(
        FaultEventConfig("node", 0, at_time_s=1.0),
        FaultEventConfig("join", 2, at_time_s=2.0),
        FaultEventConfig("node", 1, at_time_s=3.0),
        FaultEventConfig("process", 2, worker=0, at_time_s=4.0),
    )
    events = build_schedule(cfg, ClusterShape(nodes=2, workers_per_node=1))
    assert [(e.kind, e.node) for e in events] == [("node", 0), ("join", 2), ("node", 1), ("process", 2)]


def test_none_schedule_is_empty() -> None:
    assert build_schedule(FaultsConfig(), FOUR) == []


# --- generated ------------------------------------------------------------------------------------------------


def test_fixed_fires_at_exact_multiples_on_distinct_live_nodes() -> None:
    cfg = FaultsConfig(schedule="fixed", interval_s=2.5, max_failures=3, seed=7)
    events = build_schedule(cfg, FOUR)
    assert [e.at_time_s for e in events] == [2.5, 5.0, 7.5]
    assert all(e.kind == "node" and e.worker is None for e in events)
    assert len({e.node for e in events}) == 3  # a dead node is never chosen again
    assert build_schedule(cfg, FOUR) == events
    # Multiples, not a running sum: the tenth fault of a 0.1 s interval is at 1.0 s, not 0.9999999999999999 s.
    tenths = FaultsConfig(schedule="fixed", kind="process", interval_s=0.1, max_failures=10)
    assert [e.at_time_s for e in build_schedule(tenths, FOUR)] == [k * 0.1 for k in range(1, 11)]


def test_fixed_stops_at_the_horizon() -> None:
    cfg = FaultsConfig(schedule="fixed", kind="process", interval_s=10, horizon_s=45)
    events = build_schedule(cfg, ClusterShape(nodes=2, workers_per_node=3))
    assert [e.at_time_s for e in events] == [10, 20, 30, 40]
    assert all(e.kind == "process" and 0 <= e.node < 2 and 0 <= e.worker < 3 for e in events)  # type: ignore[operator]


def test_replacements_join_later_with_new_indices_and_are_hit_in_turn() -> None:
    cfg = FaultsConfig(schedule="fixed", interval_s=10, replace_after_s=5, max_failures=12, seed=1)
    events = build_schedule(cfg, ClusterShape(nodes=2, workers_per_node=1))
    faults = [e for e in events if e.kind == "node"]
    joins = [e for e in events if e.kind == "join"]
    assert len(faults) == 12
    assert [j.node for j in joins] == list(range(2, 14))
    assert [j.at_time_s for j in joins] == [f.at_time_s + 5 for f in faults]  # type: ignore[operator]
    assert any(f.node >= 2 for f in faults)  # replacements are eligible victims
    assert survivors_ok(events, ClusterShape(2, 1))


@pytest.mark.parametrize("seed", range(5))
def test_a_replacement_due_at_a_fault_is_not_its_victim(seed: int) -> None:
    cfg = FaultsConfig(schedule="fixed", interval_s=10, replace_after_s=10, max_failures=8, seed=seed)
    events = build_schedule(cfg, ClusterShape(nodes=3, workers_per_node=1))
    joined_at = {e.node: e.at_time_s for e in events if e.kind == "join"}
    assert all(joined_at.get(e.node) != e.at_time_s for e in events if e.kind == "node")
    assert survivors_ok(events, ClusterShape(3, 1))


@pytest.mark.parametrize(
    "params",
    [{"schedule": "exponential", "mtbf_s": 30.0}, {"schedule": "weibull", "weibull_shape": 0.7, "weibull_scale_s": 30}],
)
def test_random_schedules_are_reproducible_and_seed_sensitive(params: dict) -> None:
    def events(seed: int) -> list[FaultEvent]:
        return build_schedule(FaultsConfig(**params, kind="hang", max_failures=20, seed=seed), FOUR)

    assert events(3) == events(3)
    assert events(3) != events(4)
    assert [e.at_time_s for e in events(3)] == sorted(e.at_time_s for e in events(3))  # type: ignore[type-var]


def test_exponential_gaps_have_mean_mtbf() -> None:
    cfg = FaultsConfig(schedule="exponential", kind="process", mtbf_s=40.0, max_failures=4000, seed=11)
    times = [e.at_time_s for e in build_schedule(cfg, FOUR)]
    gaps = [b - a for a, b in zip([0.0, *times], times)]  # type: ignore[operator]
    # The standard error of the mean of 4000 exponential gaps is mtbf/63, so 6% is about four of them.
    assert statistics.fmean(gaps) == pytest.approx(40.0, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(40.0, rel=0.1)  # exponential: stdev equals the mean


def test_weibull_gaps_have_the_weibull_mean() -> None:
    cfg = FaultsConfig(schedule="weibull", kind="process", weibull_shape=2.0, weibull_scale_s=10, max_failures=4000)
    times = [e.at_time_s for e in build_schedule(cfg, FOUR)]
    gaps = [b - a for a, b in zip([0.0, *times], times)]  # type: ignore[operator]
    assert statistics.fmean(gaps) == pytest.approx(10 * math.gamma(1.5), rel=0.03)


@settings(max_examples=40, deadline=None)
@given(
    schedule=st.sampled_from(["fixed", "exponential", "weibull"]),
    nodes=st.integers(2, 6),
    workers=st.integers(1, 3),
    kind=st.sampled_from(["node", "process", "hang"]),
    seed=st.integers(0, 2**32),
    data=st.data(),
)
def test_generated_schedules_hit_only_live_nodes(schedule, nodes, workers, kind, seed, data) -> None:  # noqa: ANN001
    cluster = ClusterShape(nodes, workers)
    max_failures = data.draw(st.integers(0, nodes - 1 if kind == "node" else 30))
    cfg = FaultsConfig(
        schedule=schedule, kind=kind, seed=seed, max_failures=max_failures,
        interval_s=5.0 if schedule == "fixed" else None, mtbf_s=5.0 if schedule == "exponential" else None,
        weibull_shape=1.3 if schedule == "weibull" else None, weibull_scale_s=5.0 if schedule == "weibull" else None,
    )  # fmt: skip
    events = build_schedule(cfg, cluster)
    assert len(events) == max_failures
    assert survivors_ok(events, cluster)
    assert all((e.worker is None) == (kind == "node") for e in events)
    assert all(0 <= (e.worker or 0) < workers for e in events)


# --- trace replay ----------------------------------------------------------------------------------------------


def trace_facts(name: str) -> tuple[int, int, int, int]:
    """(nodes at the first timestamp, peak nodes, adds after it, removes), counted straight from the file."""
    records = read_trace(name)
    initial = sum(1 for r in records if r.time_ms == records[0].time_ms)
    alive, peak = 0, 0
    for r in records:
        alive += 1 if r.action == "add" else -1
        peak = max(peak, alive)
    removes = sum(r.action == "remove" for r in records)
    return initial, peak, len(records) - removes - initial, removes


@pytest.mark.parametrize("name", sorted(BUNDLED_TRACES))
def test_a_cluster_of_the_traces_size_replays_it_exactly(name: str) -> None:
    initial, peak, later_adds, removes = trace_facts(name)
    cfg = FaultsConfig(schedule="trace", trace=name, max_nodes=peak)
    counts = Counter(e.kind for e in build_schedule(cfg, ClusterShape(initial, 1)))
    assert counts == Counter({"node": removes, "join": later_adds}) - Counter()


def test_bundled_traces_are_the_shipped_copies() -> None:
    assert {f"{p.name}" for p in TRACE_DIR.glob("*.csv")} == set(BUNDLED_TRACES.values())
    readme = (TRACE_DIR / "README.md").read_text()
    assert "MIT licence, Copyright (c) 2023 SymbioticLab, The University of Michigan" in readme
    assert "Oobleck" in readme and "Bamboo" in readme


def test_time_compression_divides_trace_times() -> None:
    first_remove_ms = next(r.time_ms for r in read_trace("5m") if r.action == "remove")
    node_map = {"node14": 0}  # node14 is the first node the 5m trace removes
    for compression in (1.0, 600.0):
        cfg = FaultsConfig(schedule="trace", trace="5m", time_compression=compression, node_map=node_map)
        events = build_schedule(cfg, FOUR)
        assert events == [FaultEvent("node", 0, at_time_s=first_remove_ms / 1000 / compression)]


def test_replay_maps_ignores_absorbs_and_caps_joins(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path,
        "1000,add,a\n1000,add,b\n1000,add,c\n"  # c is beyond a 2-node cluster: ignored with its events
        "2000,remove,c\n"
        "3000,remove,a\n"  # a -> node 0
        "4000,add,d\n"  # a join: 1 node alive < max_nodes 2
        "4000,add,e\n"  # 2 alive already: e is ignored ...
        "5000,remove,e\n"  # ... and so is its removal
        "6000,remove,d\n",
    )
    cfg = FaultsConfig(schedule="trace", trace=trace, time_compression=2.0)
    assert build_schedule(cfg, ClusterShape(2, 1)) == [
        FaultEvent("node", 0, at_time_s=1.0),
        FaultEvent("join", 2, at_time_s=1.5),
        FaultEvent("node", 2, at_time_s=2.5),
    ]
    # Room for more nodes admits more joins, but not c: present at the start, it is no node that joins later.
    cfg.max_nodes = 3
    assert [(e.kind, e.node) for e in build_schedule(cfg, ClusterShape(2, 1))] == [
        ("node", 0), ("join", 2), ("join", 3), ("node", 3), ("node", 2),
    ]  # fmt: skip
    # node_map picks which trace nodes the cluster stands for; unmapped cluster nodes never fail.
    cfg.max_nodes = None
    cfg.node_map = {"c": 1}
    assert build_schedule(cfg, ClusterShape(2, 1)) == [
        FaultEvent("node", 1, at_time_s=0.5),
        FaultEvent("join", 2, at_time_s=1.5),
        FaultEvent("node", 2, at_time_s=2.5),
    ]


def test_nodes_a_short_trace_adds_later_are_up_from_the_start() -> None:
    # g4dn's first timestamp (480 s) holds node1 alone; node2 to node4, added by 600 s, are cluster nodes 1 to 3
    # rather than joins, so the removal of node3 at 1440 s is a fault of cluster node 2, 960 s into the run.
    cfg = FaultsConfig(schedule="trace", trace="g4dn", horizon_s=1000)
    assert build_schedule(cfg, FOUR) == [FaultEvent("node", 2, at_time_s=960.0)]


def test_mapped_nodes_the_trace_adds_later_never_join(tmp_path: Path) -> None:
    trace = write_trace(tmp_path, "0,add,a\n0,add,b\n1000,add,c\n2000,remove,c\n")
    cfg = FaultsConfig(schedule="trace", trace=trace, max_nodes=4)
    assert build_schedule(cfg, ClusterShape(3, 1)) == [FaultEvent("node", 2, at_time_s=2.0)]


def test_a_node_added_and_removed_at_one_instant_is_replayed_in_order() -> None:
    # scale_p3 adds and removes node156 at 39960 s; with room for it, it joins and dies at that instant.
    cfg = FaultsConfig(schedule="trace", trace="scale_p3", max_nodes=100, time_compression=1000)
    events = [e for e in build_schedule(cfg, ClusterShape(20, 1)) if e.at_time_s == 39.96]
    assert [e.kind for e in events] == ["join", "node"] and events[0].node == events[1].node


def test_max_failures_and_horizon_end_the_replay() -> None:
    capped = build_schedule(FaultsConfig(schedule="trace", trace="p3", max_failures=3), FOUR)
    assert sum(e.kind == "node" for e in capped) == 3 and capped[-1].kind == "node"
    horizon = build_schedule(FaultsConfig(schedule="trace", trace="p3", time_compression=60, horizon_s=200), FOUR)
    assert horizon and all(e.at_time_s < 200 for e in horizon)  # type: ignore[operator]
    assert len(horizon) < len(build_schedule(FaultsConfig(schedule="trace", trace="p3"), FOUR))


def test_a_trace_given_by_path_is_read(tmp_path: Path) -> None:
    trace = write_trace(tmp_path, "0,add,x\n0,add,y\n500,remove,y\n")
    assert build_schedule(FaultsConfig(schedule="trace", trace=trace), ClusterShape(2, 1)) == [
        FaultEvent("node", 1, at_time_s=0.5)
    ]


# --- validation ------------------------------------------------------------------------------------------------

E = FaultEventConfig

INVALID: list[tuple[str, FaultsConfig, ClusterShape, str]] = [
    ("unknown schedule", FaultsConfig(schedule="poisson"), FOUR, "unknown fault schedule 'poisson'; use one of"),
    ("unknown kind", explicit(E("crash", 0, at_step=1)), FOUR, r"events\[0\]: unknown fault kind 'crash'"),
    ("unknown generated kind", FaultsConfig(schedule="fixed", kind="disk", interval_s=1, max_failures=1), FOUR,
     "faults.kind 'disk' cannot be generated; use one of node, process, hang"),
    ("generated join", FaultsConfig(schedule="fixed", kind="join", interval_s=1, max_failures=1), FOUR,
     "joins come from replace_after_s"),
    ("node out of range", explicit(E("node", 4, at_step=1)), FOUR, "node 4, which does not exist by then; use a node "
     "from 0 to 3"),
    ("worker out of range", explicit(E("process", 1, worker=2, at_step=1)), ClusterShape(4, 2),
     "worker 2, but nodes have 2 workers; use a worker index from 0 to 1"),
    ("worker missing", explicit(E("hang", 1, at_step=1)), FOUR, "a hang fault hits one worker; set worker"),
    ("worker on a node fault", explicit(E("node", 1, worker=0, at_step=1)), FOUR, r"remove worker \(0\)"),
    ("stall of a node", explicit(E("node", 1, at_step=1, for_s=5.0)), FOUR, "a node fault has no duration; remove for_s"),
    ("stall of no time", explicit(E("hang", 1, worker=0, at_step=1, for_s=0.0)), FOUR, "for_s 0.0 must be .* > 0"),
    ("negative node", explicit(E("node", -1, at_step=1)), FOUR, "node -1 is negative"),
    ("both clocks", explicit(E("node", 1, at_step=1, at_time_s=1.0)), FOUR, "set exactly one of at_step"),
    ("no clock", explicit(E("node", 1)), FOUR, "set exactly one of at_step"),
    ("negative step", explicit(E("node", 1, at_step=-1)), FOUR, "at_step -1 is negative"),
    ("negative time", explicit(E("node", 1, at_time_s=-0.5)), FOUR, "at_time_s -0.5 must be a finite number"),
    ("phase without step", explicit(E("node", 1, at_time_s=1.0, phase="forward")), FOUR,
     "phase 'forward' needs at_step"),
    ("unknown phase", explicit(E("node", 1, at_step=1, phase="allreduce")), FOUR,
     "unknown phase 'allreduce'; use one of forward, backward, reduce, optimizer, checkpoint"),
    ("mixed clocks", explicit(E("node", 1, at_step=1), E("node", 2, at_time_s=1.0)), FOUR,
     "mixes at_step and at_time_s"),
    ("killed twice", explicit(E("node", 1, at_step=1), E("process", 1, worker=0, at_step=2)), FOUR,
     "hits node 1, which was killed at step 1; pick a node alive by then"),
    ("join index", explicit(E("join", 7, at_step=1)), FOUR, "next new node is 4 .*; set node: 4"),
    ("simultaneous", explicit(*(E("node", n, at_step=3) for n in range(2))), ClusterShape(2, 1),
     r"no node survives step 3: .*\(2 node faults at that instant\); at least one node must survive"),
    ("join at the last death", explicit(E("join", 1, at_step=3), E("node", 0, at_step=3)), ClusterShape(1, 1),
     "no node survives step 3"),
    ("every node killed", FaultsConfig(schedule="fixed", interval_s=1, max_failures=4), FOUR,
     "at least one node must survive: lower max_failures or horizon_s, or set replace_after_s"),
    ("zero interval", FaultsConfig(schedule="fixed", interval_s=0, max_failures=1), FOUR,
     "faults.interval_s is 0; set it to a finite number > 0"),
    ("missing mtbf", FaultsConfig(schedule="exponential", max_failures=1), FOUR,
     "the exponential schedule needs faults.mtbf_s"),
    ("negative mtbf", FaultsConfig(schedule="exponential", mtbf_s=-3, max_failures=1), FOUR, "faults.mtbf_s is -3"),
    ("zero shape", FaultsConfig(schedule="weibull", weibull_shape=0, weibull_scale_s=1, max_failures=1), FOUR,
     "faults.weibull_shape is 0"),
    ("negative scale", FaultsConfig(schedule="weibull", weibull_shape=1, weibull_scale_s=-1, max_failures=1), FOUR,
     "faults.weibull_scale_s is -1"),
    ("never ends", FaultsConfig(schedule="exponential", mtbf_s=1), FOUR, "set faults.max_failures or faults.horizon_s"),
    ("negative max_failures", FaultsConfig(schedule="fixed", interval_s=1, max_failures=-1), FOUR,
     "faults.max_failures is -1"),
    ("negative replacement", FaultsConfig(schedule="fixed", interval_s=1, max_failures=1, replace_after_s=-1), FOUR,
     "faults.replace_after_s is -1"),
    ("too many events", FaultsConfig(schedule="fixed", kind="process", interval_s=1, horizon_s=1e9), FOUR,
     "lower horizon_s or set max_failures"),
    ("unused setting", FaultsConfig(schedule="fixed", interval_s=1, max_failures=1, mtbf_s=5), FOUR,
     "faults.mtbf_s is set .* the fixed schedule does not use it; remove it, or choose a schedule that does: "
     "exponential"),
    ("kind with a trace", FaultsConfig(schedule="trace", trace="p3", kind="hang"), FOUR, "faults.kind is set"),
    ("missing trace", FaultsConfig(schedule="trace"), FOUR, "needs faults.trace"),
    ("missing trace file", FaultsConfig(schedule="trace", trace="no/such.csv"), FOUR,
     r"trace file '.*no/such.csv' does not exist; .* bundled traces: p3, g4dn, scale_p3, scale_gcp, 5m"),
    ("zero compression", FaultsConfig(schedule="trace", trace="p3", time_compression=0), FOUR,
     "faults.time_compression is 0; set it to trace seconds per run second, > 0"),
    ("small max_nodes", FaultsConfig(schedule="trace", trace="p3", max_nodes=2), FOUR,
     "faults.max_nodes is 2, below the cluster's 4 nodes"),
    ("node_map name", FaultsConfig(schedule="trace", trace="5m", node_map={"gpu1": 0}), FOUR,
     "node_map names 'gpu1', which trace 5m does not have; use its node names \\(e.g. node1"),
    ("node_map index", FaultsConfig(schedule="trace", trace="5m", node_map={"node1": 4}), FOUR,
     "maps 'node1' to node 4, .* use indices 0 to 3"),
    ("node_map twice", FaultsConfig(schedule="trace", trace="5m", node_map={"node1": 0, "node2": 0}), FOUR,
     "two trace nodes to one cluster node"),
    ("trace kills all", FaultsConfig(schedule="trace", trace="30m"), FOUR,
     "at least one node must survive: set max_failures or horizon_s to end the replay sooner"),
]


@pytest.mark.parametrize(("cfg", "cluster", "message"), [case[1:] for case in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_schedules_say_what_to_change(cfg: FaultsConfig, cluster: ClusterShape, message: str) -> None:
    with pytest.raises(FaultConfigError, match=message):
        build_schedule(cfg, cluster)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,add,a\n5,launch,b\n", r"line 2 \('5,launch,b'\): expected 'delta_ms,add\|remove,nodeN'"),
        ("10,add,a\n5,add,b\n", "line 2 .*time goes back from 10 ms; sort the lines by time"),
        ("0,add,a\n0,remove,b\n", "b is removed while absent"),
        ("0,add,a\n0,add,a\n", "a is added while already present"),
        ("\n", "has no events"),
    ],
)
def test_malformed_traces_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(FaultConfigError, match=message):
        build_schedule(FaultsConfig(schedule="trace", trace=write_trace(tmp_path, text)), FOUR)


def test_schema_violations_become_fault_config_errors() -> None:
    with pytest.raises(FaultConfigError, match="mtbf_s"):
        faults_config_from_dict({"schedule": "exponential", "mtbf_s": "often"})
    with pytest.raises(FaultConfigError, match="node"):
        faults_config_from_dict({"schedule": "explicit", "events": [{"kind": "node", "at_step": 3}]})


# --- configs ---------------------------------------------------------------------------------------------------


def test_the_schema_is_a_valid_structured_config() -> None:
    schema = OmegaConf.structured(FaultsConfig)
    assert schema.schedule == "none" and schema.node_map is None
    # build_schedule takes the OmegaConf form too.
    merged = OmegaConf.merge(schema, {"schedule": "fixed", "interval_s": 3, "max_failures": 1})
    assert [e.at_time_s for e in build_schedule(merged, FOUR)] == [3.0]


@pytest.mark.parametrize("path", sorted(CONF_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_config_builds_on_four_nodes(path: Path) -> None:
    obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FaultsConfig), OmegaConf.load(path)))
    assert isinstance(obj, FaultsConfig)
    events = build_schedule(obj, FOUR)
    assert events == build_schedule(faults_config_from_dict(OmegaConf.load(path)), FOUR)  # type: ignore[arg-type]
    assert (len(events) == 0) == (path.stem == "none")


def test_shipped_configs_cover_every_schedule() -> None:
    assert {OmegaConf.load(p).schedule for p in CONF_DIR.glob("*.yaml")} == {  # type: ignore[union-attr]
        "none", "explicit", "fixed", "exponential", "weibull", "trace",
    }  # fmt: skip


def test_single_node_needs_a_second_node() -> None:
    cfg = faults_config_from_dict(OmegaConf.load(CONF_DIR / "single-node.yaml"))  # type: ignore[arg-type]
    assert build_schedule(cfg, ClusterShape(2, 1)) == [FaultEvent("node", 1, at_step=10)]
    with pytest.raises(FaultConfigError, match="node 1, which does not exist"):
        build_schedule(cfg, ClusterShape(1, 1))


# --- clocks and reach ------------------------------------------------------------------------------------------


def test_generated_rates_in_steps_fire_at_the_step_they_fall_in() -> None:
    fixed = build_schedule(FaultsConfig(schedule="fixed", interval_steps=4, max_failures=2), FOUR)
    assert [e.at_step for e in fixed] == [4, 8] and all(e.at_time_s is None for e in fixed)
    timed = build_schedule(FaultsConfig(schedule="exponential", mtbf_s=4, max_failures=2), FOUR)
    stepped = build_schedule(FaultsConfig(schedule="exponential", mtbf_steps=4, max_failures=2), FOUR)
    assert [e.at_step for e in stepped] == [math.floor(e.at_time_s or 0) for e in timed]  # one draw, two clocks


def test_replacements_and_horizon_follow_the_step_clock() -> None:
    cfg = FaultsConfig(schedule="fixed", interval_steps=5, horizon_steps=12, replace_after_steps=2)
    assert [(e.kind, e.at_step) for e in build_schedule(cfg, FOUR)] == [
        ("node", 5), ("join", 7), ("node", 10),
    ]  # fmt: skip


def test_a_trace_replays_in_steps() -> None:
    events = build_schedule(FaultsConfig(schedule="trace", trace="p3", trace_s_per_step=120, max_failures=1), FOUR)
    assert events[-1].kind == "node" and all(e.at_step is not None for e in events)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (FaultsConfig(schedule="fixed", interval_steps=1, interval_s=1, max_failures=1), "both set"),
        (FaultsConfig(schedule="fixed", interval_steps=2, horizon_s=5), "faults.horizon_s is set but the fixed rate "
         "is in steps; use faults.horizon_steps"),
        (FaultsConfig(schedule="trace", trace="p3", trace_s_per_step=60, time_compression=2), "both set"),
        (FaultsConfig(schedule="weibull", weibull_shape=1, max_failures=1), "needs faults.weibull_scale_steps"),
    ],
)
def test_a_schedule_runs_on_one_clock(cfg: FaultsConfig, message: str) -> None:
    with pytest.raises(FaultConfigError, match=message):
        build_schedule(cfg, FOUR)


def test_an_explicit_fault_past_the_job_is_an_error() -> None:
    cfg = explicit(E("node", 1, at_step=3), E("node", 2, at_step=30))
    with pytest.raises(FaultConfigError, match=r"the node fault at step 30 cannot fire: the job runs steps 0 to 29 "
                       r"\(train.steps=30\); move it into that range or raise train.steps"):  # fmt: skip
        check_reach(cfg, build_schedule(cfg, FOUR), 0, 30)


def test_generated_faults_past_the_job_are_dropped_for_a_warning() -> None:
    cfg = FaultsConfig(schedule="fixed", interval_steps=10, max_failures=3)
    events = build_schedule(cfg, FOUR)
    assert [e.at_step for e in check_reach(cfg, events, 0, 25)] == [10, 20]
    assert [e.at_step for e in beyond_job(events, 0, 25)] == [30]
    assert [e.at_step for e in beyond_job(events, 15, 40)] == [10]  # a resumed job starts at step 15


def test_explicit_faults_before_a_resumed_jobs_first_step_are_dropped_for_a_warning() -> None:
    # The job it resumes ran those steps, with their faults: the same command line with train.resume_from must run.
    cfg = explicit(E("node", 1, at_step=3), E("node", 2, at_step=12))
    events = build_schedule(cfg, FOUR)
    assert [e.at_step for e in check_reach(cfg, events, 8, 30)] == [12]
    assert [e.at_step for e in beyond_job(events, 8, 30)] == [3]


@pytest.mark.parametrize("name", sorted(p.stem for p in CONF_DIR.glob("*.yaml") if p.stem != "none"))
def test_every_shipped_fault_config_fires_in_a_default_job(name: str) -> None:
    """Composed as a user would (``ftlab experiment=plain faults=NAME``: local-4, train.steps of the schema), every
    shipped schedule has a fault at a step the job runs: the shipped rates are per step, so this holds on any
    machine (tests/test_recovery.py fires them on real processes)."""
    cfg = OmegaConf.to_object(compose_config(["experiment=plain", f"faults={name}"]))
    scheduled = build_schedule(cfg.faults, ClusterShape(cfg.cluster.nodes, cfg.cluster.workers_per_node))
    reached = check_reach(cfg.faults, scheduled, 0, cfg.train.steps)
    assert any(e.kind != "join" and e.at_step is not None for e in reached), (name, scheduled)
