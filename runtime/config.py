"""The structured-config schema of a job, registered in Hydra's ConfigStore.

``conf/config.yaml`` starts from ``job_schema``, so a wrong type or an unknown key in any group fails at
composition with Hydra's own message. Each component owns its dataclass; this module only assembles them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from faults.schedules import FaultsConfig
from runtime.model import ModelConfig


@dataclass
class ClusterConfig:
    name: str = "local-4"
    nodes: int = 4
    workers_per_node: int = 1
    backend: str = "auto"
    """auto: NCCL when CUDA is present, gloo otherwise."""
    device: str = "cpu"
    """cpu (or cuda): costs measured on this machine; a GPU type of runtime.devices (A40, A100-80GB, ...): an
    analytic profile, for planning at paper scale (mode=plan)."""
    device_memory_gb: float = 2.0
    """Memory of one simulated device; a plan whose stage needs more is refused before any worker starts."""
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    """A worker silent for this long is declared hung, killed and treated as failed."""
    comm_timeout_s: float = 120.0
    threads_per_worker: int = 1
    start_timeout_s: float = 300.0


@dataclass
class TrainConfig:
    steps: int = 30
    global_batch: int = 16
    micro_batch: int = 2
    stages: int = 2
    """Pipeline stages of the default plan (a PP x DP grid over every worker)."""
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 5
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    seed: int = 0
    resume_from: str | None = None
    """A committed checkpoint directory (``.../step-NNNNNN``) or a directory of them (the newest is taken)."""
    data: str | None = None
    """A local text file (plain or .gz); None: the bundled WikiText-2."""
    cache_dir: str = ".ftlab/cache"


@dataclass
class PolicyConfig:
    _target_: str = "policies.base.NoFaultTolerance.from_settings"
    name: str = "none"
    fault_threshold: int = 0
    """Oobleck's f: the number of simultaneous node failures to survive in place."""
    checkpoint_every: int = 0
    """Steps between checkpoints to storage (0: never)."""
    checkpoint_dir: str = ".ftlab/checkpoints"
    """Each run writes under <checkpoint_dir>/<MLflow run id>, so two jobs never read each other's checkpoints."""
    keep_checkpoints: int = 2


@dataclass
class TrackingConfig:
    uri: str = "sqlite:///mlflow.db"
    experiment: str = "ftlab"
    run_name: str | None = None


@dataclass
class JobConfig:
    model: ModelConfig = MISSING
    cluster: ClusterConfig = MISSING
    policy: PolicyConfig = MISSING
    faults: FaultsConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    mode: str = "train"
    """train: run the job; plan: print and log the plan only, starting no worker."""
    progress: bool = True


def register() -> None:
    store = ConfigStore.instance()
    store.store(name="job_schema", node=JobConfig)
    store.store(group="model", name="model_schema", node=ModelConfig)
    store.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    store.store(group="policy", name="policy_schema", node=PolicyConfig)
    store.store(group="faults", name="faults_schema", node=FaultsConfig)
