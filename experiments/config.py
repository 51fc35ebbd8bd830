"""The job's config schema for Hydra: every component's dataclass, assembled, and registered in the ConfigStore.

``conf/config.yaml`` starts from ``job_schema``, so a wrong type or an unknown key in any group fails at
composition with Hydra's own message. The ``policy`` and ``protection`` groups hold options with settings of their
own: each option's YAML file names its schema (``defaults: [/schema/policy@_here_: oobleck]``), so a setting the
chosen option does not have (``policy=checkpoint_restart policy.fault_threshold=3``) fails at composition too.

The schemas are found, not listed (``ftlab.policies.catalog``): every package under ``policies/`` may have a
``config.py`` whose ``SCHEMAS`` maps a group (policy, protection) to its settings dataclass, stored under the name that
dataclass gives itself. Adding a policy is adding its package and its YAML file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import MISSING

from ftlab.faults.schedules import FaultsConfig
from ftlab.policies.catalog import component_schemas
from ftlab.runtime.core.config import ClusterConfig, SimConfig, TrackingConfig, TrainConfig
from ftlab.runtime.core.model_spec import ModelConfig


@dataclass
class JobConfig:
    model: ModelConfig = MISSING
    cluster: ClusterConfig = MISSING
    policy: Any = MISSING
    """One of the policy schemas (``component_schemas()["policy"]``)."""
    protection: Any = MISSING
    """One of the protection schemas."""
    faults: FaultsConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    """The simulator's settings and measured constants (mode=simulate)."""
    mode: str = "train"
    """train: run the job; plan: print and log the plan only, starting no worker; simulate: run it on a simulated
    cluster."""
    progress: bool = True


def register() -> None:
    store = ConfigStore.instance()
    store.store(name="job_schema", node=JobConfig)
    for group, schemas in component_schemas().items():
        for name, schema in schemas.items():
            store.store(group=f"schema/{group}", name=name, node=schema)


def build(settings: Any) -> Any:
    """The policy or protection a settings dataclass names with its ``_target_``, built from those settings."""
    return get_class(settings._target_)(settings)
