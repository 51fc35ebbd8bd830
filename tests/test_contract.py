"""The contract between policies, runtime and simulator is light, and the code points one way.

- Plans, programs, the scheduler, the program checker, the cost model, the job view, changes, decisions, events, the
  backend seam, the simulated backend and every policy and protection import without torch, transformers, DeepSpeed or Hydra (checked in a
  fresh interpreter, since this one has them all loaded).
- A policy never imports process code; the runtime never imports policies, fault schedules or the entry point.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from ftlab.experiments.config import component_schemas

ROOT = Path(__file__).parents[1]
HEAVY = ("torch", "transformers", "deepspeed", "hydra")
CONTRACT = [
    "ftlab.runtime.core.contract",
    "ftlab.runtime.core.plan",
    "ftlab.runtime.core.instructions",
    "ftlab.runtime.core.scheduler",
    "ftlab.runtime.core.program_check",
    "ftlab.runtime.core.costs",
    "ftlab.runtime.control.events",
    "ftlab.runtime.control.backend",
    "ftlab.runtime.control.coordinator",
    "ftlab.runtime.core.model_spec",
    "ftlab.runtime.state.checkpoint",
    "ftlab.runtime.sim.timing",
    "ftlab.runtime.sim.backend",
    "ftlab.runtime.core.snapshot_layout",
    "ftlab.runtime.state.shm",
    # Not contract, but loaded before torch all the same: preflight checks launch settings with the first two, and
    # a node agent (on any host) comes up without torch.
    "ftlab.runtime.processes.launchers",
    "ftlab.runtime.processes.placement",
    "ftlab.runtime.processes.agent",
]
GROUPS_BELOW = {
    "core": set(),
    "control": {"core"},
    "sim": {"core", "control"},
    "training": {"core"},
    "state": {"core", "training"},
    "processes": {"core", "control", "state", "training"},
    "reporting": {"core", "control"},
}
"""Each group of runtime/ and the groups it may import: the contract at the bottom, the simulator and the process
backend side by side above the protocol, neither importing the other."""
POLICY_MAY_IMPORT = {"core"}
"""A policy sees the contract and what it speaks of, never the simulator, the processes or saved state's code."""


def runtime_groups_of(imported: set[str]) -> set[str]:
    return {m.split(".")[2] for m in imported if m.startswith("ftlab.runtime.") and m.count(".") >= 2}


def policy_modules() -> list[str]:
    return sorted(
        "ftlab." + ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in (ROOT / "policies").rglob("*.py")
    )


def test_the_contract_and_every_policy_load_without_torch_or_hydra() -> None:
    modules = CONTRACT + policy_modules()
    probe = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted({{n.split('.')[0] for n in sys.modules}} & {set(HEAVY)!r}))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", f"importing the contract loaded {loaded}"


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "policies").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_policy_imports_only_the_contract(path: Path) -> None:
    assert runtime_groups_of(imports_of(path)) <= POLICY_MAY_IMPORT


def test_a_policy_importing_the_simulator_is_caught(tmp_path: Path) -> None:
    """The rule above would catch a policy that predicts with the simulator's own modules."""
    probe = tmp_path / "policy.py"
    probe.write_text("from ftlab.runtime.sim.timing import IterationTimer\nfrom ftlab.runtime import sim\n")
    assert runtime_groups_of(imports_of(probe)) == {"sim"}


def test_runtime_groups_import_only_the_groups_below_them() -> None:
    groups = {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()}
    assert groups == set(GROUPS_BELOW), "a new group of runtime/ says which groups it may import (GROUPS_BELOW)"
    for group, below in GROUPS_BELOW.items():
        for path in sorted((ROOT / "runtime" / group).rglob("*.py")):
            above = runtime_groups_of(imports_of(path)) - below - {group}
            assert not above, f"{path.relative_to(ROOT)} imports runtime groups {sorted(above)} above it"


@pytest.mark.parametrize("path", sorted((ROOT / "runtime").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_runtime_imports_nothing_above_it(path: Path) -> None:
    above = ("ftlab.policies", "ftlab.faults", "ftlab.experiments")
    assert not [m for m in imports_of(path) if m.startswith(above)]


def test_every_component_package_declares_its_schema_and_config_file() -> None:
    schemas = component_schemas()
    for group, options in schemas.items():
        files = {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}
        assert set(options) == files, f"{group}: schemas {sorted(options)} but config files {sorted(files)}"


@pytest.mark.parametrize(
    "overrides",
    [["train.global_batch=15"], ["policy=checkpoint_restart"], ["model.hidden=130"], ["train.lr=-1"]],
    ids=" ".join,
)
def test_a_bad_job_is_refused_before_torch_is_imported(overrides: list[str], tmp_path: Path) -> None:
    """What the preflight catches is answered without loading the training stack (which takes seconds)."""
    probe = f"""
import sys
from omegaconf import OmegaConf
from ftlab.experiments.job import compose_config, preflight
from ftlab.runtime.core.contract import ConfigError
cfg = OmegaConf.to_object(compose_config({["experiment=plain", f"train.cache_dir={tmp_path}", *overrides]!r}))
try:
    preflight(cfg)
except ConfigError as exc:
    print("refused:", exc)
print(sorted({{n.split('.')[0] for n in sys.modules}} & {set(HEAVY) - {"hydra"}!r}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.startswith("refused:") and out.strip().endswith("[]"), out
