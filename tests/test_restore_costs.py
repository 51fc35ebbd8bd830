"""What the simulator charges for restoring saved state on a GPU cluster (``runtime.sim.machines``, its last section).

- A checkpoint in storage is read once per layer, however many data-parallel replicas restore it; the others get it
  by a broadcast over the network.
- REFT's restore from memory charges the records a node's workers send and receive against the node's one NIC, and
  reads a record once however many peers it is sent to.
"""

from __future__ import annotations

import dataclasses

from omegaconf import OmegaConf

from ftlab.experiments.job import compose_config, everyone, job_factory
from ftlab.runtime.core.contract import MemorySource, StorageSource
from ftlab.runtime.core.costs import CostModel
from ftlab.runtime.core.plan import Plan, grid_plan
from ftlab.runtime.core.scheduler import storage_read_chains
from ftlab.runtime.core.snapshot_layout import records_to_write
from ftlab.runtime.sim.machines import DeviceMachine

GBIT_S = 1e9 / 8


def machine(workers_per_node: int, node_gbit_s: float = 100.0) -> DeviceMachine:
    cfg = OmegaConf.to_object(compose_config(["experiment=plain", "model=gpt2-small", "cluster.device=A100-40GB"]))
    profile = job_factory(cfg, None)(everyone(cfg)).profile()  # analytic: the device is a GPU type
    profile = dataclasses.replace(profile, node_network_bytes_per_s=node_gbit_s * GBIT_S)
    sim = dataclasses.replace(cfg.sim, storage_read_bytes_per_s=10 * GBIT_S)
    return DeviceMachine(CostModel(profile), sim, workers_per_node)


def whole_stages(plan: Plan) -> dict[int, tuple[int, ...]]:
    return {worker: tuple(range(a, b)) for worker, (a, b) in plan.layer_ranges().items()}


def test_a_checkpoint_is_read_once_per_stage_and_broadcast_to_the_replicas() -> None:
    m = machine(workers_per_node=2)
    layers = m.costs.profile.num_layers
    one = grid_plan(list(range(2)), 2, layers, 8, 1)
    eight = grid_plan(list(range(16)), 2, layers, 8, 1)
    source = StorageSource(4, "unused")
    alone = m.restore_s(source, whole_stages(one), one, [])
    assert alone == m.checkpoint_bytes(range(layers)) / m.sim.storage_read_bytes_per_s  # one node: no broadcast
    replicated = m.restore_s(source, whole_stages(eight), eight, [])
    # The same reads, then every other node receives its pipeline's layers once over its NIC.
    broadcast = m.checkpoint_bytes(range(layers)) / (100 * GBIT_S) + m.costs.profile.latency_s
    assert replicated == alone + broadcast


def test_a_memory_restore_sends_through_each_node_nic_and_reads_a_record_once() -> None:
    """One stage on four workers, two a node, every shard on its owner's node (AEC: no copies): each worker reads
    its node's two shards and receives the other node's two, which that node's first worker reads once each and
    sends to both workers of this node, all four through this node's one NIC."""
    m = machine(workers_per_node=2, node_gbit_s=25.0)
    plan = grid_plan(list(range(4)), 1, m.costs.profile.num_layers, 8, 1)
    shard = 1e9
    records = tuple(dataclasses.replace(r, nbytes=int(shard)) for rs in records_to_write(plan, "aec", 2).values()
                    for r in rs)  # fmt: skip
    source = MemorySource(4, plan=plan, workers_per_node=2, records=records)
    rate = m.copy_bytes_per_s(4)
    server_reads = 4 * shard / rate  # its own two shards, and once each the two it sends
    network = m.costs.profile.latency_s + 4 * shard / (25 * GBIT_S)
    assert m.restore_s(source, whole_stages(plan), plan, []) == server_reads + network


def test_storage_read_chains_read_each_layer_once_and_pass_it_on_in_worker_order():
    chains = storage_read_chains({5: (2, 3), 1: (0, 1), 4: (2, 3), 0: (0, 1), 7: ()})
    assert chains == {0: (0, 1), 1: (0, 1), 2: (4, 5), 3: (4, 5)}
    assert storage_read_chains({3: (9,)}) == {9: (3,)}
    assert storage_read_chains({}) == {}
