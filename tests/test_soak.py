"""The soak campaign (``experiments/soak.py``): its scenarios are reproducible and well-formed, and a short seeded
slice of them passes every check on real processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ftlab.experiments import soak
from ftlab.experiments.job import compose_config
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


@pytest.mark.slow
def test_a_seeded_slice_passes_every_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert soak.main(["--seed", "2026", "--scenarios", "2", "--workdir", str(tmp_path)]) == 0, capsys.readouterr().out
