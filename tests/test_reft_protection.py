"""``protection=reft`` without processes: what it asks for after each step, what it offers after a failure and why,
``interval: auto``, and the inputs it refuses before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ftlab.policies.reft.config import ReftConfig
from ftlab.policies.reft.interval import choose_interval
from ftlab.policies.reft.protection import ReftProtection
from ftlab.runtime.processes import cluster as cluster_module
from ftlab.runtime.core.contract import Change, ConfigError, FailureRate, MemorySource, SaveCheckpoint, StorageSource, TakeSnapshot
from ftlab.runtime.core.plan import grid_plan
from ftlab.runtime.core.snapshot_layout import records_to_write


def protection(**settings: object) -> ReftProtection:
    p = ReftProtection(ReftConfig(**settings))  # type: ignore[arg-type]
    p.directory = "/ckpt"
    return p


def report(p: ReftProtection, step: int, plan, writers: list[int] | None = None) -> None:  # noqa: ANN001
    """Every writer (or those given) reports its records of the snapshot of ``step``, with made-up checksums."""
    for worker, records in records_to_write(plan, p.settings.mode, 1).items():
        if writers is None or worker in writers:
            p.saved(TakeSnapshot(plan, p.settings.mode, 1, -1), step, tuple(r.__class__(**{**r.__dict__, "crc": step})
                                                                              for r in records))  # fmt: skip


PLAN = grid_plan([0, 1, 2, 3], 2, 8, 16, 2)


def test_a_snapshot_every_interval_keeping_the_newest_complete_and_a_flush_every_flush_every() -> None:
    p = protection(interval=1, flush_every=3)
    (first,) = p.after_commit(1, PLAN)
    assert isinstance(first, TakeSnapshot) and first.keep == -1
    report(p, 1, PLAN)
    second, flush = p.after_commit(3, PLAN)
    assert isinstance(second, TakeSnapshot) and second.keep == 1 and isinstance(flush, SaveCheckpoint)
    report(p, 3, PLAN, writers=[0, 1, 2])  # worker 3 still copying
    (third,) = p.after_commit(4, PLAN)
    assert third.keep == 1, "the snapshot of step 3 is not complete: its slots must not hold the only copy of 1"


def test_memory_while_every_group_keeps_a_member_then_the_flush_with_the_reason() -> None:
    p = protection(flush_every=2)
    for step in (1, 2):
        p.after_commit(step, PLAN)
        report(p, step, PLAN)
    p.saved(SaveCheckpoint("/ckpt"), 2)
    p.after_commit(3, PLAN)
    report(p, 3, PLAN, writers=[0, 2, 3])  # node 1 dies before it wrote its records of step 3
    source = p.restore_source(Change(PLAN, 3, 1, failed_nodes=(1,)))
    assert isinstance(source, MemorySource) and source.step == 3
    assert "every shard is on a live node" in source.reason
    assert {r.node for r in source.records} == {0, 2, 3}
    source = p.restore_source(Change(PLAN, 3, 2, failed_nodes=(3,)))  # both holders of the second stage are gone
    assert source == StorageSource(2, "/ckpt/step-000002")
    assert "the snapshot of step 3 lost shards [0, 1] of layers 4..7 (workers [1, 3]) with nodes [3]" in source.reason


def test_parity_decodes_a_lost_shard_and_says_so() -> None:
    plan = grid_plan([0, 1, 2], 1, 8, 12, 2)
    p = protection(mode="aec")
    p.after_commit(1, plan)
    report(p, 1, plan)
    source = p.restore_source(Change(plan, 1, 1, failed_nodes=(2,)))
    assert isinstance(source, MemorySource) and "decoded from parity" in source.reason
    assert ((0, 1, 2, 3, 4, 5, 6, 7), 2, 1) in source.shard_crcs, "the lost owner's checksum is kept"


def test_a_snapshot_that_cannot_be_loaded_is_dropped() -> None:
    p = protection()
    p.after_commit(1, PLAN)
    report(p, 1, PLAN)
    source = p.restore_source(Change(PLAN, 1, 1, failed_workers=(1,)))
    p.unusable(source, "a record failed its checksum")  # type: ignore[arg-type]
    assert p.restore_source(Change(PLAN, 1, 2, failed_workers=(1,))) is None


def test_auto_interval_is_every_step_when_snapshots_hide_in_the_iteration() -> None:
    cheap = choose_interval(iteration_s=1.0, snapshot_bytes=10**7, failure_rate=FailureRate(mean_s=600),
                            nodes=4, group_size=2, flush_every=10, threshold=0.9)  # fmt: skip
    assert cheap.steps == 1 and "every 1 steps" in cheap.reason and "Eq. 5" in cheap.reason
    costly = choose_interval(iteration_s=0.1, snapshot_bytes=10**10, failure_rate=FailureRate(mean_s=3600),
                             nodes=4, group_size=2, flush_every=10, threshold=0.9)  # fmt: skip
    assert costly.steps > 10
    # The same rate in steps (36000 steps of 0.1 s between failures) chooses the same interval.
    in_steps = choose_interval(iteration_s=0.1, snapshot_bytes=10**10, failure_rate=FailureRate(mean_steps=36000),
                               nodes=4, group_size=2, flush_every=10, threshold=0.9)  # fmt: skip
    assert in_steps.steps == costly.steps
    assert choose_interval(iteration_s=1.0, snapshot_bytes=1, failure_rate=None, nodes=4,
                           group_size=2, flush_every=10, threshold=0.9).steps == 1  # fmt: skip


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a node was started for a job that should have been refused")

    monkeypatch.setattr(cluster_module.LocalCluster, "start_node", refuse)


BAD = [
    (["cluster.nodes=2", "train.stages=2"], "have a single holder: raise cluster.nodes or lower train.stages"),
    (["protection.mode=aor"], "set train.zero=1"),
    (["train.zero=1"], "use protection.mode=aor"),
    (["protection.host_memory_gb=0.01"], "raise it, or use more nodes"),
    (["protection.mode=raid"], "protection.mode='raid': use one of arc, aec, aor, arc+aec"),
    (["protection.interval=0"], "snapshot every 1 or more committed steps, or auto"),
]


@pytest.mark.parametrize(("overrides", "advice"), BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_input_is_refused_before_any_worker(
    run, tmp_path: Path, no_workers: None, overrides: list[str], advice: str  # noqa: ANN001
) -> None:
    with pytest.raises(ConfigError) as info:
        run("policy=checkpoint_restart", "protection=reft", *overrides)
    assert advice in str(info.value)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (record,) = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
    assert record.info.status == "FAILED"


def test_auto_interval_reads_the_fault_schedule_and_is_recorded(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from ftlab.experiments.job import compose_config, preflight

    cfg = OmegaConf.to_object(compose_config([
        "experiment=plain", f"train.cache_dir={tmp_path}", "policy=checkpoint_restart", "protection=reft",
        "protection.interval=auto", "faults=exponential", "faults.mtbf_steps=null", "faults.mtbf_s=600", "cluster.device=A100-40GB",
    ]))  # fmt: skip
    described = preflight(cfg).protection.describe()
    # On an A100 gpt2-tiny's iteration takes well under a millisecond, far less than copying its state to the host:
    # snapshots are worth taking only every so many steps.
    assert int(described["interval"]) > 1
    assert f"every {described['interval']} steps" in described["interval_reason"]
    assert "Young's optimum" in described["interval_reason"] and "6 failures per hour" in described["interval_reason"]
