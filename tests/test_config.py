"""Every config in conf/ composes through Hydra's compose API, and the schema rejects wrong types and unknown keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ValidationError

from ftlab.experiments.config import JobConfig
from ftlab.experiments.job import CONF_DIR, compose_config

GROUPS = ["model", "cluster", "policy", "protection", "faults", "experiment"]
OPTIONS = [(group, path.stem) for group in GROUPS for path in sorted((CONF_DIR / group).glob("*.yaml"))]


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_config_composes_into_the_schema(group: str, option: str) -> None:
    cfg = compose_config([f"{group}={option}"])
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    if group != "experiment":  # experiment presets write into the whole config, not a node of their own
        assert OmegaConf.select(cfg, f"{group}.name" if group != "faults" else "faults.schedule") is not None


def test_the_groups_hold_what_the_readme_promises() -> None:
    names = {group: {p.stem for p in Path(CONF_DIR, group).glob("*.yaml")} for group in GROUPS}
    assert {"gpt2-tiny", "gpt2-small", "gpt3-medium", "gpt3-2.7b", "gpt3-6.7b", "bert-large", "llama2-1.3b",
            "llama2-6.7b"} <= names["model"]  # fmt: skip
    assert {"local-4", "local-8"} <= names["cluster"]
    assert {"none", "checkpoint_restart", "oobleck"} <= names["policy"] and {"none"} <= names["faults"]
    assert {"none", "storage"} <= names["protection"]


def test_the_default_job_is_the_quick_start_experiment() -> None:
    cfg = compose_config()
    assert (cfg.model.name, cfg.cluster.name, cfg.policy.name, cfg.faults.schedule) == (
        "gpt2-tiny", "local-6", "oobleck", "explicit",
    )  # fmt: skip
    assert cfg.policy.fault_threshold == 1 and [e.kind for e in cfg.faults.events] == ["node"]
    assert cfg.tracking.uri == "sqlite:///mlflow.db"


def test_the_plain_experiment_is_the_groups_defaults() -> None:
    cfg = compose_config(["experiment=plain"])
    assert (cfg.model.name, cfg.cluster.name, cfg.policy.name, cfg.protection.name, cfg.faults.schedule) == (
        "gpt2-tiny", "local-4", "none", "none", "none",
    )  # fmt: skip


def test_a_wrong_type_fails_at_composition() -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["train.steps=many"])
    assert isinstance(info.value.__cause__, ValidationError)
    assert "steps" in str(info.value.__cause__)


def test_an_unknown_key_fails_at_composition() -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["train.stepz=3"])
    assert isinstance(info.value.__cause__, ConfigAttributeError)
    assert "stepz" in str(info.value.__cause__)


@pytest.mark.parametrize("override", ["model=gpt5-huge", "cluster=moon-base"])
def test_an_unknown_option_lists_the_available_ones(override: str) -> None:
    with pytest.raises(MissingConfigException) as info:
        compose_config([override])
    assert "Available options" in str(info.value)


def test_an_unknown_key_in_a_group_file_fails_at_composition(tmp_path: Path) -> None:
    """A typo inside a YAML file of a group is caught by the schema too, not only on the command line."""
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "typo.yaml").write_text("name: typo\nnodez: 3\n")
    with pytest.raises(ConfigCompositionException) as info:
        compose_config([f"hydra.searchpath=[file://{tmp_path}]", "cluster=typo"])
    assert "nodez" in str(info.value.__cause__ or info.value)


@pytest.mark.parametrize("policy", ["none", "checkpoint_restart", "oobleck", "recycle"])
@pytest.mark.parametrize("protection", ["none", "storage"])
def test_policies_and_protections_compose_freely_each_with_its_own_schema(policy: str, protection: str) -> None:
    job = OmegaConf.to_object(compose_config(["experiment=plain", f"policy={policy}", f"protection={protection}"]))
    assert (job.policy.name, job.protection.name) == (policy, protection)
    assert type(job.policy).__name__.endswith("Config") and type(job.protection).__name__.endswith("Config")


@pytest.mark.parametrize(
    "override",
    [
        "policy.fault_threshold=3",  # an Oobleck setting under policy=checkpoint_restart
        "protection.every=3",  # a storage setting under protection=none
        "policy.checkpoint_every=3",  # where the checkpoint settings were before they became the protection's
    ],
)
def test_a_setting_the_chosen_option_does_not_have_fails_at_composition(override: str) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["experiment=plain", "policy=checkpoint_restart", "protection=none", override])
    assert override.split("=")[0].split(".")[1] in str(info.value.__cause__ or info.value)


def test_a_wrong_type_in_a_policy_setting_fails_at_composition() -> None:
    with pytest.raises(ConfigCompositionException) as info:
        compose_config(["experiment=plain", "policy=oobleck", "policy.fault_threshold=many"])
    assert "fault_threshold" in str(info.value.__cause__ or info.value)
