"""Global gradient-norm clipping and fp16's skipped steps on real processes.

Clipping on a 2 x 2 grid changes the update exactly as ``torch.nn.utils.clip_grad_norm_`` over the whole model does
in one process; fp16 with a loss scale that overflows at every step skips every step and stops after
``train.max_skipped_steps`` with the reason (or at once, at ``min_loss_scale``); a dynamic scale that starts too
high comes down, and the scaler's state is in the storage checkpoint's manifest and comes back with
``train.resume_from``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ftlab.experiments.job import JobResult
from ftlab.runtime.control.coordinator import JobStopped
from ftlab.runtime.core.config import TrainConfig
from ftlab.runtime.core.model_spec import load_model_config, num_layers
from ftlab.runtime.state import checkpoint
from ftlab.runtime.training.layer_state import decode
from tests.oracle import LOSS_RTOL, PARAM_ATOL, committed_losses, final_state

STEPS = 3
CLIP = 0.5  # gpt2-tiny's first gradients have a norm near 5: every step is clipped


def reference(token_cache: Path, t: TrainConfig) -> tuple[list[float], dict[int, dict[str, torch.Tensor]]]:
    """The job's training in this process on the whole model: every micro-batch's backward, clip_grad_norm_ over
    every parameter, each layer's AdamW step."""
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
    losses = []
    for step in range(t.steps):
        loss = 0.0
        for m in range(t.global_batch // t.micro_batch):
            tokens, labels = (torch.from_numpy(a) for a in batches.microbatch(step, m))
            scaled = model(tokens, labels) * (t.micro_batch / t.global_batch)
            scaled.backward()
            loss += float(scaled.detach())
        losses.append(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        step_all(optimizers, step, settings)
    return losses, {i: layer.state_dict() for i, layer in layers.items()}


def test_clipping_on_a_grid_equals_clip_grad_norm_in_one_process(run, token_cache: Path) -> None:  # noqa: ANN001
    result = run("cluster=local-4", "train.stages=2", f"train.steps={STEPS}", f"train.grad_clip={CLIP}",
                 "protection=storage", f"protection.every={STEPS}")  # fmt: skip
    losses, weights = reference(token_cache, TrainConfig(steps=STEPS, grad_clip=CLIP))
    assert committed_losses(result, STEPS) == pytest.approx(losses, rel=LOSS_RTOL)
    unclipped, _ = reference(token_cache, TrainConfig(steps=STEPS))
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
    layer = decode(checkpoint.layer_path(checkpoint.step_dir(first.checkpoint_dir, 6), 1).read_bytes())
    assert layer["optimizer"]["state"][0]["step"] == 6 - skipped, "a skipped step must not step AdamW"
    # Resumed at step 6, the job goes on with the recorded scale, as the uninterrupted job does.
    whole = run(*fp16, "train.steps=8", f"train.checkpoint_dir={tmp_path}/whole")
    resumed = run(*fp16, "train.steps=8", f"train.resume_from={checkpoint.step_dir(first.checkpoint_dir, 6)}",
                  f"train.checkpoint_dir={tmp_path}/resumed")  # fmt: skip
    assert [s.loss for s in resumed.steps] == pytest.approx(committed_losses(whole, 8)[6:], rel=LOSS_RTOL)
    assert manifest(resumed, 8)["loss_scaler"] == manifest(whole, 8)["loss_scaler"]
