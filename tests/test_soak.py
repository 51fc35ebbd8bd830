"""The soak campaign (``experiments/soak.py``): its scenarios are reproducible and well-formed, and a short seeded
slice of them passes every check on real processes."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ftlab.experiments import soak
from ftlab.experiments.job import compose_config
from ftlab.runtime.core.config import LR_SCHEDULES, OPTIMIZERS
from ftlab.runtime.core.failed_saves import MIB, checkpoint_bytes
from ftlab.runtime.core.model_spec import layer_specs
from ftlab.faults.schedules import ClusterShape, build_schedule


def test_a_scenario_depends_on_its_seed_and_index_alone() -> None:
    assert soak.draw(7, 3) == soak.draw(7, 3)
    assert soak.draw(7, 3) != soak.draw(7, 4) and soak.draw(7, 3) != soak.draw(8, 3)


@pytest.mark.parametrize("index", range(20))
def test_every_drawn_scenario_composes_and_its_faults_fit_the_cluster(index: int) -> None:
    scenario = soak.draw(11, index)
    cfg = OmegaConf.to_object(compose_config(scenario.overrides))
    events = build_schedule(cfg.faults, ClusterShape(cfg.cluster.nodes, cfg.cluster.workers_per_node))
    assert (cfg.protection.name in ("storage", "reft")) == (scenario.every is not None)
    assert len([e for e in events if e.kind != "join"]) <= 3


def test_reft_is_drawn_only_where_the_grid_holds_every_stage_twice() -> None:
    # Seed 31337's scenario 10 drew REFT's copies for one pipeline of 3 stages on 5 nodes, which ftlab refuses.
    assert "protection=storage" in soak.draw(31337, 10).job
    for index in range(300):
        drawn = dict(o.split("=", 1) for o in soak.draw(5, index).job if "=" in o)
        if drawn.get("protection") == "reft" and drawn["policy"] in ("checkpoint_restart", "recycle"):
            workers = int(drawn["cluster.nodes"]) * int(drawn["cluster.workers_per_node"])
            assert workers >= 2 * int(drawn["train.stages"]), drawn


def test_training_settings_are_drawn_and_zero_1_only_where_a_policy_leaves_optimizer_state_in_place() -> None:
    drawn = [dict(o.split("=", 1) for o in soak.draw(5, index).job if "=" in o) for index in range(300)]
    assert {d["train.precision"] for d in drawn} == {"fp32", "bf16", "fp16"}
    assert {d["train.optimizer"] for d in drawn} == set(OPTIMIZERS)
    assert {d["train.lr_schedule"] for d in drawn} == set(LR_SCHEDULES)
    assert any(float(d["train.grad_clip"]) > 0 for d in drawn)
    zero = [d for d in drawn if d["train.zero"] == "1"]
    assert any(d["protection"] == "reft" for d in zero) and any(d["protection"] == "storage" for d in zero)
    for d in zero:
        assert not soak.catalog.policy_classes()[d["policy"]].moves_layers, d
        assert not soak.catalog.roles()[d["policy"]].chooses, d  # adaptive may choose a policy that moves layers
        assert d["protection"] != "reft" or d["protection.mode"] == "aor", d  # REFT's other modes are refused
    assert all(d.get("protection.mode") != "aor" for d in drawn if d["train.zero"] == "0")


def test_a_small_disk_holds_the_first_checkpoint_and_refuses_the_second() -> None:
    scenario = next(s for s in (soak.draw(2026, i) for i in range(20)) if s.disk_mib is not None)
    cfg = OmegaConf.to_object(compose_config(scenario.overrides))
    one = checkpoint_bytes(layer_specs(cfg.model), cfg.model.seq_len)
    assert one < scenario.disk_mib * MIB < 2 * one
    assert cfg.protection.name == "storage" and cfg.protection.allow_low_space
    assert cfg.protection.max_failed_saves >= cfg.train.steps  # every save but the first may fail: the job goes on


WRITES_UNTIL_REFUSED = """
import pathlib, sys, time
disk = pathlib.Path(sys.argv[1])
(disk / "run" / "step-000002").mkdir(parents=True)
(disk / "run" / "step-000002" / "manifest.json").write_text("{}")
for _ in range(600):  # until the watcher has remounted the disk (it looks every 0.1 s)
    try:
        (disk / "run" / "later").write_text("x")
    except OSError as refused:
        print(refused.errno)
        break
    time.sleep(0.05)
"""


def test_a_read_only_disk_refuses_writes_once_a_checkpoint_is_committed(tmp_path: Path) -> None:
    if subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("this kernel lets no unprivileged user create a mount namespace")
    drawn = [soak.draw(2026, i) for i in range(40)]
    assert any(s.read_only for s in drawn) and any(s.disk_mib and not s.read_only for s in drawn), "both are drawn"
    disk = tmp_path / "disk"
    disk.mkdir()
    command = soak.on_small_disk([sys.executable, "-c", WRITES_UNTIL_REFUSED, str(disk)], disk, 4, read_only=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.stdout.strip() == str(errno.EROFS), done.stderr


def test_a_coordinator_is_killed_only_after_a_checkpoint_that_outlives_it() -> None:
    killed = [s for s in (soak.draw(2026, i) for i in range(60)) if s.kill_at is not None]
    assert killed
    for scenario in killed:
        drawn = dict(o.split("=", 1) for o in scenario.job if "=" in o)
        assert drawn["protection"] == "storage" and scenario.disk_mib is None
        assert scenario.every < scenario.kill_at < int(drawn["train.steps"])


def test_a_lost_step_is_promised_one_interval_more_for_each_failed_save() -> None:
    restart = {"kind": "recovery_decision", "outcome": "restart"}
    lost_5 = {"kind": "recovered", "fault": 0, "lost_steps": 5}
    assert soak.lost_step_problems([restart, lost_5], 3) == ["fault 0 lost 5 committed steps, more than 3"]
    assert soak.lost_step_problems([{"kind": "save_failed", "step": 6}, restart, lost_5], 3) == []


@pytest.mark.slow
def test_a_seeded_slice_passes_every_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert soak.main(["--seed", "2026", "--scenarios", "2", "--workdir", str(tmp_path)]) == 0, capsys.readouterr().out


@pytest.mark.slow
def test_a_small_disk_and_a_killed_coordinator_pass_every_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert soak.draw(2026, 4).disk_mib is not None and soak.draw(2026, 5).kill_at is not None
    args = ["--seed", "2026", "--first", "4", "--scenarios", "2", "--workdir", str(tmp_path)]
    assert soak.main(args) == 0, capsys.readouterr().out
