"""``make fault-ci``: a fault-injection job for CI, for every policy with every protection (conf/policy x
conf/protection): none, storage checkpoints, REFT's in-memory snapshots.

Each pair trains gpt2-tiny on 6 local nodes (40 MB per device, so Oobleck's pipelines span two nodes) twice:
fault-free, and with node 3 SIGKILLed in the middle of step 5's backward pass. Both train as GPU users do, in bf16
with global gradient clipping at 1.0 (every step of gpt2-tiny is clipped), so recovery is held to the trajectory of
the iteration protocol's full update (``--precision fp32 --grad-clip 0`` runs the matrix as plain fp32). The
invariants:

- a pair the job refuses (a restart policy with nothing saved) is refused before any worker starts, with a message
  that names the protection to choose;
- a policy that does not recover (``none``) stops at the failure and marks its run FAILED with the reason;
- a pair that recovers finishes its MLflow run, commits every step, and every step's loss (as finally committed)
  equals the fault-free run's within the equivalence tolerance; the fault's lost steps are measured and within what
  the pair promises (none when the survivors kept running, at most the checkpoint interval when workers restarted);
  with protection=storage at least one checkpoint was committed, and every committed checkpoint loads;
- no job leaves its nodes' memory in /dev/shm.

Prints one line per check and closes with ``N passed, N failed``; exits non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from mlflow.tracking import MlflowClient

from ftlab.experiments.job import CONF_DIR, JobResult, compose_config, run_job
from ftlab.policies import catalog
from ftlab.runtime.state import checkpoint, shm
from ftlab.runtime.core.contract import ConfigError
from ftlab.runtime.control.coordinator import JobStopped
from ftlab.runtime.training.layer_state import decode

STEPS = 10
CHECKPOINT_EVERY = 3
LOSS_RTOL = 1e-5
KILL = "faults.events=[{kind: node, node: 3, at_step: 5, phase: backward}]"


class Checks:
    def __init__(self) -> None:
        self.passed = 0
        self.failed = 0

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.passed += ok
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""), flush=True)


def losses_by_step(result: JobResult) -> dict[int, float]:
    return {r.step: r.loss for r in result.steps}


def same_losses(a: dict[int, float], b: dict[int, float]) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[s], b[s], rel_tol=LOSS_RTOL) for s in a)


def committed_checkpoints(directory: str) -> list[Path]:
    return sorted(d for d in Path(directory).glob("step-*") if (d / checkpoint.MANIFEST).exists())


def checkpoint_loads(directory: Path) -> bool:
    found = checkpoint.find(directory)
    return found is not None and all(
        decode(checkpoint.layer_path(directory, layer).read_bytes())["module"] for layer in range(found[2])
    )


SETTINGS = {
    "storage": [f"protection.every={CHECKPOINT_EVERY}"],
    "reft": ["protection.interval=1", f"protection.flush_every={CHECKPOINT_EVERY}"],
}
# Committed steps a restart may lose: a storage checkpoint's interval; none from a snapshot taken every step.
LOST_ON_RESTART = {"storage": CHECKPOINT_EVERY, "reft": 0}


DEVICE_MEMORY_GB = 0.04
"""A device's memory for one stage's state: a policy that keeps other stages' copies gets this per copy
(``Roles.state_copies``)."""


def protection_settings(protection: str) -> list[str]:
    return SETTINGS.get(protection, [])


def segments() -> set[str]:
    """The nodes' memories of jobs this process coordinates (other jobs may run beside)."""
    return {p.name for p in shm.ROOT.glob(f"ftlab-{os.getpid()}-*")}


def scenario(policy: str, protection: str, workdir: Path, numerics: list[str]) -> Callable[..., JobResult]:
    memory = catalog.device_memory(policy, DEVICE_MEMORY_GB)

    def run(*extra: str) -> JobResult:
        overrides = [
            "experiment=plain", f"policy={policy}", f"protection={protection}", *protection_settings(protection),
            *numerics,
            "cluster=local-6", memory, f"train.steps={STEPS}", "progress=false",
            f"tracking.uri=sqlite:///{workdir}/mlflow.db", f"train.checkpoint_dir={workdir}/checkpoints", *extra,
        ]  # fmt: skip
        return run_job(compose_config(overrides))

    return run


def check_pair(policy: str, protection: str, workdir: Path, checks: Checks, numerics: list[str]) -> None:
    before = segments()
    check_recovery(policy, protection, workdir, checks, numerics)
    left = segments() - before
    checks.check(f"{policy} + {protection}: no memory left in /dev/shm", not left, str(sorted(left)))


def check_recovery(policy: str, protection: str, workdir: Path, checks: Checks, numerics: list[str]) -> None:
    name = f"{policy} + {protection}"
    run = scenario(policy, protection, workdir, numerics)
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    try:
        faulty = run("faults=explicit", KILL)
    except ConfigError as refused:
        checks.check(f"{name}: refused before any worker, naming a protection", "protection=" in str(refused), str(refused))
        return
    except JobStopped as stopped:
        checks.check(f"{name}: stops at the failure", policy == "none" and "node 3" in str(stopped), str(stopped))
        experiment = client.get_experiment_by_name("ftlab").experiment_id
        latest = client.search_runs([experiment], order_by=["start_time DESC"])[0]
        failed = latest.info.status == "FAILED" and "failure_reason" in latest.data.tags
        checks.check(f"{name}: run marked FAILED with the reason", failed)
        return
    checks.check(f"{name}: recovers", policy != "none", "policy=none finished a job with a failure in it")
    reference = run()
    status = client.get_run(faulty.run_id).info.status
    checks.check(f"{name}: run FINISHED", status == "FINISHED", status)
    checks.check(f"{name}: every step committed", sorted(losses_by_step(faulty)) == list(range(STEPS)))
    same = same_losses(losses_by_step(faulty), losses_by_step(reference))
    checks.check(f"{name}: losses equal the fault-free run's", same)
    lost = [f.lost_steps for f in faulty.faults]
    restarted = any(len(pids) > 1 for pids in faulty.worker_pids.values())
    promise = LOST_ON_RESTART.get(protection, 0) if restarted else 0
    kept = len(lost) == 1 and lost[0] is not None and 0 <= lost[0] <= promise
    checks.check(f"{name}: one failure, its lost steps measured and at most {promise}", kept, str(lost))
    saved = committed_checkpoints(faulty.checkpoint_dir)
    if protection == "storage":
        checks.check(f"{name}: checkpoints were committed", bool(saved), faulty.checkpoint_dir)
    checks.check(f"{name}: committed checkpoints load", all(checkpoint_loads(d) for d in saved))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="*", default=options("policy"))
    parser.add_argument("--protections", nargs="*", default=options("protection"))
    parser.add_argument("--precision", default="bf16", help="train.precision of every job (default bf16)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="train.grad_clip of every job (0: none)")
    args = parser.parse_args()
    numerics = [f"train.precision={args.precision}", f"train.grad_clip={args.grad_clip}"]
    checks = Checks()
    for policy in args.policies:
        for protection in args.protections:
            with tempfile.TemporaryDirectory(prefix=f"fault-ci-{policy}-{protection}-") as workdir:
                check_pair(policy, protection, Path(workdir), checks, numerics)
    print(f"{checks.passed} passed, {checks.failed} failed")
    sys.exit(1 if checks.failed else 0)


if __name__ == "__main__":
    main()
