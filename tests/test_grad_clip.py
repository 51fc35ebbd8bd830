"""Global gradient-norm clipping and fp16's skipped steps on real processes.

Clipping on a 2 x 2 grid changes the update exactly as ``torch.nn.utils.clip_grad_norm_`` over the whole model does
in one process, and the run's ``train/grad_norm`` is the norm it clipped by; fp16 with a loss scale that overflows
at every step skips every step and stops after ``train.max_skipped_steps`` with the reason (or at once, at
``min_loss_scale``); a dynamic scale that starts too high comes down, the run's ``train/loss_scale`` and
``train/skipped_steps`` are the scaler's, and the scaler's state is in the storage checkpoint's manifest and comes
back with ``train.resume_from``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from ftlab.experiments.job import JobResult
from ftlab.runtime.control.coordinator import JobStopped
from ftlab.runtime.core.config import TrainConfig
from ftlab.runtime.core.model_spec import load_model_config, num_layers
from ftlab.runtime.state import checkpoint
from ftlab.runtime.training.layer_state import decode
from tests.oracle import LOSS_RTOL, PARAM_ATOL, committed_losses, final_state

STEPS = 3
CLIP = 0.5  # gpt2-tiny's first gradients have a norm near 5: every step is clipped


Weights = dict[int, dict[str, torch.Tensor]]


def reference(token_cache: Path, t: TrainConfig) -> tuple[list[float], Weights, list[float]]:
    """The job's training in this process on the whole model: every micro-batch's backward, clip_grad_norm_ over
    every parameter, each layer's AdamW step; its losses, final weights and the global norm of each step."""
    from ftlab.runtime.training.data import Batches, tokenize_corpus
    from ftlab.runtime.training.model import StageModule, build_layer
    from ftlab.runtime.training.optim import OptimSettings, layer_optimizer, step_all

    cfg = load_model_config("gpt2-tiny")
    batches = Batches(np.load(tokenize_corpus(None, cfg.vocab_size, token_cache), mmap_mode="r"), cfg.seq_len,
                      t.global_batch, t.micro_batch, t.seed)  # fmt: skip
    layers = {i: build_layer(cfg, i, t.seed) for i in range(num_layers(cfg))}
    model = StageModule(cfg, layers)
    settings = OptimSettings.of(t)
    optimizers = {i: layer_optimizer(layer, settings) for i, layer in layers.items()}
    losses, norms = [], []
    for step in range(t.steps):
        loss = 0.0
        for m in range(t.global_batch // t.micro_batch):
            tokens, labels = (torch.from_numpy(a) for a in batches.microbatch(step, m))
            scaled = model(tokens, labels) * (t.micro_batch / t.global_batch)
            scaled.backward()
            loss += float(scaled.detach())
        losses.append(loss)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)))
        step_all(optimizers, step, settings)
    return losses, {i: layer.state_dict() for i, layer in layers.items()}, norms


def history(tmp_path: Path, result: JobResult, metric: str) -> dict[int, float]:
    """``metric`` of the job's run in its MLflow store (the ``run`` fixture's, in ``tmp_path``), by step."""
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    return {m.step: m.value for m in client.get_metric_history(result.run_id, metric)}


def test_clipping_on_a_grid_equals_clip_grad_norm_in_one_process(
    run, token_cache: Path, tmp_path: Path  # noqa: ANN001
) -> None:
    result = run("cluster=local-4", "train.stages=2", f"train.steps={STEPS}", f"train.grad_clip={CLIP}",
                 "protection=storage", f"protection.every={STEPS}")  # fmt: skip
    losses, weights, norms = reference(token_cache, TrainConfig(steps=STEPS, grad_clip=CLIP))
    assert committed_losses(result, STEPS) == pytest.approx(losses, rel=LOSS_RTOL)
    # The run records the norm the coordinator clipped by, which is clip_grad_norm_'s.
    used = {s.step: s.numerics.grad_norm for s in result.steps}
    assert history(tmp_path, result, "train/grad_norm") == used
    assert used[0] == pytest.approx(norms[0], rel=LOSS_RTOL)  # of the same weights
    assert [used[step] for step in range(STEPS)] == pytest.approx(norms, rel=1e-3)  # of weights equal to PARAM_ATOL
    assert all(math.isfinite(n) and n > CLIP for n in norms)
    assert history(tmp_path, result, "train/loss_scale") == {}  # fp32 has none
    unclipped, _, _ = reference(token_cache, TrainConfig(steps=STEPS))
    assert losses[-1] != pytest.approx(unclipped[-1], rel=1e-4), "the clip should change the trajectory"
    state = final_state(result, STEPS)
    for layer, params in weights.items():
        for name, value in params.items():
            torch.testing.assert_close(state[layer][name], value, rtol=0, atol=PARAM_ATOL, msg=f"layer {layer} {name}")


def test_fp16_overflowing_every_step_stops_after_the_skips(run) -> None:  # noqa: ANN001
    with pytest.raises(JobStopped, match=r"3 consecutive steps up to step 2 were skipped .*train\.loss_scale"):
        run("cluster=local-4", "train.stages=2", "train.steps=8", "train.precision=fp16", "train.loss_scale=1e30",
            "train.max_skipped_steps=3")  # fmt: skip


def test_fp16_overflowing_at_the_minimum_scale_stops_at_once(run) -> None:  # noqa: ANN001
    with pytest.raises(JobStopped, match=r"overflowed at step 0 with the loss scale at its minimum"):
        run("cluster.nodes=1", "train.stages=1", "train.steps=4", "train.precision=fp16",
            "train.initial_scale_power=64", "train.min_loss_scale=18446744073709551616", "train.hysteresis=1")  # fmt: skip


def manifest(result: JobResult, step: int) -> dict:
    return json.loads((checkpoint.step_dir(result.checkpoint_dir, step) / checkpoint.MANIFEST).read_text())


def test_a_dynamic_scale_comes_down_and_is_checkpointed_and_resumed(run, tmp_path: Path) -> None:  # noqa: ANN001
    # 2**24 overflows gpt2-tiny's fp16 gradients (2**20 does not): each step halves it (hysteresis 1) until they fit,
    # skipping those steps.
    # train.min_lr=train.lr: a schedule that does not depend on train.steps, so a 4-step job resumes into a 6-step one.
    fp16 = ["cluster.nodes=1", "train.stages=1", "train.precision=fp16", "train.initial_scale_power=24",
            "train.hysteresis=1", "train.min_lr=0.001", "protection=storage", "protection.every=2"]  # fmt: skip
    first = run(*fp16, "train.steps=6")
    scaler = manifest(first, 6)["loss_scaler"]
    assert scaler["scale"] <= 2.0**22 and 0 <= scaler["last_overflow"] < 5, scaler
    skipped = scaler["last_overflow"] + 1  # the overflows come first, then none
    # The run's record of the scaler: the scale each step ran with, the skips so far, a norm for each step applied.
    assert history(tmp_path, first, "train/loss_scale") == {s: 2.0 ** (24 - min(s, skipped)) for s in range(6)}
    assert history(tmp_path, first, "train/skipped_steps") == {s: min(s + 1, skipped) for s in range(6)}
    assert scaler["skipped_total"] == skipped
    assert history(tmp_path, first, "summary/skipped_steps") == {6: skipped}
    norms = history(tmp_path, first, "train/grad_norm")
    assert sorted(norms) == list(range(skipped, 6)) and all(0 < n < math.inf for n in norms.values()), norms
    layer = decode(checkpoint.layer_path(checkpoint.step_dir(first.checkpoint_dir, 6), 1).read_bytes())
    assert layer["optimizer"]["state"][0]["step"] == 6 - skipped, "a skipped step must not step AdamW"
    # Resumed at step 6, the job goes on with the recorded scale, as the uninterrupted job does.
    whole = run(*fp16, "train.steps=8", f"train.checkpoint_dir={tmp_path}/whole")
    resumed = run(*fp16, "train.steps=8", f"train.resume_from={checkpoint.step_dir(first.checkpoint_dir, 6)}",
                  f"train.checkpoint_dir={tmp_path}/resumed")  # fmt: skip
    assert [s.loss for s in resumed.steps] == pytest.approx(committed_losses(whole, 8)[6:], rel=LOSS_RTOL)
    assert manifest(resumed, 8)["loss_scaler"] == manifest(whole, 8)["loss_scaler"]
    assert resumed.summary["summary/skipped_steps"] == skipped  # the skips before the resume are counted
