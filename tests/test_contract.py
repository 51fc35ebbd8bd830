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
    "ftlab.runtime.contract",
    "ftlab.runtime.plan",
    "ftlab.runtime.instructions",
    "ftlab.runtime.scheduler",
    "ftlab.runtime.program_check",
    "ftlab.runtime.costs",
    "ftlab.runtime.events",
    "ftlab.runtime.backend",
    "ftlab.runtime.coordinator",
    "ftlab.runtime.model_spec",
    "ftlab.runtime.checkpoint",
    "ftlab.runtime.sim_timing",
    "ftlab.runtime.sim_backend",
    "ftlab.runtime.snapshot_layout",
    "ftlab.runtime.shm",
    # Not contract, but loaded before torch all the same: preflight checks launch settings with the first two, and
    # a node agent (on any host) comes up without torch.
    "ftlab.runtime.launchers",
    "ftlab.runtime.placement",
    "ftlab.runtime.agent",
]
PROCESS_CODE = {
    "agent", "cluster", "comm", "executor", "local_backend", "model", "model_families", "layer_state", "worker",
    "messages", "optim", "profiler", "tracking", "progress", "timeline", "data", "snapshot", "shm", "zero",
    "launchers", "placement",
}  # fmt: skip


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
def test_a_policy_imports_no_process_code(path: Path) -> None:
    process = {f"ftlab.runtime.{name}" for name in PROCESS_CODE}
    assert not imports_of(path) & process


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
from ftlab.runtime.contract import ConfigError
cfg = OmegaConf.to_object(compose_config({["experiment=plain", f"train.cache_dir={tmp_path}", *overrides]!r}))
try:
    preflight(cfg)
except ConfigError as exc:
    print("refused:", exc)
print(sorted({{n.split('.')[0] for n in sys.modules}} & {set(HEAVY) - {"hydra"}!r}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.startswith("refused:") and out.strip().endswith("[]"), out
