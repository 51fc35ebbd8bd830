"""``train.deepspeed_config=<ds_config.json>``: a DeepSpeed config as ftlab's ``train.*`` settings.

The file is read as strict JSON, then validated by DeepSpeed's own config code (``DeepSpeedConfig``'s parsing, its
pydantic sub-configs, its batch-size rules and sanity checks; the scheduler by building DeepSpeed's own class on a
dummy optimizer), and mapped:

    train_batch_size, train_micro_batch_size_per_gpu,   train.global_batch, train.micro_batch
      gradient_accumulation_steps
    optimizer: Adam, AdamW and their params              train.optimizer (adam_w_mode), lr, beta1, beta2, eps,
                                                           weight_decay
    scheduler: WarmupLR, WarmupDecayLR, WarmupCosineLR   train.lr_schedule, warmup_steps, warmup_type, lr,
                                                           warmup_min_lr, warmup_min_ratio, cos_min_ratio, decay_steps
    gradient_clipping                                    train.grad_clip
    bf16 / fp16 with fp16's loss-scale keys               train.precision, loss_scale, initial_scale_power,
                                                           loss_scale_window, hysteresis, min_loss_scale
    zero_optimization.stage 0 or 1                       train.zero
    activation_checkpointing (the section present)       train.activation_checkpointing
    communication_data_type, data_types.grad_accum_dtype  accepted as "fp32" only: ftlab's gradients are fp32

Choices:

- **What the file says decides; what it leaves out stays ftlab's.** A section the file has is taken as DeepSpeed
  reads it, its absent keys at DeepSpeed's defaults (an Adam with no ``weight_decay`` decays by 0, as FusedAdam
  does). A section it lacks leaves ftlab's settings: DeepSpeed then takes the optimizer and the scheduler from the
  client's code, and ftlab is that client.
- **DeepSpeed's world size is the data-parallel width of ftlab's grid**, ``cluster.nodes x
  cluster.workers_per_node // train.stages``: the batch triangle (train_batch_size = micro-batch x accumulation
  steps x world size) is DeepSpeed's own code run with that width, since without a process group it would take 1.
  It holds for the job's first grid; after a failure ftlab keeps the global batch and deals it over the pipelines
  that are left, as its policies do for every job.
- **A setting is ftlab's own when it differs from ``TrainConfig``'s default or the command line names it**
  (Hydra's overrides of the running job). Such a setting that the file sets otherwise is refused, naming both;
  one equal to the file's value is fine. A preset (``experiment=...``) counts by the first rule only.
- **Refused, by name, with what to do instead**: a key ftlab cannot honour (ZeRO stage 2 or 3, offloading, another
  optimizer or scheduler, a parameter DeepSpeed's schedule would read that ftlab cannot reproduce, ...) and any key
  this module does not know. **Ignored on purpose** (logging, profiling, DeepSpeed's own communication and memory
  tuning): listed in the run's MLflow params as ``deepspeed.ignored``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ftlab.runtime.core.config import TrainConfig
from ftlab.runtime.core.contract import ConfigError

IGNORED = (
    # logging and profiling
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "tensorboard", "wandb",
    "csv_monitor", "comet", "flops_profiler", "comms_logger", "timers",
    # DeepSpeed's own machinery: where it divides gradients, its optimizer whitelist, its data loader, its checkpoint
    # files and their I/O (ftlab scales each micro-batch's loss, runs Adam(W) itself, samples by (seed, step) and
    # keeps state through its protection)
    "prescale_gradients", "gradient_predivide_factor", "disable_allgather", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "dataloader_drop_last", "checkpoint", "aio",
)  # fmt: skip
MAPPED = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "gradient_clipping", "bf16", "bfloat16", "fp16", "zero_optimization", "activation_checkpointing",
    "communication_data_type", "data_types",
)  # fmt: skip
ZERO_TUNING = (
    "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "round_robin_gradients",
    "ignore_unused_parameters", "load_from_fp32_weights", "elastic_checkpoint", "sub_group_size",
    "memory_efficient_linear", "log_trace_cache_warnings", "enable_sanity_checks",
)  # fmt: skip
"""zero_optimization's keys that tune DeepSpeed's buckets, overlap and checkpoint layout, not what is computed."""
ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode")
ADAM_KERNEL = ("torch_adam", "fused", "foreach")
"""Which Adam kernel DeepSpeed builds: ftlab runs torch's fused one whatever the file says."""
ADAM_FIXED = {"bias_correction": True, "amsgrad": False, "fp32_optimizer_states": True}
"""Optimizer params ftlab accepts only at the value it computes with."""
SCHEDULES = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "WarmupDecayLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
    "WarmupCosineLR": ("warmup_min_ratio", "cos_min_ratio", "warmup_num_steps", "warmup_type", "total_num_steps"),
}
FP16_SCALER = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
"""fp16's loss-scale keys, the same names in DeepSpeed's fp16 section and in ``train.*``."""


@dataclass(frozen=True)
class Mapped:
    value: Any
    origin: str
    """Where in the ds_config the value comes from, for messages: ``train_batch_size=24``."""


@dataclass
class DeepSpeedSettings:
    """A ds_config as ``train.*`` settings, and the keys it has that ftlab ignores on purpose."""

    train: dict[str, Mapped] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    def take(self, key: str, value: Any, origin: str) -> None:
        self.train[key] = Mapped(value, origin)


def read(path: Path) -> dict[str, Any]:
    """The file as a JSON object; refused if it is missing, not JSON, not an object, or repeats a key."""

    def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            raise ConfigError(f"train.deepspeed_config={path}: key {repeated[0]!r} appears twice: keep one")
        return dict(pairs)

    try:
        ds = json.loads(path.read_text(), object_pairs_hook=no_repeats)
    except OSError as exc:
        raise ConfigError(f"train.deepspeed_config={path}: cannot read it ({exc.strerror or exc}): give the path of "
                          f"a DeepSpeed config JSON") from None  # fmt: skip
    except json.JSONDecodeError as exc:
        raise ConfigError(f"train.deepspeed_config={path} is not JSON ({exc}): give a DeepSpeed config JSON") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"train.deepspeed_config={path} holds a JSON {type(ds).__name__}, not an object of settings")
    return ds


def data_parallel(cluster: Any, stages: int) -> int:
    """The replicas of ftlab's grid (``policies.grid``): DeepSpeed's world size for the batch sizes."""
    return max(1, cluster.nodes * cluster.workers_per_node // stages)


def settings(ds: dict[str, Any], width: int, name: str = "the ds_config") -> DeepSpeedSettings:
    """``ds`` (a parsed ds_config) as ftlab settings, with ``width`` data-parallel replicas; ConfigError for what
    ftlab cannot honour. ``name`` (the file) heads every message."""
    autos = sorted(_paths_of(ds, "auto"))
    if autos:
        raise ConfigError(f"{name}: {', '.join(autos)} = \"auto\": Hugging Face's Trainer fills those in, ftlab does "
                          f"not; give the values")  # fmt: skip
    for key in ds:
        if key not in MAPPED and key not in IGNORED:
            raise ConfigError(f"{name}: ftlab cannot honour {key!r}: remove it (ftlab maps {', '.join(MAPPED)} and "
                              f"ignores {', '.join(IGNORED)})")  # fmt: skip
    config = _deepspeed_config(ds, width, name)
    s = DeepSpeedSettings(ignored=[key for key in ds if key in IGNORED])
    _batch(ds, config, width, s)
    if "optimizer" in ds:
        _optimizer(ds["optimizer"], s, name)
    if "scheduler" in ds:
        _scheduler(ds["scheduler"], s, name)
    if "gradient_clipping" in ds:
        s.take("grad_clip", float(config.gradient_clipping), f"gradient_clipping={ds['gradient_clipping']}")
    _precision(ds, config, s, name)
    if "zero_optimization" in ds:
        _zero(ds["zero_optimization"], config, s, name)
    if "activation_checkpointing" in ds:
        _activation_checkpointing(ds["activation_checkpointing"], s, name)
    _gradient_dtypes(ds, name)
    return s


def apply(dict_cfg: DictConfig, overrides: Sequence[str] | None = None) -> tuple[DictConfig, dict[str, Any]]:
    """The job's config with ``train.deepspeed_config`` mapped onto its ``train.*`` settings, and the params to log
    beside it (``deepspeed.ignored``); unchanged, with none, when no ds_config is given. ``overrides``: the command
    line's (None: the running Hydra job's, if any)."""
    path = dict_cfg.train.deepspeed_config
    if path is None:
        return dict_cfg, {}
    name = f"train.deepspeed_config={path}"
    mapped = settings(read(Path(path)), data_parallel(dict_cfg.cluster, dict_cfg.train.stages), name)
    own = explicit(dict_cfg.train, command_line() if overrides is None else overrides)
    clashes = [
        f"train.{key}={dict_cfg.train[key]} against {m.origin}"
        for key, m in mapped.train.items() if key in own and dict_cfg.train[key] != m.value
    ]  # fmt: skip
    if clashes:
        raise ConfigError(f"{name} and ftlab's own settings disagree: {'; '.join(clashes)}: drop those train.* "
                          f"settings (the ds_config sets them) or change the file")  # fmt: skip
    merged = OmegaConf.merge(dict_cfg, {"train": {key: m.value for key, m in mapped.train.items()}})
    return merged, {"deepspeed": {"ignored": ", ".join(mapped.ignored) or "none"}}


def explicit(train: DictConfig, overrides: Sequence[str]) -> set[str]:
    """The ``train.*`` settings that are ftlab's own: off ``TrainConfig``'s default, or named on the command line."""
    defaults = TrainConfig()
    keys = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    named = {key.removeprefix("train.") for key in keys if key.startswith("train.")}
    return named | {f.name for f in fields(TrainConfig) if train[f.name] != getattr(defaults, f.name)}


def command_line() -> list[str]:
    """The running Hydra job's overrides; none outside ``ftlab`` (Hydra's compose API, as the tests use)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


# -- DeepSpeed's validation ----------------------------------------------------------------------------------------
def _deepspeed_config(ds: dict[str, Any], width: int, name: str) -> Any:
    """DeepSpeed's ``DeepSpeedConfig`` of ``ds`` with a world size of ``width``. Its constructor takes the world size
    from a process group or else 1, so its steps run here in its order on an instance given ``width``."""
    from deepspeed.runtime.config import DeepSpeedConfig, _reject_removed_config_keys

    config = DeepSpeedConfig.__new__(DeepSpeedConfig)
    config._param_dict, config.global_rank, config.world_size = ds, 0, width
    try:
        _reject_removed_config_keys(ds)
        config._initialize_params(copy.copy(ds))
        config._configure_train_batch_size()
        config._do_sanity_check()
    except (AssertionError, ValueError, TypeError, KeyError) as exc:  # DeepSpeed's own refusals (pydantic's too)
        why = " ".join(str(exc).split())
        if "batch" in why.lower() or "accumulation" in why.lower():
            why += (f" (DeepSpeed's world size is the data-parallel width of ftlab's grid, cluster.nodes x "
                    f"cluster.workers_per_node // train.stages = {width})")  # fmt: skip
        raise ConfigError(f"{name}: DeepSpeed refuses it: {why}") from None
    return config


# -- the sections --------------------------------------------------------------------------------------------------
def _batch(ds: dict[str, Any], config: Any, width: int, s: DeepSpeedSettings) -> None:
    gas = config.gradient_accumulation_steps
    micro = config.train_micro_batch_size_per_gpu
    derived = f"(derived by DeepSpeed: {micro} x {gas} accumulation steps x {width} replicas)"
    s.take("global_batch", config.train_batch_size, _said(ds, "train_batch_size", derived))
    s.take("micro_batch", config.train_micro_batch_size_per_gpu, _said(ds, "train_micro_batch_size_per_gpu", derived))


def _optimizer(section: dict[str, Any], s: DeepSpeedSettings, name: str) -> None:
    kind = str(section.get("type", "")).lower()
    if kind not in ("adam", "adamw") or set(section) - {"type", "params"}:
        raise ConfigError(f"{name}: optimizer {section.get('type')!r} is not one ftlab runs: use type Adam or AdamW "
                          f"with params, or drop the optimizer section to keep train.optimizer")  # fmt: skip
    params = section.get("params") or {}
    if "max_grad_norm" in params:
        raise ConfigError(f"{name}: optimizer.params.max_grad_norm: use gradient_clipping, as DeepSpeed asks")
    for key, value in params.items():
        if key in ADAM_FIXED and value != ADAM_FIXED[key]:
            raise ConfigError(f"{name}: optimizer.params.{key}={value}: ftlab's Adam runs with {key}="
                              f"{ADAM_FIXED[key]}: drop it")  # fmt: skip
        if key not in (*ADAM_PARAMS, *ADAM_KERNEL, *ADAM_FIXED):
            raise ConfigError(f"{name}: ftlab cannot honour optimizer.params.{key}: drop it (ftlab maps "
                              f"{', '.join(ADAM_PARAMS)})")  # fmt: skip
    s.ignored += [f"optimizer.params.{key}" for key in params if key in ADAM_KERNEL or key in ADAM_FIXED]
    # DeepSpeed's Adam is AdamW unless adam_w_mode is false (engine._configure_basic_optimizer); AdamW always is.
    decoupled = kind == "adamw" or params.get("adam_w_mode", True)
    s.take("optimizer", "adamw" if decoupled else "adam", f"optimizer.type={section['type']}"
           + (f" with adam_w_mode={params['adam_w_mode']}" if "adam_w_mode" in params else ""))  # fmt: skip
    # What DeepSpeed builds for what the params leave out: FusedAdam's defaults, or torch's with torch_adam.
    decay = 0.01 if params.get("torch_adam") and decoupled else 0.0
    betas = params.get("betas", [0.9, 0.999])
    if not (isinstance(betas, list) and len(betas) == 2):
        raise ConfigError(f"{name}: optimizer.params.betas={betas}: give two numbers, [beta1, beta2]")
    s.take("lr", float(params.get("lr", 1e-3)), _said(params, "lr", "(DeepSpeed's default)", "optimizer.params."))
    s.take("beta1", float(betas[0]), _said(params, "betas", "(DeepSpeed's default)", "optimizer.params."))
    s.take("beta2", float(betas[1]), _said(params, "betas", "(DeepSpeed's default)", "optimizer.params."))
    s.take("eps", float(params.get("eps", 1e-8)), _said(params, "eps", "(DeepSpeed's default)", "optimizer.params."))
    s.take("weight_decay", float(params.get("weight_decay", decay)),
           _said(params, "weight_decay", "(DeepSpeed's default)", "optimizer.params."))  # fmt: skip


def _scheduler(section: dict[str, Any], s: DeepSpeedSettings, name: str) -> None:
    kind = section.get("type")
    if kind not in SCHEDULES or set(section) - {"type", "params"}:
        raise ConfigError(f"{name}: scheduler {kind!r}: ftlab reproduces {', '.join(SCHEDULES)} (train.lr_schedule); "
                          f"use one of them, or drop the scheduler section to keep train.lr_schedule")  # fmt: skip
    params = section.get("params") or {}
    for key, value in params.items():
        if key not in SCHEDULES[kind]:
            raise ConfigError(f"{name}: scheduler.params.{key}: ftlab cannot reproduce it in {kind} (it reads "
                              f"{', '.join(SCHEDULES[kind])}): drop it")  # fmt: skip
        if isinstance(value, list):
            raise ConfigError(f"{name}: scheduler.params.{key}={value}: ftlab has one learning rate for every layer; "
                              f"give one number")  # fmt: skip
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise ConfigError(f"{name}: scheduler.params.warmup_type={params['warmup_type']!r}: use log or linear")
    _build_schedule(kind, params, name)
    s.take("lr_schedule", kind, f"scheduler.type={kind}")

    def said(key: str, default: Any) -> tuple[Any, str]:
        return params.get(key, default), _said(params, key, "(DeepSpeed's default)", "scheduler.params.")

    s.take("warmup_steps", *said("warmup_num_steps", 1000))
    s.take("warmup_type", *said("warmup_type", "log"))
    if kind == "WarmupCosineLR":
        s.take("warmup_min_ratio", *said("warmup_min_ratio", 0.0))
        s.take("cos_min_ratio", *said("cos_min_ratio", 1e-4))
    else:
        s.take("warmup_min_lr", *said("warmup_min_lr", 0.0))
        if "warmup_max_lr" in params or kind == "WarmupDecayLR":  # WarmupLR's default is the optimizer's lr
            s.take("lr", *said("warmup_max_lr", 1e-3))
    if kind != "WarmupLR":
        s.take("decay_steps", *said("total_num_steps", None))


def _build_schedule(kind: str, params: dict[str, Any], name: str) -> None:
    """DeepSpeed's own scheduler class built from ``params`` on a dummy optimizer: what it refuses, ftlab refuses."""
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.utils import logger

    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    level = logger.level
    logger.setLevel("ERROR")  # it warns that the rate of iteration -1 is read before the first step, as it always is
    try:
        getattr(lr_schedules, kind)(dummy, **params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: DeepSpeed's {kind} refuses scheduler.params: {exc}") from None
    finally:
        logger.setLevel(level)


def _precision(ds: dict[str, Any], config: Any, s: DeepSpeedSettings, name: str) -> None:
    bf16_key = "bf16" if "bf16" in ds else "bfloat16"
    bf16, fp16 = ds.get(bf16_key), ds.get("fp16")
    if bf16 is None and fp16 is None:
        return
    refused = {
        f"{bf16_key}.bf16_master_weights_and_grads": config.bfloat16_config.bf16_master_weights_and_grads,
        f"{bf16_key}.bf16_optimizer_states": config.bfloat16_config.bf16_optimizer_states,
        "fp16.fp16_master_weights_and_grads": config.float16_config.fp16_master_weights_and_grads,
        "fp16.consecutive_hysteresis": config.float16_config.consecutive_hysteresis,
    }
    for key, on in refused.items():
        if on:
            raise ConfigError(f"{name}: {key}=true: ftlab keeps fp32 master weights, gradients and moments and "
                              f"DeepSpeed's default loss scaler: set it false or drop it")  # fmt: skip
    # DeepSpeed's BF16 optimizer's bookkeeping (when gradients land, an overflow check) and fp16's cast of the
    # model's float inputs (ftlab's are token ids): ftlab's mixed precision does its own (runtime.core.precision).
    bookkeeping = ("immediate_grad_update", "check_grad_overflow")
    s.ignored += [f"{bf16_key}.{key}" for key in (bf16 or {}) if key in bookkeeping]
    s.ignored += [f"fp16.{key}" for key in (fp16 or {}) if key == "auto_cast"]
    if config.bfloat16_config.enabled:
        s.take("precision", "bf16", f"{bf16_key}.enabled=true")
    elif config.float16_config.enabled:
        s.take("precision", "fp16", "fp16.enabled=true")
        for key in FP16_SCALER:
            s.take(key, getattr(config.float16_config, key), _said(fp16, key, "(DeepSpeed's default)", "fp16."))
    else:
        s.take("precision", "fp32", "bf16 and fp16 not enabled")


def _zero(section: dict[str, Any], config: Any, s: DeepSpeedSettings, name: str) -> None:
    stage = int(config.zero_optimization_stage)
    if stage > 1:
        raise ConfigError(f"{name}: zero_optimization.stage={stage}: ftlab shards only the optimizer state (ZeRO-1, "
                          f"train.zero=1; gradients and parameters stay whole on every replica): use stage 1 or "
                          f"0")  # fmt: skip
    for key, value in section.items():
        if key in ("offload_optimizer", "offload_param"):
            if (value or {}).get("device", "none") not in (None, "none"):
                raise ConfigError(f"{name}: zero_optimization.{key}: ftlab keeps the optimizer state and parameters "
                                  f"on the device: drop it or set its device to none")  # fmt: skip
            s.ignored.append(f"zero_optimization.{key}")
        elif key in ZERO_TUNING:
            s.ignored.append(f"zero_optimization.{key}")
        elif key != "stage":
            raise ConfigError(f"{name}: ftlab cannot honour zero_optimization.{key}: drop it (ftlab maps stage and "
                              f"ignores DeepSpeed's tuning: {', '.join(ZERO_TUNING)})")  # fmt: skip
    s.take("zero", stage, _said(section, "stage", "(DeepSpeed's default)", "zero_optimization."))


def _activation_checkpointing(section: dict[str, Any], s: DeepSpeedSettings, name: str) -> None:
    if section.get("cpu_checkpointing"):
        raise ConfigError(f"{name}: activation_checkpointing.cpu_checkpointing=true: ftlab keeps each stage's "
                          f"checkpointed input on its device: set it false")  # fmt: skip
    # The rest places checkpoints in memory, partitions them over model-parallel ranks (ftlab has none) or profiles.
    s.ignored += [f"activation_checkpointing.{key}" for key in section]
    s.take("activation_checkpointing", True, "activation_checkpointing (the section is present)")


def _gradient_dtypes(ds: dict[str, Any], name: str) -> None:
    """What gradients are summed and all-reduced in: ftlab keeps them fp32 in every precision, so a file that says
    fp32 agrees and any other type is refused."""
    stated = {"communication_data_type": ds.get("communication_data_type")}
    for key, value in (ds.get("data_types") or {}).items():
        if key != "grad_accum_dtype":
            raise ConfigError(f"{name}: ftlab cannot honour data_types.{key}: drop it (ftlab maps "
                              f"data_types.grad_accum_dtype)")  # fmt: skip
        stated["data_types.grad_accum_dtype"] = value
    for key, value in stated.items():
        if value not in (None, "fp32"):
            raise ConfigError(f"{name}: {key}={json.dumps(value)}: ftlab sums and all-reduces gradients in fp32 in "
                              f"every precision: set it to \"fp32\" or drop it")  # fmt: skip


def _said(section: dict[str, Any], key: str, otherwise: str, prefix: str = "") -> str:
    """Where a value comes from: ``prefix + key=value`` as the file says it, or the key and ``otherwise``."""
    return f"{prefix}{key}={json.dumps(section[key])}" if key in section else f"{prefix}{key} {otherwise}"


def _paths_of(tree: Any, wanted: str, prefix: str = "") -> list[str]:
    """The dotted keys of ``tree`` whose value is the string ``wanted``."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _paths_of(v, wanted, f"{prefix}{k}.")]
    return [prefix.rstrip(".")] if tree == wanted else []
