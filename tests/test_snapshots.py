"""REFT's snapshot pieces on their own, in one process: which records each member writes, what survives which
losses, the two-slot files (a torn or corrupted record is never read), and the codec: a group's state written by
its members in every mode and rebuilt bit for bit after any one member's node is lost."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftlab.runtime.state import shm
from ftlab.runtime.core.contract import MemoryRecord, MemorySource
from ftlab.runtime.training.model import build_layer
from ftlab.runtime.core.model_spec import ModelConfig
from ftlab.runtime.training.optim import layer_optimizer
from ftlab.runtime.core.plan import Pipeline, Plan, Stage, grid_plan
from ftlab.runtime.state.snapshot import ShardFiles, geometry, member_state, write_records
from ftlab.runtime.state.snapshot_load import LocalRecord, decode_shard, load_into, read_record
from ftlab.runtime.core.snapshot_layout import (
    Group, Unrecoverable, groups_of, load_plan, lost_shards, records_to_write,
)  # fmt: skip
from ftlab.runtime.training.optim import OptimSettings

MODEL = ModelConfig(num_blocks=2, hidden=32, heads=2, vocab_size=128, seq_len=16)
OPTIM = OptimSettings(lr=1e-2, min_lr=1e-3, warmup_steps=1, total_steps=10, weight_decay=0.01, beta1=0.9, beta2=0.95)


# -- layout ----------------------------------------------------------------------------------------------------------
def test_groups_are_the_holders_of_each_run_of_layers() -> None:
    grid = grid_plan([0, 1, 2, 3, 4, 5], 2, 4, 12, 2)
    assert [(g.layers, g.holders) for g in groups_of(grid)] == [((0, 1), (0, 2, 4)), ((2, 3), (1, 3, 5))]
    hetero = Plan(0, 4, 4, 1, (Pipeline((Stage(0, 0, 3), Stage(1, 3, 4)), (0, 1)), Pipeline((Stage(2, 0, 2), Stage(3, 2, 4)), (2, 3))))
    assert [(g.layers, g.holders) for g in groups_of(hetero)] == [((0, 1), (0, 2)), ((2,), (0, 3)), ((3,), (1, 3))]


@pytest.mark.parametrize(("mode", "kinds"), [("arc", ["shard", "copy"]), ("aec", ["shard", "parity"]),
                                             ("arc+aec", ["shard", "copy", "parity"]), ("aor", ["shard", "copy"])])  # fmt: skip
def test_each_member_writes_its_shard_and_its_protection(mode: str, kinds: list[str]) -> None:
    plan = grid_plan([0, 1, 2, 3, 4, 5], 2, 4, 12, 2)
    records = records_to_write(plan, mode, workers_per_node=1)
    assert [r.kind for r in records[2]] == kinds
    assert records[2][0].index == 1 and records[2][0].node == 2
    if "copy" in kinds:
        assert records[4][kinds.index("copy")].index == 0, "the last member keeps the first one's shard"


@pytest.mark.parametrize("mode", ["arc", "arc+aec"])
@pytest.mark.parametrize(("workers", "stages", "per_node"), [(4, 1, 2), (9, 1, 3), (16, 2, 4), (12, 2, 4), (128, 2, 8)])
def test_where_nodes_run_several_members_a_copy_never_sits_beside_its_shard(
    mode: str, workers: int, stages: int, per_node: int
) -> None:
    plan = grid_plan(list(range(workers)), stages, 4 * stages, workers, 1)
    records = [r for rs in records_to_write(plan, mode, per_node).values() for r in rs]
    owner_node = {(r.layers, r.index): r.node for r in records if r.kind == "shard"}
    assert all(r.node != owner_node[(r.layers, r.index)] for r in records if r.kind == "copy")
    for node in range(workers // per_node):
        assert lost_shards(plan, [r for r in records if r.node != node]) == [], f"node {node}'s loss"


def test_a_node_running_most_of_a_group_keeps_the_neighbours_copy() -> None:
    # Stage 0's members are workers 0, 2, 4 on nodes 0, 0, 1: node 0 has two shards and node 1 one copy to spare.
    plan = grid_plan(list(range(6)), 2, 4, 6, 1)
    copies = {w: [r.index for r in rs if r.kind == "copy"] for w, rs in records_to_write(plan, "arc", 3).items()}
    assert copies == {0: [1], 1: [1], 2: [2], 3: [2], 4: [0], 5: [0]}


def source_of(plan: Plan, mode: str, lost_nodes: set[int]) -> MemorySource:
    records = [r for rs in records_to_write(plan, mode, 1).values() for r in rs if r.node not in lost_nodes]
    return MemorySource(5, plan=plan, workers_per_node=1, records=tuple(records))


@pytest.mark.parametrize("mode", ["arc", "aec", "arc+aec"])
def test_one_lost_node_per_group_is_survived_and_two_are_not(mode: str) -> None:
    plan = grid_plan([0, 1, 2, 3, 4, 5], 2, 4, 12, 2)
    for lost in ({0}, {3}, {0, 3}, {1, 2}):
        assert lost_shards(plan, source_of(plan, mode, lost).records) == []
    lost = lost_shards(plan, source_of(plan, mode, {0, 2}).records)
    assert lost and "layers 0..1" in lost[0]


def test_a_single_holder_is_unprotected() -> None:
    plan = grid_plan([0, 1], 2, 4, 4, 2)
    assert lost_shards(plan, source_of(plan, "arc", {1}).records) == ["shards [0] of layers 2..3 (workers [1])"]


def test_the_load_plan_reads_locally_fetches_from_peers_and_decodes() -> None:
    old = grid_plan([0, 1, 2, 3, 4, 5], 2, 4, 12, 2)
    new = grid_plan([0, 1, 2, 4], 2, 4, 12, 2)  # node 3 lost; node 5 serves as a helper
    arc = load_plan(source_of(old, "arc", {3}), new, helpers=[5])
    (stage1,) = arc[1].groups
    assert stage1.shards[0].sender is None and stage1.shards[1].sender is None, "worker 1 holds shard 0 and a copy of 1"
    assert stage1.shards[2].sender == 5, "shard 2 lives on node 5 only now"
    assert (stage1.shards[2].record, 1, stage1.shards[2].tag) in arc[5].sends
    aec = load_plan(source_of(old, "aec", {3}), new, helpers=[5])
    (stage1,) = aec[1].groups
    assert list(stage1.decode) == [1] and sorted(f.record.index for f in stage1.decode[1]) == [0, 2]
    with pytest.raises(Unrecoverable, match="layers 2..3"):
        load_plan(source_of(old, "arc", {3, 5}), new)


# -- files -----------------------------------------------------------------------------------------------------------
def test_a_torn_slot_leaves_the_previous_step_and_a_flipped_byte_is_caught(tmp_path: Path) -> None:
    state, _, _ = replica()
    group = Group(tuple(range(4)), (0, 1))
    record = MemoryRecord(0, group.layers, 2, 0, "shard")
    files = ShardFiles(tmp_path)
    states = {group.layers: member_state(MODEL, group, *state)}
    (first,) = write_records(files, states, [record], step=4, keep=-1)

    def torn() -> None:
        raise KeyboardInterrupt  # the writer dies between its bytes and its commit record

    with pytest.raises(KeyboardInterrupt):
        write_records(files, states, [record], step=5, keep=4, on_record=torn)
    assert shm.inventory(tmp_path, 4) == ({record.name: first.crc}, [])
    assert shm.inventory(tmp_path, 5) == ({}, [])
    assert read_record(tmp_path, first, 4, first.nbytes).numel() == first.nbytes
    with open(tmp_path / record.name, "r+b") as f:  # flip bytes in the committed slot
        slot, _ = shm.find_slot(memoryview(f.read(shm.PAGE)) , 4) or (None, None)
        f.seek(shm.slot_offset(slot, first.nbytes) + 100)
        f.write(b"\xff\x00\xff")
    assert shm.inventory(tmp_path, 4) == ({}, [record.name])
    with pytest.raises(shm.ChecksumError):
        read_record(tmp_path, first, 4, first.nbytes)
    layers = {i: build_layer(MODEL, i, seed=99) for i in group.layers}
    with pytest.raises(shm.ChecksumError):  # read straight into layers, as on the record's own node
        load_into(MODEL, group, {0: LocalRecord(tmp_path, first, 4)}, layers,
                  {i: layer_optimizer(layers[i], OPTIM) for i in group.layers})  # fmt: skip


# -- the codec -------------------------------------------------------------------------------------------------------
def replica() -> tuple[tuple[dict, dict], dict, dict]:
    """Layers with optimizer state after two steps, built the same way every call (so members hold equal state)."""
    torch.manual_seed(0)
    layers = {i: build_layer(MODEL, i, seed=1) for i in range(4)}
    optimizers = {i: layer_optimizer(layers[i], OPTIM) for i in range(4)}
    for _ in range(2):
        for i, layer in layers.items():
            for p in layer.parameters():
                p.grad = torch.randn_like(p)
            optimizers[i].step()
    return (layers, optimizers), layers, optimizers


@pytest.mark.parametrize("mode", ["arc", "aec", "arc+aec"])
@pytest.mark.parametrize("members", [2, 3, 4])
def test_a_group_is_rebuilt_bit_exact_after_losing_any_member(tmp_path: Path, mode: str, members: int) -> None:
    plan = grid_plan(list(range(members)), 1, 4, 2 * members, 2)
    (group,) = groups_of(plan)
    written = []
    for worker, records in records_to_write(plan, mode, 1).items():
        (layers, optimizers), _, _ = replica()
        states = {group.layers: member_state(MODEL, group, layers, optimizers)}
        directory = tmp_path / f"node-{worker}"
        directory.mkdir()
        written += write_records(ShardFiles(directory), states, records, 7, -1)
    _, reference, reference_opt = replica()
    g = geometry(MODEL, group)
    for lost in range(members):
        survivors = tuple(r for r in written if r.node != lost)
        source = MemorySource(7, plan=plan, workers_per_node=1, records=survivors)
        reader = next(w for w in range(members) if w != lost)
        (load,) = load_plan(source, Plan(1, 4, 2, 2, (Pipeline((Stage(reader, 0, 4),), (0,)),)), helpers=[
            w for w in range(members) if w not in (lost, reader)])[reader].groups

        def read(fetch) -> torch.Tensor:  # noqa: ANN001 - a Fetch; a sender would read it on its node the same way
            return read_record(tmp_path / f"node-{fetch.record.node}", fetch.record, 7, fetch.record.nbytes)

        shards = {i: read(f) for i, f in load.shards.items()}
        for i, fetches in load.decode.items():
            shards[i] = decode_shard(g, i, shards, {f.record.index: read(f) for f in fetches})
        primaries = {r.index: r.crc for r in written if r.kind == "shard"}
        assert {i: shm.checksum(s.numpy()) for i, s in shards.items()} == primaries
        # From the bytes in memory into every layer; then with the records read straight into the layers (as on
        # their own node), into all but the first layer (a worker holding part of the old group).
        unread = {i: LocalRecord(tmp_path / f"node-{f.record.node}", f.record, 7) for i, f in load.shards.items()}
        for held, sources in ((range(4), shards), (range(1, 4), {**shards, **unread})):
            layers = {i: build_layer(MODEL, i, seed=99) for i in held}
            optimizers = {i: layer_optimizer(layers[i], OPTIM) for i in held}
            load_into(MODEL, group, sources, layers, optimizers)
            for i in held:
                for p, ref in zip(layers[i].parameters(), reference[i].parameters(), strict=True):
                    assert torch.equal(p, ref)
                    for key in ("exp_avg", "exp_avg_sq", "step"):
                        assert torch.equal(optimizers[i].state[p][key], reference_opt[i].state[ref][key]), key
                    for key in ("exp_avg", "exp_avg_sq"):  # a storage of its own: a checkpoint of a layer is that layer
                        moment = optimizers[i].state[p][key]
                        assert moment.untyped_storage().nbytes() == moment.numel() * moment.element_size()
