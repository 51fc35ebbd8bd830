"""The progress line shows what a step has: a trained step its loss, a simulated one the simulated time it reached."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from ftlab.experiments.job import compose_config
from ftlab.experiments.simulate import simulate
from ftlab.runtime.control import events as ev
from ftlab.runtime.reporting.progress import ProgressLine


def committed(step: int, at: float, loss: float) -> ev.StepCommitted:
    return ev.StepCommitted(at=at, step=step, loss=loss, iter_s=0.5, compute_s=0.5, generation=0, samples=16,
                            alive_nodes=4, pipelines=2)  # fmt: skip


def test_a_trained_step_shows_its_loss(capsys: pytest.CaptureFixture[str]) -> None:
    line = ProgressLine(total_steps=1)
    line(committed(0, at=12.0, loss=2.5))
    assert capsys.readouterr().err.strip() == "step 1/1 | loss 2.5000 |   32.0 samples/s | 4 nodes alive"


def test_a_simulated_step_shows_the_simulated_time_and_no_loss(capsys: pytest.CaptureFixture[str]) -> None:
    line = ProgressLine(total_steps=1)
    line.on_simulated_clock()
    line(committed(0, at=3723.45, loss=math.nan))
    assert capsys.readouterr().err.strip() == "step 1/1 | 1:02:03 simulated |   32.0 samples/s | 4 nodes alive"
    line(committed(0, at=0.0123, loss=math.nan))  # a small model's steps on a GPU profile: milliseconds each
    assert capsys.readouterr().err.strip() == "step 1/1 | 0.012 s simulated |   32.0 samples/s | 4 nodes alive"


def test_mode_simulate_prints_no_nan_loss(job_overrides: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    cfg = compose_config([*job_overrides, "mode=simulate", "cluster.device=A100-40GB", "train.steps=20", "progress=true"])
    simulate(OmegaConf.to_object(cfg))
    steps = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert steps and steps[-1].startswith("step 20/20 | ")
    assert all("simulated" in line and "nan" not in line and "loss" not in line for line in steps), steps
