"""``train.deepspeed_config``: DeepSpeed's schedules reproduced step for step, each ds_config key mapped or refused,
and the documented bf16 ZeRO-1 WarmupCosineLR config run unchanged on real processes.

The schedules are held to DeepSpeed's own scheduler classes, stepped as its engine steps them (built before the first
optimizer step, stepped after each) on a dummy optimizer: the rate every step runs at, equal to the last bit.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from deepspeed.runtime import lr_schedules
from mlflow.tracking import MlflowClient

from ftlab.experiments.deepspeed_config import apply, explicit, read, settings
from ftlab.experiments.deepspeed_reference import ReferenceJob, deepspeed_config
from ftlab.experiments.job import compose_config
from ftlab.runtime.core.config import TrainConfig
from ftlab.runtime.core.contract import ConfigError
from ftlab.runtime.processes import cluster as cluster_module
from ftlab.runtime.training.optim import OptimSettings, layer_optimizer, lr_at
from tests.oracle import assert_on_fault_free_trajectory

DOCUMENTED = Path(__file__).parents[1] / "conf" / "deepspeed" / "bf16-zero1-cosine.json"
STEPS = 60
BATCH = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}


# -- the schedules against DeepSpeed's ------------------------------------------------------------------------------
def deepspeed_rates(kind: str, peak: float, params: dict[str, Any]) -> list[float]:
    """The rate each optimizer step runs at under DeepSpeed's ``kind``, as its engine drives it."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    scheduler = getattr(lr_schedules, kind)(optimizer, **params)
    rates = []
    for _ in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        scheduler.step()  # after the optimizer step (engine._take_model_step)
    return rates


SCHEDULE_CASES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_num_steps": 1}),  # DeepSpeed warms up over max(2, n) steps, to the optimizer's lr
    ("WarmupDecayLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 10, "total_num_steps": 40}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_num_steps": 5}),  # past 30 the rate stays at 0
    ("WarmupCosineLR", {"total_num_steps": 40, "warmup_num_steps": 10, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 12}),  # no decay window: the floor after warm-up
]


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize(("kind", "params"), SCHEDULE_CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(SCHEDULE_CASES)])
def test_lr_at_is_deepspeeds_schedule_at_every_step(kind: str, params: dict[str, Any], warmup_type: str) -> None:
    params = {**params, "warmup_type": warmup_type}
    peak = 2e-4  # the optimizer's lr: WarmupCosineLR's peak, WarmupLR's without warmup_max_lr
    mapped = settings({**BATCH, "optimizer": {"type": "AdamW", "params": {"lr": peak}},
                       "scheduler": {"type": kind, "params": params}}, 1).train  # fmt: skip
    train = {key: m.value for key, m in mapped.items()}
    s = OptimSettings.of(TrainConfig(**{**train, "steps": STEPS}))
    ours = [lr_at(step, s) for step in range(STEPS)]
    assert ours == deepspeed_rates(kind, peak, params)
    assert len(set(ours)) > 1  # the schedule moves within the window compared


def test_the_default_schedule_is_unchanged() -> None:
    s = OptimSettings(lr=1e-3, min_lr=1e-4, warmup_steps=5, total_steps=30, weight_decay=0.01, beta1=0.9, beta2=0.95)
    assert [lr_at(step, s) for step in (0, 4)] == [1e-3 / 5, 1e-3]
    assert (lr_at(5, s), lr_at(30, s), lr_at(99, s)) == (1e-3, 1e-4, 1e-4)  # cosine from lr to min_lr, then flat


def test_adam_decays_the_gradient_and_adamw_the_weight() -> None:
    """One step from the same weight and gradient: AdamW's decay shrinks the weight by lr x decay apart from the
    moments; Adam's adds decay x weight to the gradient, which the normalised step all but cancels."""
    steps = {}
    for kind in ("adam", "adamw"):
        layer = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            layer.weight.fill_(2.0)
        layer.weight.grad = torch.full_like(layer.weight, 1e-3)
        optimizer = layer_optimizer(layer, OptimSettings(0.1, 0.0, 1, 1, 0.5, 0.9, 0.999, optimizer=kind))
        assert type(optimizer) is (torch.optim.AdamW if kind == "adamw" else torch.optim.Adam)
        optimizer.step()
        steps[kind] = 2.0 - layer.weight.item()
    assert steps["adamw"] == pytest.approx(0.1 + 0.1 * 0.5 * 2.0, rel=1e-4)  # Adam's unit step, plus lr x decay x w
    assert steps["adam"] == pytest.approx(0.1, rel=1e-4)  # the decayed gradient normalised to a unit step


# -- each mapping ---------------------------------------------------------------------------------------------------
def mapped(ds: dict[str, Any], width: int = 2) -> dict[str, Any]:
    return {key: m.value for key, m in settings(ds, width).train.items()}


def test_the_documented_config_maps_onto_ftlab() -> None:
    result = settings(read(DOCUMENTED), 2)
    assert {key: m.value for key, m in result.train.items()} == {
        "global_batch": 24, "micro_batch": 2, "optimizer": "adamw", "lr": 0.001, "beta1": 0.9, "beta2": 0.95,
        "eps": 1e-8, "weight_decay": 0.01, "lr_schedule": "WarmupCosineLR", "warmup_steps": 5, "warmup_type": "linear",
        "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1, "decay_steps": 40, "grad_clip": 1.0, "precision": "bf16",
        "zero": 1,
    }  # fmt: skip
    assert result.ignored == ["steps_per_print", "wall_clock_breakdown"]


@pytest.mark.parametrize(("ds", "width", "global_batch", "micro_batch"), [
    ({"train_batch_size": 24}, 3, 24, 8),  # DeepSpeed: one accumulation step, the batch over the replicas
    ({"train_micro_batch_size_per_gpu": 2}, 3, 6, 2),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, 2, 32, 4),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2, 16, 2),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2, 16, 2),
])  # fmt: skip
def test_batch_sizes_follow_deepspeeds_triangle_on_ftlabs_replicas(
    ds: dict[str, int], width: int, global_batch: int, micro_batch: int
) -> None:
    train = mapped(ds, width)
    assert (train["global_batch"], train["micro_batch"]) == (global_batch, micro_batch)


@pytest.mark.parametrize(("optimizer", "expected"), [
    ({"type": "Adam", "params": {"lr": 3e-4}}, {"optimizer": "adamw", "weight_decay": 0.0}),  # adam_w_mode's default
    ({"type": "adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, {"optimizer": "adam", "weight_decay": 0.1}),
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, {"optimizer": "adamw"}),  # AdamW is AdamW whatever the mode
    ({"type": "AdamW", "params": {"torch_adam": True}}, {"optimizer": "adamw", "weight_decay": 0.01}),  # torch's default
    ({"type": "AdamW"}, {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}),  # FusedAdam's
])  # fmt: skip
def test_adam_and_adamw_with_their_params(optimizer: dict[str, Any], expected: dict[str, Any]) -> None:
    train = mapped({**BATCH, "optimizer": optimizer})
    assert {key: train[key] for key in expected} == expected


def test_warmup_max_lr_is_the_peak_and_warmup_decay_defaults_to_deepspeeds() -> None:
    optimizer = {"type": "AdamW", "params": {"lr": 5e-4}}
    warmup = mapped({**BATCH, "optimizer": optimizer, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 2e-4}}})
    assert warmup["lr"] == 2e-4 and warmup["lr_schedule"] == "WarmupLR"
    kept = mapped({**BATCH, "optimizer": optimizer, "scheduler": {"type": "WarmupLR"}})
    assert kept["lr"] == 5e-4 and kept["warmup_steps"] == 1000 and kept["warmup_type"] == "log"
    decay = mapped({**BATCH, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}})
    assert (decay["lr"], decay["decay_steps"], decay["warmup_min_lr"]) == (0.001, 100, 0.0)


def test_fp16_with_its_loss_scale_and_the_rest() -> None:
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 3, "auto_cast": False}
    train = mapped({**BATCH, "fp16": fp16, "gradient_clipping": 0.5, "zero_optimization": {"stage": 0},
                    "activation_checkpointing": {"partition_activations": False}})  # fmt: skip
    assert {k: train[k] for k in ("precision", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                                  "min_loss_scale", "grad_clip", "zero", "activation_checkpointing")} == {
        "precision": "fp16", "loss_scale": 0.0, "initial_scale_power": 12, "loss_scale_window": 1000, "hysteresis": 3,
        "min_loss_scale": 1, "grad_clip": 0.5, "zero": 0, "activation_checkpointing": True,
    }  # fmt: skip
    assert mapped({**BATCH, "bf16": {"enabled": False}})["precision"] == "fp32"
    assert "precision" not in mapped(BATCH)  # no section: ftlab's train.precision stands


def test_ignored_keys_are_listed() -> None:
    ds = {**BATCH, "steps_per_print": 5, "tensorboard": {"enabled": False}, "bf16": {"enabled": True,
          "immediate_grad_update": True}, "zero_optimization": {"stage": 1, "overlap_comm": True,
          "offload_optimizer": {"device": "none"}}}  # fmt: skip
    assert settings(ds, 2).ignored == [
        "steps_per_print", "tensorboard", "bf16.immediate_grad_update", "zero_optimization.overlap_comm",
        "zero_optimization.offload_optimizer",
    ]  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bench_runtimes_deepspeed_reference_trains_what_ftlab_trains(precision: str) -> None:
    """The reference ``bench_runtime`` compares ftlab with maps onto the settings of the job it stands for (its
    bf16 pins gradients to fp32, as ftlab keeps them)."""
    job = ReferenceJob(model="gpt2-tiny", global_batch=16, micro_batch=2, stages=2, world=4, steps=3, lr=1e-3,
                       min_lr=1e-4, warmup_steps=1, weight_decay=0.01, beta1=0.9, beta2=0.95, seed=0, tokens_path="-",
                       result_path="-", precision=precision)  # fmt: skip
    mapped = {key: m.value for key, m in settings(deepspeed_config(job), job.world // job.stages).train.items()}
    assert mapped == {"global_batch": 16, "micro_batch": 2, "optimizer": "adamw", "lr": 1e-3, "beta1": 0.9,
                      "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "grad_clip": 0.0, "precision": precision,
                      "zero": 1 if precision == "bf16" else 0}  # fmt: skip


# -- each refusal ---------------------------------------------------------------------------------------------------
REFUSALS = [
    ("unknown optimizer", {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer 'Lamb' is not one ftlab runs"),
    ("max_grad_norm", {"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "use gradient_clipping"),
    ("amsgrad", {"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad=True"),
    ("optimizer param", {"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}}, "optimizer.params.momentum"),
    ("zero stage 3", {"zero_optimization": {"stage": 3}}, "zero_optimization.stage=3: ftlab shards only"),
    ("zero stage 2", {"zero_optimization": {"stage": 2}}, "use stage 1 or 0"),
    ("offload", {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer: ftlab keeps"),
    ("zero key", {"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}},
     "cannot honour zero_optimization.zero_quantized_gradients"),
    ("unknown scheduler", {"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler 'OneCycle': ftlab reproduces"),
    ("scheduler param", {"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}},
     "scheduler.params.last_batch_iteration: ftlab cannot reproduce it"),
    ("per-group rates", {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, 2e-3]}}}, "one learning rate"),
    ("cosine without total", {"scheduler": {"type": "WarmupCosineLR", "params": {}}}, "DeepSpeed's WarmupCosineLR refuses"),
    ("float warm-up", {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1e3}}}, "positive integer"),
    ("unknown key", {"sparse_attention": {"mode": "fixed"}}, "ftlab cannot honour 'sparse_attention'"),
    ("auto", {"gradient_clipping": "auto"}, "gradient_clipping = \"auto\""),
    ("bf16 master weights", {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                             "zero_optimization": {"stage": 1}},
     "bf16.bf16_master_weights_and_grads=true"),
    ("both precisions", {"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "cannot be simultaneously enabled"),
    ("pydantic", {"bf16": {"enabled": True, "typo": 1}}, "DeepSpeed refuses it"),
    ("cpu checkpointing", {"activation_checkpointing": {"cpu_checkpointing": True}}, "cpu_checkpointing=true"),
    ("bf16 accumulation", {"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype=\"bf16\""),
    ("fp16 all-reduce", {"communication_data_type": "fp16"}, "sums and all-reduces gradients in fp32"),
    ("data type key", {"data_types": {"params_dtype": "bf16"}}, "cannot honour data_types.params_dtype"),
]


@pytest.mark.parametrize(("name", "ds", "advice"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_a_key_ftlab_cannot_honour_is_refused_by_name(name: str, ds: dict[str, Any], advice: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings({**BATCH, **ds}, 2, "cfg.json")
    assert advice in str(info.value) and str(info.value).startswith("cfg.json: ")


def test_a_batch_triangle_that_does_not_close_on_ftlabs_replicas() -> None:
    with pytest.raises(ConfigError, match=r"16 != 2 \* 4 \* 3 .*cluster.workers_per_node // train.stages = 3"):
        settings({**BATCH, "gradient_accumulation_steps": 4}, 3)


@pytest.mark.parametrize(("text", "advice"), [
    ("{'train_batch_size': 8}", "is not JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ('{"train_batch_size": 8, "train_batch_size": 16}', "key 'train_batch_size' appears twice"),
])  # fmt: skip
def test_a_file_that_is_not_a_json_object_is_refused(tmp_path: Path, text: str, advice: str) -> None:
    path = tmp_path / "ds.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=advice):
        read(path)
    with pytest.raises(ConfigError, match="cannot read it"):
        read(tmp_path / "missing.json")


# -- ftlab's own settings against the file -------------------------------------------------------------------------
def ds_file(tmp_path: Path, ds: dict[str, Any]) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return str(path)


BAD_TRAIN_KEYS = [
    (["train.optimizer=sgd"], "train.optimizer=sgd"),
    (["train.lr_schedule=OneCycle"], "train.lr_schedule=OneCycle"),
    (["train.warmup_type=cubic"], "use one of adamw, adam; cosine, WarmupLR"),
    (["train.eps=0"], "train.eps must be > 0"),
    (["train.cos_min_ratio=-0.1"], "train.cos_min_ratio >= 0"),
    (["train.decay_steps=0"], "train.decay_steps at least 1"),
    (["train.lr_schedule=WarmupLR", "train.warmup_steps=0"], "DeepSpeed's WarmupLR warms up over 1 step or more"),
]


@pytest.mark.parametrize(("overrides", "advice"), BAD_TRAIN_KEYS, ids=[" ".join(o) for o, _ in BAD_TRAIN_KEYS])
def test_bad_optimizer_and_schedule_settings_are_refused(overrides: list[str], advice: str) -> None:
    from omegaconf import OmegaConf

    from ftlab.experiments.job import check_settings

    with pytest.raises(ConfigError, match=re.escape(advice)):
        check_settings(OmegaConf.to_object(compose_config(["experiment=plain", *overrides])))


def test_a_deepspeed_schedule_may_peak_below_min_lr(tmp_path: Path) -> None:
    """min_lr is the default schedule's floor; DeepSpeed's schedules do not read it."""
    from omegaconf import OmegaConf

    from ftlab.experiments.job import check_settings

    path = ds_file(tmp_path, {**BATCH, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 5e-5}}})
    merged, _ = apply(compose_config(["experiment=plain", f"train.deepspeed_config={path}"]), overrides=[])
    assert merged.train.lr == 5e-5 < merged.train.min_lr
    check_settings(OmegaConf.to_object(merged))


def test_an_ftlab_setting_that_disagrees_is_refused_naming_both(tmp_path: Path) -> None:
    path = ds_file(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW",
                              "params": {"lr": 3e-4}}})  # fmt: skip
    cfg = compose_config(["experiment=plain", f"train.deepspeed_config={path}", "train.micro_batch=4", "train.lr=3e-4"])
    with pytest.raises(ConfigError) as info:
        apply(cfg, overrides=[])
    message = str(info.value)
    assert "train.micro_batch=4 against train_micro_batch_size_per_gpu=2" in message
    assert "train.lr" not in message  # set, but to the file's value


def test_a_default_named_on_the_command_line_counts_as_set(tmp_path: Path) -> None:
    path = ds_file(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4})
    cfg = compose_config(["experiment=plain", f"train.deepspeed_config={path}", "train.micro_batch=2"])
    merged, _ = apply(cfg, overrides=[])  # the default's value, unnamed: the file decides
    assert merged.train.micro_batch == 4
    with pytest.raises(ConfigError, match="train.micro_batch=2 against train_micro_batch_size_per_gpu=4"):
        apply(cfg, overrides=["train.micro_batch=2"])
    assert explicit(cfg.train, ["++train.seed=0"]) == {"deepspeed_config", "seed"}


def test_the_mapped_settings_reach_the_workers(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from ftlab.experiments.job import worker_setup

    cfg = compose_config(["experiment=plain", f"train.deepspeed_config={DOCUMENTED}"])
    merged, params = apply(cfg, overrides=[])
    assert params == {"deepspeed": {"ignored": "steps_per_print, wall_clock_breakdown"}}
    job = OmegaConf.to_object(merged)
    checked = SimpleNamespace(protection=SimpleNamespace(runtime_options=dict), tokens="tokens", backend="gloo")
    optim = worker_setup(job, checked)["optim"]  # what every worker process is started with
    assert (optim.schedule, optim.decay_steps, optim.cos_min_ratio, optim.beta2) == ("WarmupCosineLR", 40, 0.1, 0.95)
    assert job.train.precision == "bf16" and job.train.grad_clip == 1.0 and job.train.zero == 1


# -- through the job ------------------------------------------------------------------------------------------------
@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a node was started for a job that should have been refused")

    monkeypatch.setattr(cluster_module.LocalCluster, "start_node", refuse)


def only_run(store: str) -> Any:
    client = MlflowClient(store)
    (record,) = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
    return record


def test_a_refused_ds_config_fails_the_run_before_any_worker(run, tmp_path: Path, no_workers: None) -> None:  # noqa: ANN001
    path = ds_file(tmp_path, {**BATCH, "zero_optimization": {"stage": 3}})
    store = f"sqlite:///{tmp_path}/refused.db"
    with pytest.raises(ConfigError, match="zero_optimization.stage=3"):
        run(f"train.deepspeed_config={path}", f"tracking.uri={store}")
    record = only_run(store)
    assert record.info.status == "FAILED" and "zero_optimization.stage=3" in record.data.tags["failure_reason"]


def test_the_documented_config_runs_unchanged(run, tmp_path: Path) -> None:  # noqa: ANN001
    """bf16, ZeRO-1, AdamW, WarmupCosineLR and clipping, from the file alone, on four worker processes."""
    store = f"sqlite:///{tmp_path}/documented.db"
    result = run(f"train.deepspeed_config={DOCUMENTED}", "train.steps=3", f"tracking.uri={store}")
    assert [s.step for s in result.steps] == [0, 1, 2]
    assert all(s.loss == s.loss for s in result.steps)  # no NaN
    params = only_run(store).data.params
    assert params["deepspeed.ignored"] == "steps_per_print, wall_clock_breakdown"
    assert (params["train.precision"], params["train.lr_schedule"], params["train.global_batch"]) == (
        "bf16", "WarmupCosineLR", "24")


def test_a_restart_under_a_ds_config_stays_on_the_fault_free_trajectory(run, tmp_path: Path) -> None:  # noqa: ANN001
    """Adam with L2 decay, WarmupDecayLR, bf16, clipping and ZeRO-1 from a ds_config: a node killed at step 6 and a
    restart from step 4's checkpoint give the fault-free run's losses and final state (the oracle)."""
    ds = {**BATCH, "optimizer": {"type": "Adam", "params": {"lr": 2e-3, "adam_w_mode": False, "weight_decay": 0.1}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3, "total_num_steps": 8,
                                                              "warmup_type": "linear"}},
          "gradient_clipping": 0.5, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}  # fmt: skip
    common = [f"train.deepspeed_config={ds_file(tmp_path, ds)}", "train.steps=8", "policy=checkpoint_restart",
              "protection=storage", "protection.every=4"]  # fmt: skip
    fault_free = run(*common, f"tracking.uri=sqlite:///{tmp_path}/fault-free.db")
    killed = run(*common, "faults=explicit", "faults.events=[{kind: node, node: 1, at_step: 6}]")
    assert [f.kind for f in killed.faults] == ["node"]
    assert_on_fault_free_trajectory(killed, fault_free, 8)


def test_the_command_names_both_keys_without_a_traceback(tmp_path: Path) -> None:
    """The command line's ``train.micro_batch=2`` (the default's value) against a file's 4: Hydra's overrides say it
    was set."""
    path = ds_file(tmp_path, {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4})
    command = [sys.executable, "-m", "ftlab.experiments.main", "experiment=plain", "progress=false",
               f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"hydra.run.dir={tmp_path}/hydra",
               f"train.deepspeed_config={path}", "train.micro_batch=2"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 1
    assert "train.micro_batch=2 against train_micro_batch_size_per_gpu=4" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr
