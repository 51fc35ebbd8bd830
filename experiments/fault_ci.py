"""``make fault-ci``: a fault-injection job for CI, for every policy in conf/policy/ with each protection that keeps
state (storage checkpoints, REFT's in-memory snapshots).

Each pair trains gpt2-tiny on 6 local nodes (40 MB per device, so Oobleck's pipelines span two nodes) twice:
fault-free, and with node 3 SIGKILLed in the middle of step 5's backward pass. The invariants:

- a policy that recovers finishes its MLflow run, and every step's loss (as finally committed) equals the
  fault-free run's within the equivalence tolerance; it loses at most the steps since its last checkpoint (none
  with a snapshot every step), and every committed checkpoint loads;
- a policy that does not recover (``none``) stops at the failure and marks its run FAILED with the reason;
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

from ftlab.runtime import checkpoint, shm
from ftlab.runtime.layer_state import decode
from ftlab.experiments.job import CONF_DIR, JobResult, compose_config, run_job
from ftlab.runtime.coordinator import JobStopped

STEPS = 10
CHECKPOINT_EVERY = 3
LOSS_RTOL = 1e-5
KILL = "faults.events=[{kind: node, node: 3, at_step: 5, phase: backward}]"
PROTECTIONS = {
    "storage": ["protection=storage", f"protection.every={CHECKPOINT_EVERY}"],
    "reft": ["protection=reft", "protection.interval=1", f"protection.flush_every={CHECKPOINT_EVERY}"],
}
LOST_AT_MOST = {"storage": CHECKPOINT_EVERY, "reft": 0}


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


def checkpoints_load(directory: str) -> bool:
    committed = [d for d in Path(directory).glob("step-*") if (d / checkpoint.MANIFEST).exists()]
    return all(
        decode(checkpoint.layer_path(d, layer).read_bytes())["module"]
        for d in committed
        for layer in range(checkpoint.find(d)[2])  # type: ignore[index]
    )


def scenario(policy: str, protection: str, workdir: Path) -> Callable[..., JobResult]:
    def run(*extra: str) -> JobResult:
        overrides = [
            "experiment=plain", f"policy={policy}", "cluster=local-6", "cluster.device_memory_gb=0.04",
            f"train.steps={STEPS}", *PROTECTIONS[protection], "progress=false",
            f"tracking.uri=sqlite:///{workdir}/mlflow.db", f"train.checkpoint_dir={workdir}/checkpoints",
            *extra,
        ]  # fmt: skip
        return run_job(compose_config(overrides))

    return run


def segments() -> set[str]:
    """The nodes' memories of jobs this process coordinates (other jobs may run beside)."""
    return {p.name for p in shm.ROOT.glob(f"ftlab-{os.getpid()}-*")}


def check_policy(policy: str, protection: str, workdir: Path, checks: Checks) -> None:
    before = segments()
    check_recovery(policy, protection, workdir, checks, f"{policy} + {protection}")
    left = segments() - before
    checks.check(f"{policy} + {protection}: no memory left in /dev/shm", not left, str(sorted(left)))


def check_recovery(policy: str, protection: str, workdir: Path, checks: Checks, label: str) -> None:
    run = scenario(policy, protection, workdir)
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    if policy == "none":
        try:
            run("faults=explicit", KILL)
            checks.check(f"{label}: stops at the failure", False, "the job finished")
        except JobStopped as stopped:
            checks.check(f"{label}: stops at the failure", "node 3" in str(stopped), str(stopped))
        latest = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id], order_by=["start_time DESC"])[0]
        checks.check(f"{label}: run marked FAILED with the reason", latest.info.status == "FAILED" and "failure_reason" in latest.data.tags)
        return
    reference = run()
    faulty = run("faults=explicit", KILL)
    status = client.get_run(faulty.run_id).info.status
    checks.check(f"{label}: run FINISHED", status == "FINISHED", status)
    checks.check(f"{label}: every step committed", sorted(losses_by_step(faulty)) == list(range(STEPS)))
    checks.check(f"{label}: losses equal the fault-free run's", same_losses(losses_by_step(faulty), losses_by_step(reference)))
    lost, most = [f.lost_steps for f in faulty.faults], LOST_AT_MOST[protection]
    checks.check(f"{label}: one failure, at most {most} committed steps lost", len(lost) == 1 and 0 <= (lost[0] or 0) <= most, str(lost))
    checks.check(f"{label}: committed checkpoints load", checkpoints_load(faulty.checkpoint_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="*", default=sorted(p.stem for p in (CONF_DIR / "policy").glob("*.yaml")))
    parser.add_argument("--protections", nargs="*", default=sorted(PROTECTIONS), choices=sorted(PROTECTIONS))
    args = parser.parse_args()
    checks = Checks()
    for policy in args.policies:
        for protection in args.protections:
            with tempfile.TemporaryDirectory(prefix=f"fault-ci-{policy}-{protection}-") as workdir:
                check_policy(policy, protection, Path(workdir), checks)
    print(f"{checks.passed} passed, {checks.failed} failed")
    sys.exit(1 if checks.failed else 0)


if __name__ == "__main__":
    main()
