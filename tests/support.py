"""What many tests share: policies with hand-made layouts, fault schedules written out, plans made deterministic."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ftlab.experiments import job as job_module
from ftlab.policies.grid import decision
from ftlab.policies.none.policy import NoRecovery
from ftlab.runtime.core.config import ClusterConfig
from ftlab.runtime.core.contract import Decision, Job, Protection
from ftlab.runtime.core.devices import node_spec
from ftlab.runtime.core.plan import Pipeline, Plan, Stage


class HeterogeneousLayout(NoRecovery):
    """One 3-stage and one 2-stage pipeline with different layer splits and unequal micro-batch counts (gpt2-tiny)."""

    def plan(self, job: Job, protection: Protection) -> Decision:
        w = job.workers
        layers = len(job.specs)
        micro = job.train.global_batch // job.train.micro_batch
        three = Pipeline((Stage(w[0], 0, 3), Stage(w[1], 3, 6), Stage(w[2], 6, layers)), tuple(range(0, micro - 3)))
        two = Pipeline((Stage(w[3], 0, 4), Stage(w[4], 4, layers)), tuple(range(micro - 3, micro)))
        plan = Plan(0, layers, job.train.global_batch, job.train.micro_batch, (three, two), step=job.start_step)
        plan.validate()
        return decision(plan, "a 3-stage and a 2-stage pipeline")


def explicit(*events: str) -> list[str]:
    """Overrides for an explicit fault schedule of these events."""
    return ["faults=explicit", f"faults.events=[{', '.join(events)}]"]


def node(n: int, step: int, phase: str) -> str:
    """Node ``n`` killed in ``phase`` of ``step``."""
    return f"{{kind: node, node: {n}, at_step: {step}, phase: {phase}}}"


def process(n: int, step: int, phase: str) -> str:
    """The worker process of node ``n`` killed in ``phase`` of ``step``."""
    return f"{{kind: process, node: {n}, worker: 0, at_step: {step}, phase: {phase}}}"


BURSTY_FAULT_AT_STEP_2 = ("faults=weibull", "faults.kind=process", "faults.weibull_shape=0.3",
                         "faults.weibull_scale_steps=0.05", "faults.max_failures=1", "faults.seed=22")  # fmt: skip
"""One failure, of a bursty kind: Weibull gaps of mean 0.46 steps and shape 0.3, so right after a failure the next is
expected within a step, but after two quiet steps only 4.7 steps on (``policies/adaptive/horizon.py``). Seed 22 draws
worker 1 of a six-node cluster (one worker a node) at the start of step 2."""

REVIEW_MACHINERY = ("sim.layer_overhead_s=0.00313873", "sim.control_s=0.0238024", "sim.configure_s=0.00506956",
                    "sim.configure_group_s=0", "sim.build_bytes_per_s=2.62101e+08", "sim.codec_bytes_per_s=3.65449e+08",
                    "sim.host_cores=2", "sim.step_cpu_s=0", "sim.host_cores_by_load=[]")  # fmt: skip
"""The machinery constants adaptive's review scenarios are costed with: a measured set of this machine's, fixed
(the runtime's cost per instruction as a cost per layer of the four-layer stages these scenarios run, the rest of a
step in ``control_s``, and the rates of building and decoding at 3/4 of those measured) so that a re-measurement of
this machine's constants does not move a decision these scenarios hold: with them, rerouting around worker 1 (the
bursty scenario's failure) is about 14% slower an iteration than Oobleck's plan, so the review at step 4 switches."""


REROUTE_MACHINERY = ("sim.layer_overhead_s=0.00005", "sim.control_s=0.00684272", "sim.configure_s=0.00211632",
                     "sim.configure_group_s=0", "sim.build_bytes_per_s=9.94965e+08",
                     "sim.codec_bytes_per_s=5.23127e+08", "sim.host_cores=2", "sim.step_cpu_s=0",
                     "sim.host_cores_by_load=[]")  # fmt: skip
"""The machinery constants of adaptive's reroute-then-reconfigure scenario: a measured set of this machine's with
no cost of a reduce group's configuration and a runtime cost of 0.05 ms a layer of an instruction (about what the
analytic A100 profile's layers cost), the rates of building and decoding at 3/4 as in ``REVIEW_MACHINERY``, fixed so
that a re-measurement does not move its decisions. At a higher cost per layer, the peer that takes a dead worker's
micro-batches is the iteration's tail, and reconfiguring is predicted cheaper for the first failure too; with these,
rerouting it costs 1.7% less."""


A100_40GB = node_spec(ClusterConfig(device="A100-40GB", device_efficiency=0.9))
A100_PRECISION = "tf32"
"""An A100-40GB computing at 140 TFLOP/s in tf32 (90% of its tf32 peak, 45% of its bf16 one) with fp32's bytes: the
costs the scenarios of these tests are set on."""
ON_A100_40GB = (f"cluster.device={A100_40GB.gpu.name}", f"cluster.device_efficiency={A100_40GB.efficiency}",
                f"train.precision={A100_PRECISION}")  # fmt: skip
"""A job's settings for those costs."""


def a100_profile(cfg: Any) -> tuple[Any, dict]:  # noqa: ANN401 - a JobConfig and its ModelProfile
    """The job's model on ``A100_40GB``: the same profile on every run, where one measured on this (loaded) machine
    differs."""
    from ftlab.runtime.processes.profiler import analytic_profile

    profile = analytic_profile(cfg.model, A100_40GB, cfg.train.micro_batch, cfg.model.seq_len, A100_PRECISION)
    return profile, {"kind": "analytic"}


@contextmanager
def analytic_profiles() -> Iterator[None]:
    """Plans from the analytic A100 profile instead of one measured on this (loaded) machine: the same plans on
    every run, so a test knows which layout it kills."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(job_module, "job_profile", a100_profile)
        yield


def snapshot_history(store: str, run_id: str) -> dict[str, dict[int, float]]:
    """Each snapshot's ``ft/snapshot_cpu_s``, ``ft/snapshot_copy_s`` and ``ft/snapshot_bytes`` in the MLflow store
    ``store`` (a tracking URI), by the step each was logged at; keyed ``cpu_s``, ``copy_s`` and ``bytes``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    return {name: {m.step: m.value for m in client.get_metric_history(run_id, f"ft/snapshot_{name}")}
            for name in ("cpu_s", "copy_s", "bytes")}  # fmt: skip


def run_apart(tmp_path_factory: pytest.TempPathFactory, token_cache: Path, *overrides: str) -> job_module.JobResult:
    """A job with a store and checkpoint folder of its own: a module's fault-free reference, run once."""
    d = tmp_path_factory.mktemp("fault-free")
    return job_module.run_job(job_module.compose_config([
        f"tracking.uri=sqlite:///{d}/mlflow.db", f"train.cache_dir={token_cache}", f"train.checkpoint_dir={d}",
        "progress=false", *overrides,
    ]))  # fmt: skip
