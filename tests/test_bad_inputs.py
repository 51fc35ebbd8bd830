"""Every bad input the project knows is refused before any worker starts, with a message that says what to change.

Checked through the job's own entry (``run_job``: the MLflow run is opened, then refused and marked FAILED with the
reason, and no node is ever started) and, for a sample, through the ``ftlab`` command a user types (exit status 1,
the message, no traceback). Composition errors (unknown options and keys, wrong types) are Hydra's own and are
checked in ``test_config.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ftlab.faults.schedules import FaultConfigError
from ftlab.runtime.processes import cluster as cluster_module
from ftlab.runtime.core.contract import ConfigError


def explicit(event: str) -> list[str]:
    return ["faults=explicit", f"faults.events=[{event}]"]


BAD_INPUTS: list[tuple[str, list[str], type[Exception], str]] = [
    ("batch", ["train.global_batch=15"], ConfigError, "set train.global_batch to a multiple of train.micro_batch"),
    ("micro-batch", ["train.micro_batch=0"], ConfigError, "train.micro_batch=0"),
    ("empty batch", ["train.global_batch=0"], ConfigError, "train.global_batch=0, train.micro_batch=2: both are counts"),
    ("stages", ["train.stages=8"], ConfigError, "cannot form a pipeline of 8 stages"),
    ("stages over layers", ["cluster.nodes=10", "train.stages=9"], ConfigError, "use at most 8 stages"),
    ("steps", ["train.steps=0"], ConfigError, "train.steps=0"),
    ("lr", ["train.lr=-1"], ConfigError, "the learning rate must be positive"),
    ("min lr", ["train.min_lr=0.1", "train.lr=0.01"], ConfigError, "the minimum between 0 and it"),
    ("warm-up", ["train.warmup_steps=-3"], ConfigError, "train.warmup_steps"),
    ("nodes", ["cluster.nodes=0"], ConfigError, "cluster.nodes"),
    ("workers", ["cluster.workers_per_node=0"], ConfigError, "cluster.workers_per_node"),
    ("device memory", ["model=gpt2-small", "cluster.device_memory_gb=0.5"], ConfigError, "raise cluster.device_memory_gb"),
    ("device memory 0", ["cluster.device_memory_gb=0"], ConfigError, "cluster.device_memory_gb=0"),
    # refused from the layers' sizes, before oobleck's planner measures the layers on this machine
    ("a layer larger than a device", ["model=gpt2-small", "policy=oobleck", "cluster=local-6",
                                      "cluster.device_memory_gb=0.05"], ConfigError, "no plan can place it"),
    ("a sequence whose activations fill a device", ["model.seq_len=100000", "cluster.device_memory_gb=0.1"],
     ConfigError, "use a smaller train.micro_batch or model.seq_len"),
    ("heartbeat timeout", ["cluster.heartbeat_timeout_s=0"], ConfigError, "cluster.heartbeat_timeout_s=0"),
    ("backend", ["cluster.backend=mpi"], ConfigError, "use auto, gloo or nccl"),
    ("nccl on cpu", ["cluster.backend=nccl"], ConfigError, "use cluster.backend=gloo"),
    ("launcher", ["cluster.launcher=pbs"], ConfigError, "use local, ssh or slurm"),
    ("coordinator address", ["cluster.coordinator_addr=10.255.0.1"], ConfigError, "is not an address of this machine"),
    ("coordinator host", ["cluster.coordinator_addr=no-such-host.invalid"], ConfigError, "not an address of this machine"),
    ("ssh hosts", ["cluster.launcher=ssh", "cluster.hosts=[a,b]", "cluster.coordinator_addr=10.0.0.1"], ConfigError,
     "one host per node: cluster.hosts has 2 entries for cluster.nodes=4"),
    ("ssh loopback", ["cluster.launcher=ssh", "cluster.hosts=[a,b,c,d]"], ConfigError,
     "set it to this machine's address on the network they share"),
    ("slurm loopback", ["cluster.launcher=slurm"], ConfigError, "the SLURM nodes cannot reach"),
    ("local remote hosts", ["cluster.hosts=[gpu7]"], ConfigError, "use loopback addresses (127.0.0.x) or cluster.launcher=ssh"),
    ("control port", ["cluster.coordinator_port=70000"], ConfigError, "cluster.coordinator_port=70000"),
    ("sim constant", ["sim.host_cores=-1", "sim.codec_bytes_per_s=0"], ConfigError,
     "sim.codec_bytes_per_s=0.0, sim.host_cores=-1.0: the simulator's constants"),
    ("cores by load", ["sim.host_cores_by_load=[1,0]"], ConfigError,
     "sim.host_cores_by_load=[1.0, 0.0]: the simulator's constants"),
    ("layer speed", ["sim.host_layer_speed=[1,1,1,1,1,1,1,-1]"], ConfigError,
     "sim.host_layer_speed=[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0]: the simulator's constants"),
    ("layer speeds", ["sim.host_layer_speed=[1,1]"], ConfigError,
     "sim.host_layer_speed has 2 entries: give one for each of model gpt2-tiny's 8 layers, or none"),
    ("seed", ["train.seed=-1"], ConfigError, "train.seed=-1: use a seed from 0"),
    ("start timeout", ["cluster.start_timeout_s=0"], ConfigError, "cluster.start_timeout_s=0"),
    ("checkpoint folder", ["train.checkpoint_dir=/dev/null/checkpoints"], ConfigError,
     "train.checkpoint_dir=/dev/null/checkpoints: cannot write there (Not a directory)"),
    ("cache folder", ["train.cache_dir=/dev/null/cache"], ConfigError, "train.cache_dir=/dev/null/cache: cannot write"),
    # refused before oobleck's planner measures the layers, not when the measurement is cached
    ("cache folder of a measured profile", ["policy=oobleck", "cluster=local-6", "train.cache_dir=/dev/null/cache"],
     ConfigError, "train.cache_dir=/dev/null/cache: cannot write"),
    ("heads", ["model.hidden=130"], ConfigError, "model.hidden=130 does not split into model.heads=4"),
    ("no heads", ["model.heads=0"], ConfigError, "model.heads=0"),
    ("vocabulary", ["model.vocab_size=2"], ConfigError, "model.vocab_size=2"),
    ("family", ["model.family=t5"], ConfigError, "model.family='t5'"),
    ("kv heads", ["model.kv_heads=3"], ConfigError, "model.kv_heads"),
    ("fault node", explicit("{kind: node, node: 9, at_step: 3}"), FaultConfigError, "node 9"),
    ("fault kind", explicit("{kind: meteor, node: 1, at_step: 3}"), FaultConfigError, "unknown fault kind 'meteor'"),
    ("fault step", explicit("{kind: node, node: 1, at_step: -1}"), FaultConfigError, "at_step -1 is negative"),
    ("fault phase", explicit("{kind: node, node: 1, at_step: 2, phase: lunch}"), FaultConfigError, "unknown phase"),
    ("fault worker", explicit("{kind: process, node: 1, worker: 3, at_step: 2}"), FaultConfigError, "worker 3"),
    ("last node", ["faults=single-node", "cluster.nodes=1", "train.stages=1"], FaultConfigError, "node 1"),
    ("fault past the job", ["faults=single-node", "train.steps=10"], FaultConfigError, "at step 10 cannot fire"),
    ("mtbf", ["faults=exponential", "faults.mtbf_s=0"], FaultConfigError, "faults.mtbf_s"),
    ("weibull shape", ["faults=weibull", "faults.weibull_shape=-1"], FaultConfigError, "faults.weibull_shape"),
    ("unused fault setting", ["faults.mtbf_s=20"], FaultConfigError, "does not use it"),
    ("trace", ["faults=trace", "faults.trace=nosuch"], FaultConfigError, "does not exist"),
    ("trace compression", ["faults=trace", "faults.time_compression=0"], FaultConfigError, "time_compression"),
    ("fault threshold", ["policy=oobleck", "policy.fault_threshold=4"], ConfigError, "policy.fault_threshold"),
    ("negative threshold", ["policy=oobleck", "policy.fault_threshold=-1"], ConfigError, "policy.fault_threshold=-1"),
    ("replicas do not fit", ["policy=oobleck", "policy.fault_threshold=2", "cluster.device_memory_gb=0.04"],
     ConfigError, "4 nodes of 1 x 0.04 GiB: add nodes (cluster.nodes) or memory (cluster.device_memory_gb)"),
    ("template too small", ["policy=oobleck", "policy.min_nodes=0"], ConfigError, "policy.min_nodes=0"),
    ("template too large", ["policy=oobleck", "policy.min_nodes=3", "cluster=local-4"], ConfigError, "between 1 and 2"),
    ("review cadence", ["policy=adaptive", "policy.review_every=-1"], ConfigError, "policy.review_every=-1"),
    ("restart without state", ["policy=checkpoint_restart", "protection=none"], ConfigError, "add protection=storage"),
    ("checkpoint interval", ["protection=storage", "protection.every=0"], ConfigError, "protection.every=0"),
    ("data missing", ["train.data=/nonexistent/corpus.txt"], FileNotFoundError, "/nonexistent/corpus.txt"),
    ("data a folder", ["train.data=/"], FileNotFoundError, "training text '/' is a directory"),
    ("resume dir", ["train.resume_from=/nonexistent/run"], ConfigError, "holds no committed checkpoint"),
]


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if anything tries to start a node: bad input must be refused before that."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a node was started for a job that should have been refused")

    monkeypatch.setattr(cluster_module.LocalCluster, "start_node", refuse)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One MLflow store for every case (creating a store takes seconds); each case names its run."""
    return f"sqlite:///{tmp_path_factory.mktemp('bad-inputs')}/mlflow.db"


def refused_run(store: str, name: str):  # noqa: ANN201 - an mlflow Run
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("ftlab").experiment_id
    (record,) = client.search_runs([experiment], filter_string=f"attributes.run_name = '{name}'")
    assert record.info.status == "FAILED"
    return record


@pytest.mark.parametrize(("name", "overrides", "error", "advice"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_before_any_worker_and_the_run_is_failed(
    run, store: str, no_workers: None, name: str, overrides: list[str], error: type, advice: str  # noqa: ANN001
) -> None:
    with pytest.raises(error) as info:
        run(*overrides, f"tracking.uri={store}", f"tracking.run_name='{name}'")
    assert advice in str(info.value)
    assert advice in refused_run(store, name).data.tags["failure_reason"]


@pytest.mark.parametrize("name", ["empty", "too small"])
def test_training_text_too_short_for_one_sample_is_refused(
    run, store: str, tmp_path: Path, no_workers: None, name: str  # noqa: ANN001
) -> None:
    text = tmp_path / f"{name}.txt"
    text.write_text("" if name == "empty" else "only a few words here\n")
    with pytest.raises(ConfigError, match="fewer than one sample"):
        run(f"train.data={text}", f"tracking.uri={store}", f"tracking.run_name=data-{name}")
    refused_run(store, f"data-{name}")


CLI_SAMPLE = [
    (["mode=bogus"], "use mode=train"),
    (["model.hidden=130"], "model.hidden=130"),
    (["train.lr=-1"], "train.lr=-1"),
    (["cluster.heartbeat_timeout_s=0"], "cluster.heartbeat_timeout_s=0"),
    (["policy=checkpoint_restart"], "add protection=storage"),
]


@pytest.mark.parametrize(("overrides", "advice"), CLI_SAMPLE, ids=[" ".join(o) for o, _ in CLI_SAMPLE])
def test_the_command_says_what_to_change_without_a_traceback(tmp_path: Path, overrides: list[str], advice: str) -> None:
    command = [sys.executable, "-m", "ftlab.experiments.main", "experiment=plain", "progress=false",
               f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"hydra.run.dir={tmp_path}/hydra", *overrides]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 1
    assert f"ftlab: " in done.stderr and advice in done.stderr
    assert "Traceback" not in done.stdout + done.stderr


STORES = [("bogus://x", "MLflow cannot open this store"), ("http://127.0.0.1:1", "no server answers there")]


@pytest.mark.parametrize("sweep", [False, True], ids=["job", "sweep"])
@pytest.mark.parametrize(("uri", "why"), STORES, ids=[u for u, _ in STORES])
def test_a_store_mlflow_cannot_open_is_refused_without_a_traceback(
    tmp_path: Path, uri: str, why: str, sweep: bool
) -> None:
    """No run can record the refusal (there is no store), so the command alone says it, for a job and a sweep; a
    server that does not answer is refused at once (MLflow's client would retry it for minutes)."""
    command = [sys.executable, "-m", "ftlab.experiments.main", *(["-m"] if sweep else []), "experiment=plain",
               f"tracking.uri={uri}", f"hydra.run.dir={tmp_path}/hydra", f"hydra.sweep.dir={tmp_path}/multirun"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 1
    assert f"ftlab: tracking.uri={uri}: {why}" in done.stderr
    assert "give sqlite:///PATH.db" in done.stderr
    assert "Traceback" not in done.stdout + done.stderr
