"""Policies are found, not listed: a new policy package with its ``conf/policy`` file is all it takes to appear in
``make fault-ci``, the soak draw, adaptive's candidates (when it offers itself as one) and the benches.

The throwaway policies live in a temporary folder on the search path of ``ftlab.policies`` and their YAML files in a
copy of ``conf/``, so nothing in the working tree changes while the test runs (other runs may share it).
"""

from __future__ import annotations

import importlib
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ftlab import policies
from ftlab.experiments import bench_policies, bench_recovery, fault_ci, sim_paper, soak
from ftlab.experiments import job as job_module
from ftlab.experiments.job import compose_config
from ftlab.faults.schedules import ClusterShape, build_schedule
from ftlab.policies import catalog
from ftlab.policies.adaptive.config import AdaptiveConfig
from ftlab.policies.adaptive.policy import Adaptive, offered_candidates
from ftlab.runtime.core.contract import ConfigError

CONFIG = '''
from dataclasses import dataclass


@dataclass
class Settings:
    _target_: str = "ftlab.policies.{name}.policy.Throwaway"
    name: str = "{name}"


SCHEMAS = {{"policy": Settings}}
'''
POLICY = '''
from ftlab.policies.{base_module}.policy import {base}
from ftlab.runtime.core.contract import Roles


class Throwaway({base}):
    roles = {roles}
'''
YAML = "defaults:\n  - /schema/policy@_here_: {name}\n  - _self_\n"

AddPolicy = Callable[[str, str, str], None]


@pytest.fixture
def add_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AddPolicy]:
    """Adds a policy package (``policies/<name>/``: its settings and a class declaring ``roles``, built on an
    existing policy's behaviour) and its ``conf/policy/<name>.yaml``; removed afterwards."""
    packages, conf = tmp_path / "policies", tmp_path / "conf"
    packages.mkdir()
    shutil.copytree(job_module.CONF_DIR, conf)
    monkeypatch.setattr(policies, "__path__", [*policies.__path__, str(packages)])
    monkeypatch.setattr(job_module, "CONF_DIR", conf)
    monkeypatch.setattr(fault_ci, "CONF_DIR", conf)
    added: list[str] = []

    def add(name: str, base: str, roles: str) -> None:
        base_module = {"NoRecovery": "none", "CheckpointRestart": "checkpoint_restart"}[base]
        package = packages / name
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "config.py").write_text(CONFIG.format(name=name))
        (package / "policy.py").write_text(POLICY.format(base_module=base_module, base=base, roles=roles))
        (conf / "policy" / f"{name}.yaml").write_text(YAML.format(name=name))
        importlib.invalidate_caches()
        added.append(name)

    yield add
    packages_added = {f"{policies.__name__}.{name}" for name in added}
    for module in [m for m in sys.modules if m in packages_added or m.rpartition(".")[0] in packages_added]:
        del sys.modules[module]
    for name in added:
        if hasattr(policies, name):
            delattr(policies, name)


def add_two(add_policy: AddPolicy) -> None:
    # mend: recovers in place and offers adaptive a candidate of a new name; tend: restarts from saved state only.
    add_policy("mend", "NoRecovery", 'Roles(in_place=True, candidate="mend")')
    add_policy("tend", "CheckpointRestart", "Roles(restarts=True)")


def test_a_new_policy_is_in_fault_ci_and_the_soak_draw(add_policy: AddPolicy) -> None:
    add_two(add_policy)
    assert {"mend", "tend"} <= set(fault_ci.options("policy"))
    draw = soak.policy_draw()
    assert draw.count("mend") == draw.count("tend") == soak.DEFAULT_WEIGHT
    assert draw[:5] == ["checkpoint_restart", "recycle", "adaptive", "oobleck", "oobleck"], "the existing weights"


def test_a_new_policy_that_offers_a_candidate_is_one_of_adaptives(add_policy: AddPolicy) -> None:
    add_two(add_policy)
    assert list(offered_candidates()) == ["reroute", "reconfigure", "restart", "mend"], "ties: the known ones first"
    assert list(Adaptive(AdaptiveConfig()).candidates) == ["reroute", "reconfigure", "restart", "mend"]
    assert list(Adaptive(AdaptiveConfig(candidates=["mend", "reroute"])).candidates) == ["reroute", "mend"]
    assert "tend" not in offered_candidates().values(), "a policy without a candidate role is none"


def test_a_new_policy_is_in_the_benches_by_its_roles(add_policy: AddPolicy) -> None:
    add_two(add_policy)
    assert {"mend", "tend"} <= set(bench_policies.singles()) and bench_policies.choosers() == ("adaptive",)
    assert bench_policies.compared()[-1] == "adaptive"
    assert "mend" in bench_recovery.in_place() and "tend" in bench_recovery.restarts()
    assert bench_recovery.overrides_of("tend") == ["policy=tend", *bench_recovery.RESTART_PROTECTION,
                                                  "cluster.device_memory_gb=0.04"]
    assert "mend" in sim_paper.recycle_policies()
    assert sim_paper.table2_policies()["tend"] == ["policy=tend", "protection=storage", "protection.every=10"]
    pairs = sim_paper.combinations()
    assert {"mend+none", "mend+storage", "mend+reft", "tend+storage", "tend+reft"} <= set(pairs)
    assert "tend+none" not in pairs, "its check refuses a protection that keeps nothing"


def drawn(policy: str, seed: int = 3) -> list[soak.Scenario]:
    scenarios = [soak.draw(seed, index) for index in range(120)]
    return [s for s in scenarios if f"policy={policy}" in s.job]


def test_the_soak_scenarios_of_a_new_policy_stay_recoverable(add_policy: AddPolicy) -> None:
    """One that says neither how it restarts nor how many failures it survives meets joins only; one that restarts
    from saved state gets a protection that keeps it. Either composes through Hydra from its YAML file alone."""
    add_two(add_policy)
    mend, tend = drawn("mend"), drawn("tend")
    assert mend and tend
    for scenario in mend:
        cfg = OmegaConf.to_object(compose_config(scenario.overrides))
        events = build_schedule(cfg.faults, ClusterShape(cfg.cluster.nodes, cfg.cluster.workers_per_node))
        assert cfg.policy.name == "mend" and {e.kind for e in events} == {"join"}
    for scenario in tend[:3]:
        cfg = OmegaConf.to_object(compose_config(scenario.overrides))
        assert cfg.policy.name == "tend" and cfg.protection.name in ("storage", "reft") and scenario.every


def test_two_policies_offering_one_candidate_name_are_refused(add_policy: AddPolicy) -> None:
    add_policy("mend", "NoRecovery", 'Roles(in_place=True, candidate="restart")')
    with pytest.raises(ConfigError, match="checkpoint_restart and mend both offer adaptive the candidate 'restart'"):
        offered_candidates()


def test_every_policy_found_declares_the_roles_it_plays() -> None:
    found = catalog.roles()
    assert found["none"].recovers is False
    assert {name for name, roles in found.items() if roles.candidate} >= {"recycle", "oobleck", "checkpoint_restart"}
    assert found["adaptive"].chooses and found["checkpoint_restart"].restarts_only


@pytest.mark.parametrize("group", catalog.COMPONENT_GROUPS)
def test_the_readme_lists_every_option_of_each_component_group(group: str) -> None:
    """README's table of config groups names every shipped option, so a new policy cannot land unlisted."""
    readme = (job_module.CONF_DIR.parent / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith(f"| `{group}` |"))
    shipped = {path.stem for path in (job_module.CONF_DIR / group).glob("*.yaml")}
    assert "none" in shipped
    assert {name for name in shipped if f"`{name}`" not in row} == set()
