"""Mixed precision (``train.precision``) and the coordinator's update rule (``runtime.control.update``).

bf16 and fp16 train, differ from fp32 and repeat themselves bit for bit; a bf16 job with clipping computes the same
losses and final weights on any layout (one process, a 2 x 2 grid with ZeRO-1 and activation checkpointing, a
heterogeneous plan); fp16's loss scaler steps as DeepSpeed's DynamicLossScaler does; bad settings are refused before
any worker starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftlab.experiments.job import JobResult, check_job, compose_config
from ftlab.runtime.control.update import ScalerState, StepNumerics, UpdateRule, UpdateStopped
from ftlab.runtime.core.config import TrainConfig
from ftlab.runtime.core.contract import ConfigError
from tests.oracle import LOSS_RTOL, PARAM_ATOL, committed_losses, final_state

STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> dict[str, JobResult]:
    from ftlab.experiments.job import run_job

    base = tmp_path_factory.mktemp("precision")
    common = [
        "experiment=plain", f"tracking.uri=sqlite:///{base}/mlflow.db", f"train.cache_dir={token_cache}",
        f"train.checkpoint_dir={base}/checkpoints", "progress=false", f"train.steps={STEPS}",
        "protection=storage", f"protection.every={STEPS}",
    ]  # fmt: skip
    single = ["cluster.nodes=1", "train.stages=1"]
    clipped = ["train.precision=bf16", "train.grad_clip=1.0"]
    jobs = {
        "fp32": single,
        "bf16": [*single, "train.precision=bf16"],
        "bf16-again": [*single, "train.precision=bf16"],
        "fp16": [*single, "train.precision=fp16"],
        "bf16-clip": [*single, *clipped],
        "bf16-clip-grid-zero1-checkpointed": ["cluster=local-4", "train.stages=2", "train.zero=1",
                                              "train.activation_checkpointing=true", *clipped],
        "bf16-clip-heterogeneous": ["cluster.nodes=5", "policy._target_=tests.support.HeterogeneousLayout", *clipped],
    }  # fmt: skip
    return {name: run_job(compose_config(common + extra)) for name, extra in jobs.items()}


def _weights(result: JobResult) -> dict[int, dict[str, torch.Tensor]]:
    return final_state(result, STEPS)


def test_half_precisions_train_and_differ_from_fp32(runs: dict[str, JobResult]) -> None:
    fp32 = committed_losses(runs["fp32"], STEPS)
    for precision in ("bf16", "fp16"):
        losses = committed_losses(runs[precision], STEPS)
        assert losses[-1] < losses[0], f"{precision} should lower the loss"
        assert losses != fp32, f"{precision} computed exactly what fp32 does"
        assert losses == pytest.approx(fp32, rel=1e-2), f"{precision} strays too far from fp32"
    bf16, fp32 = _weights(runs["bf16"]), _weights(runs["fp32"])
    assert any(not torch.equal(bf16[1][name], value) for name, value in fp32[1].items())


def test_bf16_is_deterministic_run_to_run(runs: dict[str, JobResult]) -> None:
    assert committed_losses(runs["bf16-again"], STEPS) == committed_losses(runs["bf16"], STEPS)
    again, first = _weights(runs["bf16-again"]), _weights(runs["bf16"])
    for layer, params in first.items():
        for name, value in params.items():
            assert torch.equal(again[layer][name], value), f"layer {layer} {name}"


def test_weights_stay_fp32_master_copies(runs: dict[str, JobResult]) -> None:
    for layer in _weights(runs["bf16-clip"]).values():
        assert {value.dtype for value in layer.values()} == {torch.float32}


@pytest.mark.parametrize("layout", ["bf16-clip-grid-zero1-checkpointed", "bf16-clip-heterogeneous"])
def test_bf16_with_clipping_is_the_same_on_every_layout(runs: dict[str, JobResult], layout: str) -> None:
    reference = committed_losses(runs["bf16-clip"], STEPS)
    assert committed_losses(runs[layout], STEPS) == pytest.approx(reference, rel=LOSS_RTOL)
    assert reference != committed_losses(runs["bf16"], STEPS), "grad_clip=1.0 should change the update"
    expected, state = _weights(runs["bf16-clip"]), _weights(runs[layout])
    for layer, params in expected.items():
        for name, value in params.items():
            torch.testing.assert_close(state[layer][name], value, rtol=0, atol=PARAM_ATOL, msg=f"layer {layer} {name}")


# -- the update rule on its own --------------------------------------------------------------------------------------
def test_clipping_factor_is_clip_grad_norm_s() -> None:
    grads = [torch.randn(5, 3), torch.randn(7)]
    sq = {(i, 0): float(g.double().square().sum()) for i, g in enumerate(grads)}
    rule = UpdateRule(TrainConfig(grad_clip=0.5), 0)
    update = rule.decide(0, sq)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g * update.factor, p.grad)
    assert not update.skip and update.factor < 1
    assert UpdateRule(TrainConfig(grad_clip=1e6), 0).decide(0, sq).factor == 1.0


def test_the_norm_does_not_depend_on_how_pieces_are_grouped() -> None:
    rule = UpdateRule(TrainConfig(grad_clip=0.1), 0)
    whole = rule.decide(0, {(0, 0): 1.0 / 3, (1, 0): 2.0 / 7})
    rule.rewind(0)
    pieces = rule.decide(0, {(1, 1): 2.0 / 7, (0, 0): 1.0 / 3})
    assert whole == pieces


def test_fp16_scaler_steps_as_deepspeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.runtime.fp16 import loss_scaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)  # it only logs on rank 0
    t = TrainConfig(precision="fp16", initial_scale_power=8, loss_scale_window=3, hysteresis=2, min_loss_scale=1.0,
                    max_skipped_steps=100)  # fmt: skip
    theirs = loss_scaler.DynamicLossScaler(init_scale=2.0**8, scale_window=3, min_scale=1.0, delayed_shift=2,
                                           consecutive_hysteresis=False)  # fmt: skip
    rule = UpdateRule(t, 0)
    overflows = [True, False, True, True, False, False, False, False, False, False, False, True, True, True, False]
    for step, overflow in enumerate(overflows):
        assert rule.loss_scale(step) == theirs.cur_scale, f"step {step}"
        update = rule.decide(step, {(0, 0): float("inf") if overflow else 1.0})
        assert update.skip == overflow
        rule.committed(step)
        theirs.update_scale(overflow)
    assert rule.loss_scale(len(overflows)) == theirs.cur_scale


def test_a_rewind_restores_the_scaler_of_that_step() -> None:
    rule = UpdateRule(TrainConfig(precision="fp16", initial_scale_power=4, hysteresis=1), 0)
    for step in range(3):
        rule.decide(step, {(0, 0): float("nan")})
        rule.committed(step)
    assert [rule.loss_scale(s) for s in range(4)] == [16, 8, 4, 2]
    rule.rewind(1)
    assert rule.loss_scale(1) == 8
    assert rule.manifest(1) == {"loss_scaler": {"scale": 8, "hysteresis": 1, "iteration": 1, "last_overflow": 0,
                                                "skipped": 1, "skipped_total": 1}}  # fmt: skip
    resumed = UpdateRule(TrainConfig(precision="fp16"), 1, ScalerState(**rule.manifest(1)["loss_scaler"]))
    assert resumed.loss_scale(1) == 8


def test_a_committed_update_reports_its_norm_its_scale_and_the_skips_so_far() -> None:
    rule = UpdateRule(TrainConfig(precision="fp16", initial_scale_power=4, hysteresis=1, grad_clip=0.5), 0)
    rule.decide(0, {(0, 0): float("inf")})
    assert rule.committed(0) == StepNumerics(grad_norm=None, loss_scale=16, skipped_steps=1)
    rule.decide(1, {(0, 0): 8.0**2, (1, 0): 6.0**2})  # the scaled norm 10 at scale 8
    assert rule.committed(1) == StepNumerics(grad_norm=10 / 8, loss_scale=8, skipped_steps=1)
    rule.decide(2, {(0, 0): float("nan")})
    assert rule.committed(2).skipped_steps == 2
    rule.rewind(1)  # step 1 redone: its skip is not counted again
    rule.decide(1, {(0, 0): float("inf")})
    assert rule.committed(1) == StepNumerics(grad_norm=None, loss_scale=8, skipped_steps=2)
    fp32 = UpdateRule(TrainConfig(grad_clip=0.5), 0)
    fp32.decide(0, {(0, 0): 9.0})
    assert fp32.committed(0) == StepNumerics(grad_norm=3.0, loss_scale=None, skipped_steps=None)
    fp32.decide(1, None)  # nobody computed (the simulator): nothing measured
    assert fp32.committed(1) is None


def test_consecutive_skips_stop_with_the_reason() -> None:
    rule = UpdateRule(TrainConfig(precision="fp16", loss_scale=1024.0, max_skipped_steps=2), 0)
    rule.decide(0, {(0, 0): float("inf")})
    rule.committed(0)
    rule.decide(1, {(0, 0): float("inf")})
    with pytest.raises(UpdateStopped, match="2 consecutive steps .* train.loss_scale"):
        rule.committed(1)


def test_a_gradient_that_is_not_finite_in_bf16_stops() -> None:
    with pytest.raises(UpdateStopped, match="not finite|nan|inf"):
        UpdateRule(TrainConfig(precision="bf16", grad_clip=1.0), 0).decide(0, {(0, 0): float("nan")})


# -- refusals before any worker ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.precision=fp8"], "train.precision='fp8': use one of fp32, tf32, bf16, fp16"),
        (["train.grad_clip=-1"], "train.grad_clip=-1.0"),
        (["train.precision=fp16", "train.loss_scale=-2"], "train.loss_scale=-2.0"),
        (["train.precision=fp16", "train.initial_scale_power=99"], "train.initial_scale_power=99"),
        (["train.precision=fp16", "train.loss_scale_window=0"], "train.loss_scale_window=0"),
        (["train.precision=fp16", "train.hysteresis=0"], "train.hysteresis=0"),
        (["train.precision=fp16", "train.min_loss_scale=0"], "train.min_loss_scale=0.0"),
        (["train.precision=fp16", "train.max_skipped_steps=0"], "train.max_skipped_steps=0"),
        (["train.precision=bf16", "cluster.device=V100-16GB"], "V100-16GB does not compute bf16"),
        (["policy=recycle", "policy.staggered_optimizer=true", "train.grad_clip=1.0"],
         "policy.staggered_optimizer=false"),
        (["policy=recycle", "policy.staggered_optimizer=true", "train.precision=fp16"],
         "policy.staggered_optimizer=false"),
    ],
)  # fmt: skip
def test_bad_numerics_are_refused_before_any_worker(overrides: list[str], message: str, tmp_path: Path) -> None:
    cfg = compose_config(["experiment=plain", f"train.checkpoint_dir={tmp_path}", *overrides])
    from omegaconf import OmegaConf

    with pytest.raises(ConfigError) as refused:
        check_job(OmegaConf.to_object(cfg))
    assert message in str(refused.value)


# -- bytes by precision: the cost model and the simulator ------------------------------------------------------------
def test_half_precision_halves_activations_and_keeps_the_state() -> None:
    from ftlab.runtime.core.costs import CostModel, with_precision
    from ftlab.runtime.core.model_spec import load_model_config
    from ftlab.runtime.core.config import ClusterConfig
    from ftlab.runtime.core.devices import node_spec
    from ftlab.runtime.processes.profiler import analytic_profile

    cfg = load_model_config("gpt2-small")
    fp32 = CostModel(analytic_profile(cfg, node_spec(ClusterConfig(device="A100-80GB")), 2, cfg.seq_len))
    bf16 = CostModel(with_precision(fp32.profile, "bf16"))
    layers = fp32.num_layers
    assert bf16.boundary_bytes(3) * 2 == fp32.boundary_bytes(3)
    assert bf16.activation_bytes(1, 4) * 2 == pytest.approx(fp32.activation_bytes(1, 4), abs=4)
    assert bf16.checkpoint_bytes(0, layers) == fp32.checkpoint_bytes(0, layers), "master weights and moments stay fp32"
    assert bf16.param_bytes(0, layers) == fp32.param_bytes(0, layers), "gradients are reduced in fp32"
    copy = fp32.param_bytes(1, 4) / 2  # autocast's bf16 copy of the stage's weights
    in_flight = 3
    expected = fp32.state_bytes(1, 4) + in_flight * bf16.activation_bytes(1, 4) + copy
    assert bf16.stage_memory(1, 4, in_flight) == pytest.approx(expected)


def test_the_simulator_moves_half_the_activation_bytes(job_overrides: list[str]) -> None:
    from ftlab.experiments.simulate import simulate_job

    def iteration_s(precision: str) -> float:
        result = simulate_job(compose_config([
            *job_overrides, "mode=simulate", "model=gpt3-medium", "cluster=a40-30x1", "cluster.nodes=8",
            "train.stages=8", "train.global_batch=16", "train.micro_batch=2", "train.steps=2",
            f"train.precision={precision}",
        ]))  # fmt: skip
        return result.steps[-1].iter_s

    assert iteration_s("bf16") < iteration_s("fp32"), "a pipeline's sends halve, nothing else changes"


# -- one micro-batch through a split model: the stage boundary changes nothing -------------------------------------
@pytest.mark.parametrize("decoupled", [False, True])
def test_a_bf16_split_computes_exactly_what_one_stage_computes(decoupled: bool) -> None:
    from ftlab.runtime.core.model_spec import ModelConfig, num_layers
    from ftlab.runtime.training.model import StageModule, build_layer
    from ftlab.runtime.training.passes import StagePasses

    cfg = ModelConfig(name="gpt2-test", family="gpt2", num_blocks=3, hidden=32, heads=4, vocab_size=50, seq_len=12)

    def passes(start: int, stop: int) -> StagePasses:
        stage = StageModule(cfg, {i: build_layer(cfg, i, seed=7) for i in range(start, stop)})
        return StagePasses(stage, 0.25, dtype=torch.bfloat16)

    generator = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(cfg.vocab_size, (2, cfg.seq_len), generator=generator) for _ in range(2))
    whole, first, second = passes(0, num_layers(cfg)), passes(0, 2), passes(2, num_layers(cfg))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        one = whole.forward(tokens, labels)
        whole.backward(one)
        sent = first.forward(tokens, None)
        assert sent.result.dtype == torch.bfloat16, "a stage boundary carries the compute precision"
        last = second.forward(sent.result.detach().requires_grad_(), labels)
        if decoupled:
            sent.grad = second.backward_input(last)
            second.backward_weight(last)
        else:
            sent.grad = second.backward(last)
        assert sent.grad.dtype == torch.bfloat16
        first.backward(sent)
    assert torch.equal(last.result, one.result)
    split = [*first.stage.parameters(), *second.stage.parameters()]
    for mine, reference in zip(split, whole.stage.parameters(), strict=True):
        assert torch.equal(mine.grad, reference.grad)
