"""A refused job says so before torch, transformers, DeepSpeed or MLflow load, and records its FAILED run after.

The ``ftlab`` command runs as a user types it, under ``python -X importtime``: the interpreter writes a line to
stderr as each module finishes importing, and the command writes its message to the same stream, so the lines
before the message are exactly the modules loaded when it was printed. What the test asserts is that import set, not
a time (``experiments/refusal_time.py`` measures that).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

HEAVY = ("torch", "transformers", "deepspeed", "mlflow")
IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)$")

REFUSALS = [
    (["train.global_batch=15"], "set train.global_batch to a multiple of train.micro_batch"),
    (["model.family=t5"], "model.family='t5'"),
    (["protection=storage", "protection.every=0"], "protection.every=0"),
    (["policy=checkpoint_restart", "protection=none"], "add protection=storage"),
    (["train.data=/nonexistent/corpus.txt"], "training text '/nonexistent/corpus.txt' does not exist"),
]


def ftlab(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-X", "importtime", "-m", "ftlab.experiments.main", "experiment=plain",
               "progress=false", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"hydra.run.dir={tmp_path}/hydra",
               "tracking.run_name=refused", *overrides]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)


def loaded_before(stderr: str, message: str) -> set[str]:
    """The top-level packages imported before the first line that holds ``message``."""
    lines = stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if message in line and not IMPORTED.match(line))
    return {m.group(1).split(".")[0] for line in lines[:at] if (m := IMPORTED.match(line))}


@pytest.mark.parametrize(("overrides", "advice"), REFUSALS, ids=[" ".join(o) for o, _ in REFUSALS])
def test_a_refusal_is_printed_before_the_heavy_imports_and_recorded_after(
    tmp_path: Path, overrides: list[str], advice: str
) -> None:
    done = ftlab(tmp_path, *overrides)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    before = loaded_before(done.stderr, "ftlab: ")
    assert "omegaconf" in before  # the parse saw the imports: the config was composed before the message
    assert not before & set(HEAVY), f"loaded before the refusal was printed: {sorted(before & set(HEAVY))}"
    assert advice in done.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
    assert run.info.status == "FAILED" and advice in run.data.tags["failure_reason"]


def test_an_unknown_model_is_refused_at_composition_before_the_heavy_imports(tmp_path: Path) -> None:
    """Hydra refuses an unknown option of a config group before the job exists (so there is no run to record)."""
    done = ftlab(tmp_path, "model=no-such-model")
    assert done.returncode == 1
    before = loaded_before(done.stderr, "Could not find 'model/no-such-model'")
    assert "hydra" in before
    assert not before & set(HEAVY), f"loaded before the refusal was printed: {sorted(before & set(HEAVY))}"
    assert "Available options" in done.stderr and "gpt2-tiny" in done.stderr


def test_a_bad_fault_schedule_is_refused_before_the_policy_plans(tmp_path: Path) -> None:
    """The schedule's own errors need no plan: they are said before Oobleck loads its solvers (scipy, Pyomo)."""
    done = ftlab(tmp_path, "policy=oobleck", "faults=exponential", "faults.mtbf_steps=-1")
    assert done.returncode == 1
    before = loaded_before(done.stderr, "ftlab: ")
    assert "faults.mtbf_steps is -1.0" in done.stderr
    planning = {"scipy", "pyomo", *HEAVY}
    assert not before & planning, f"loaded before the refusal was printed: {sorted(before & planning)}"
