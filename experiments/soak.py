"""``make soak``: seeded random fault scenarios, each run as a user runs it and checked against its fault-free twin.

    .venv/bin/python -m ftlab.experiments.soak --seed 7 --scenarios 200     # a campaign
    .venv/bin/python -m ftlab.experiments.soak --seed 7 --only 42           # one scenario again
    .venv/bin/python -m ftlab.experiments.soak --seed 7 --first 100 --scenarios 100   # the campaign's next 100

A scenario draws a model (the three families, varied depth, width, heads, sequence length), a cluster shape (nodes x
workers per node, up to 8 workers), a policy (every policy found that recovers, ``DRAW_WEIGHTS``) with a protection, its
training settings (``Training``: fp32, bf16 or fp16 with dynamic loss scaling, gradient clipping, Adam or AdamW, every
learning-rate schedule, and ZeRO-1 where the policy allows it, with REFT's AOR mode), and a fault schedule: explicit
events of every kind (node, process, hang, join) at random steps and phases, simultaneous ones included, some node
faults warned ahead (``WARNED_SHARE``) and some hangs ending as stalls (``STALL_SHARE``), or a generated schedule
(fixed, exponential with a mean time between failures shorter than a restart, Weibull) or a replayed spot trace, so
faults land during recoveries too. A quarter of the scenarios that checkpoint to storage do it on a small disk
(``SMALL_DISK_SHARE``): a tmpfs of their own that holds the first checkpoint and refuses every later one, so saves fail
(``ft/save_failed``) and a restart goes back to that first checkpoint; half of those disks are remounted read-only once
the first checkpoint is committed instead (``READ_ONLY_SHARE``), so the later saves fail with EROFS before the disk
could fill. Another quarter of them lose their coordinator (``COORDINATOR_KILL_SHARE``): it is SIGKILLed before a drawn
step, as the OOM killer would, and the job is resumed from its checkpoint (``train.resume_from``), which continues the
same MLflow run.
Scenario ``i`` of seed ``s`` depends on (s, i) alone.

Each scenario runs through the ``ftlab`` command in its own directory, and so does its fault-free twin (the same
job with ``faults=none``, run once per distinct job). Checks:
- the job finished and its MLflow run is FINISHED;
- every step's loss, as finally committed, equals the twin's within the equivalence tolerance (rel 1e-5);
- every fault that was noticed has its lost steps measured, and within what the recovery promises: none when the
  survivors kept running, at most the checkpoint interval when workers restarted (one interval more for each save
  that failed);
- on a small disk, saves did fail;
- a job whose coordinator was killed was resumed into the same run, and its agents, workers and node memories went;
- no process of the job and no shared-memory segment of it is left behind (nor of its twin).

The generator keeps every scenario recoverable by its policy, from what the policy says of itself (``Roles``): one
that restarts from saved state gets a protection that keeps it and may lose all nodes but one; one that survives
``policy.fault_threshold`` node failures in place (Oobleck) keeps enough nodes for its f + 1 pipelines; any other
meets joins only. So a stop is a finding too. A failing scenario prints the one command that reproduces it. The last
line is one JSON object: scenarios run, passed, failed, and the failures with their commands.

A small disk is mounted in a mount namespace of the job's own (``unshare``), as an unprivileged user in a user namespace
too: no root is needed where the kernel lets users create namespaces.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from mlflow.tracking import MlflowClient

from ftlab.experiments.job import GIB
from ftlab.policies import catalog
from ftlab.runtime.state import checkpoint, shm
from ftlab.runtime.processes.agent import terminate_with_parent
from ftlab.runtime.processes.hold import HOLD_DIR_ENV, step_point
from ftlab.runtime.core.config import LR_SCHEDULES, OPTIMIZERS
from ftlab.runtime.core.costs import layer_bytes, stage_memory, weight_copy_bytes
from ftlab.runtime.core.failed_saves import MIB, checkpoint_bytes
from ftlab.runtime.core.model_spec import ModelConfig, layer_specs

LOSS_RTOL = 1e-5
PHASES = ("forward", "backward", "reduce", "optimizer", "checkpoint", "transfer")
SHAPES = ((4, 1), (5, 1), (6, 1), (7, 1), (8, 1), (3, 2), (4, 2))
START_TIMEOUT_S = 900
"""Workers may take this long to register (the default: 300 s). A campaign shares its machine: at a load average of
ten on two cores, six workers importing torch and transformers once missed 300 s, which is the machine's, not a race
of the runtime's, and would end a campaign's run of passes for nothing it looks for."""
MARK = "FTLAB_SOAK_SCENARIO"
"""Set in a scenario's environment, which its agents and workers inherit: how leftovers are found."""
DRAW_WEIGHTS = {"checkpoint_restart": 1, "recycle": 1, "adaptive": 1, "oobleck": 2}
"""How often a policy is drawn, relative to the others. Every policy found that recovers (``Roles.recovers``) is
drawn; one not named here weighs ``DEFAULT_WEIGHT``. Oobleck weighs two: its scenarios also vary its pipelines' span
(one or two nodes) and f. The order is the draw's, after it the other policies by name: the policies named here keep
the scenarios every seed drew before policies were found rather than listed."""
DEFAULT_WEIGHT = 1
SMALL_DISK_SHARE = 0.25
"""Of the scenarios that checkpoint to storage, the share whose checkpoints go to a small disk."""
READ_ONLY_SHARE = 0.5
"""Of the small disks, the share remounted read-only after the first committed checkpoint."""
WARNED_SHARE = 0.25
"""Of the explicit node faults, the share that come with a preemption warning (0.5 to 3 s of grace)."""
STALL_SHARE = 0.5
"""Of the explicit hangs, the share that end after 1 to 5 s (``for_s``): below the soak's 3 s heartbeat timeout a
stall is a slow worker, above it a hang that is fenced before the worker resumes."""
COORDINATOR_KILL_SHARE = 0.25
"""Of the scenarios that checkpoint to storage (on a disk that keeps them), the share whose coordinator is killed."""


@dataclass
class Scenario:
    index: int
    job: list[str]
    """Overrides of the job itself (model, cluster, training, policy, protection)."""
    faults: list[str]
    every: int | None
    """The most committed steps a restart may lose (the storage checkpoint or REFT flush interval), when the
    protection keeps state."""
    notes: list[str] = field(default_factory=list)
    disk_mib: int | None = None
    """The size of the small disk its checkpoints go to, if they do (``small_disk_mib``)."""
    read_only: bool = False
    """The small disk is remounted read-only once its first checkpoint is committed."""
    kill_at: int | None = None
    """The step before which its coordinator is SIGKILLed, if it is: a checkpoint is written by then."""

    @property
    def overrides(self) -> list[str]:
        return [*self.job, *self.faults]

    def command(self) -> str:
        return "ftlab " + " ".join(shlex.quote(o) for o in self.overrides)

    def describe_disk(self) -> str:
        return f"{self.disk_mib} MiB disk" + (", read-only after its first checkpoint" if self.read_only else "")


# -- drawing a scenario ----------------------------------------------------------------------------------------------
def draw_model(rng: random.Random) -> tuple[ModelConfig, list[str]]:
    family = rng.choice(["gpt2", "llama", "bert"])
    hidden = rng.choice([64, 96, 128])
    heads = rng.choice([2, 4])
    cfg = ModelConfig(
        name=f"soak-{family}", family=family, num_blocks=rng.choice([2, 3, 4, 6]), hidden=hidden, heads=heads,
        vocab_size=8192, seq_len=rng.choice([32, 64]),
        kv_heads=heads // 2 if family == "llama" and rng.random() < 0.5 else None,
    )  # fmt: skip
    overrides = [
        f"model.name={cfg.name}", f"model.family={family}", f"model.num_blocks={cfg.num_blocks}",
        f"model.hidden={hidden}", f"model.heads={heads}", f"model.seq_len={cfg.seq_len}",
        *([f"model.kv_heads={cfg.kv_heads}"] if cfg.kv_heads else []),
    ]  # fmt: skip
    return cfg, overrides


def two_node_memory_gb(cfg: ModelConfig, micro_batch: int, precision: str = "fp32") -> float:
    """A device memory that fits about half the model with its activations in ``precision`` (and autocast's copy of
    its weights): Oobleck's pipelines then span nodes."""
    specs = layer_specs(cfg)
    sizes = [layer_bytes(s, micro_batch, cfg.seq_len, precision) for s in specs]
    params = sum(b["param_bytes"] for b in sizes)
    state = params + sum(b["optimizer_bytes"] for b in sizes)
    saved = sum(b["saved_bytes"] for b in sizes)
    need = stage_memory(state, saved, len(specs), transient_bytes=weight_copy_bytes(params, precision))
    return round(max(need * 0.6, max(b["param_bytes"] * 4 for b in sizes) * 1.5) / GIB, 4)


@dataclass
class Training:
    """A scenario's training settings, drawn apart from the rest of it: the numerics and the update a recovery must
    carry over exactly (the fp16 loss scale, ZeRO-1's optimizer chunks, the schedule's step)."""

    precision: str
    grad_clip: float
    optimizer: str
    lr_schedule: str
    zero: bool
    """ZeRO-1: drawn half the time, kept only for a policy that leaves every layer's optimizer state where it is
    (``zero_allowed``)."""

    @classmethod
    def draw(cls, rng: random.Random) -> Training:
        return cls(
            precision=rng.choice(["fp32", "fp32", "bf16", "fp16"]), grad_clip=rng.choice([0.0, 0.0, 1.0, 0.1]),
            optimizer=rng.choice(OPTIMIZERS), lr_schedule=rng.choice(LR_SCHEDULES), zero=rng.random() < 0.5,
        )  # fmt: skip

    def overrides(self) -> list[str]:
        return [
            f"train.precision={self.precision}", f"train.grad_clip={self.grad_clip:g}",
            f"train.optimizer={self.optimizer}", f"train.lr_schedule={self.lr_schedule}",
            f"train.zero={int(self.zero)}",
        ]  # fmt: skip


def zero_allowed(policy: str) -> bool:
    """ZeRO-1 splits each layer's optimizer state across its replicas: a policy that copies layers with it between
    live workers, or may choose one that does, is refused with it."""
    cls = catalog.policy_classes()[policy]
    return not cls.moves_layers and not cls.roles.chooses


def policy_draw() -> list[str]:
    """The policies a scenario draws from, each as often as it weighs (``DRAW_WEIGHTS``)."""
    recovering = catalog.policies_with(lambda roles: roles.recovers)
    ordered = [p for p in DRAW_WEIGHTS if p in recovering] + [p for p in recovering if p not in DRAW_WEIGHTS]
    return [p for p in ordered for _ in range(DRAW_WEIGHTS.get(p, DEFAULT_WEIGHT))]


def draw(seed: int, index: int) -> Scenario:
    rng = random.Random(f"{seed}/{index}")
    training = Training.draw(random.Random(f"{seed}/{index}/training"))
    cfg, model = draw_model(rng)
    nodes, wpn = rng.choice(SHAPES)
    layers = cfg.num_blocks + 2
    steps = rng.randint(10, 16)
    micro_batch = rng.choice([1, 2])
    job = [
        "experiment=plain", *model, f"cluster.nodes={nodes}", f"cluster.workers_per_node={wpn}",
        f"train.steps={steps}", "train.global_batch=16", f"train.micro_batch={micro_batch}",
        f"train.seed={rng.randint(0, 99)}", "cluster.heartbeat_timeout_s=3", f"cluster.start_timeout_s={START_TIMEOUT_S}",
    ]  # fmt: skip
    policy = rng.choice(policy_draw())
    training = replace(training, zero=training.zero and zero_allowed(policy))
    restarts = catalog.roles()[policy].restarts
    settings = catalog.settings_of("policy", policy)
    every = None
    if restarts or "fault_threshold" not in settings:
        stages = rng.randint(1, min(3, layers, nodes * wpn))
        # A policy keeping other stages' copies needs that many stages (else it is refused); no other draw changes.
        stages = max(stages, catalog.roles()[policy].state_copies)
        every = rng.choice([2, 3, 4])
        protection = draw_protection(rng, every, nodes * wpn >= 2 * stages, training.zero)
        job += [f"policy={policy}", f"train.stages={stages}", *protection]
        if "review_every" in settings:  # adaptive reviews every few steps too, so it may switch plans without a failure
            job.append(f"policy.review_every={rng.choice([0, 2, 3, 5])}")
        # The grid shrinks to the workers left (fewer stages if need be); ReCycle reroutes until a stage loses every
        # replica, then restarts like checkpoint-restart from its protection's state; adaptive has that restart
        # among its choices too. A policy that says neither how it restarts nor how many failures it survives meets
        # joins only.
        spare_nodes = nodes - 1 if restarts else 0
    else:
        split = rng.random() < 0.5
        n0 = 2 if split else 1
        f = rng.choice([1, 2]) if nodes >= 3 * n0 else 1
        if nodes < (f + 1) * n0:
            split, n0, f = False, 1, 1
        job += [f"policy={policy}", f"policy.fault_threshold={f}"]
        if rng.random() < 1 / 3:
            job.append("protection=none")
        else:
            every = rng.choice([2, 3, 4])
            job += draw_protection(rng, every, zero=training.zero)
        if split:
            job.append(f"cluster.device_memory_gb={two_node_memory_gb(cfg, micro_batch, training.precision)}")
        spare_nodes = nodes - (f + 1) * n0  # Oobleck stops below (f + 1) n0 nodes, and a dead process loses its node
    job += training.overrides()
    twists = random.Random(f"{seed}/{index}/twists")
    faults, notes = draw_faults(rng, nodes, wpn, steps, max(0, min(spare_nodes, 3)), twists)
    # From generators of their own, so the scenarios drawn before small disks and kills were are drawn as they were.
    disk_mib = kill_at = None
    read_only = False
    if "protection=storage" in job and every is not None:
        storage = random.Random(f"{seed}/{index}/disk").random()
        if storage < SMALL_DISK_SHARE:
            disk_mib = small_disk_mib(cfg)
            read_only = random.Random(f"{seed}/{index}/read-only").random() < READ_ONLY_SHARE
            job += [f"protection.max_failed_saves={steps}", "protection.allow_low_space=true"]  # every save may fail
        elif storage < SMALL_DISK_SHARE + COORDINATOR_KILL_SHARE:  # the checkpoints must outlive the job
            kill_at = random.Random(f"{seed}/{index}/kill").randint(every + 1, steps - 1)
    return Scenario(index, job, faults, every, notes, disk_mib, read_only, kill_at)


def small_disk_mib(cfg: ModelConfig) -> int:
    """A disk that holds one checkpoint of the model and not two (the second is written before the first goes)."""
    return math.ceil(1.5 * checkpoint_bytes(layer_specs(cfg), cfg.seq_len) / MIB)


def draw_protection(rng: random.Random, every: int, replicated: bool = True, zero: bool = False) -> list[str]:
    """Storage checkpoints every ``every`` steps, or REFT's snapshots every step with a flush to storage every
    ``every`` steps: either way a restart loses at most ``every`` committed steps. ``replicated``: the first plan
    holds every stage at least twice, which REFT's copies and parity need (ftlab refuses it otherwise). ``zero``: the
    job runs ZeRO-1, whose optimizer chunks REFT protects in its own mode, AOR (it refuses the others)."""
    storage = ["protection=storage", f"protection.every={every}"]
    if rng.random() < 0.5:
        return storage
    mode = rng.choice(["arc", "aec"])  # drawn either way: a scenario's later draws do not depend on this one's fate
    if not replicated:
        return storage
    return ["protection=reft", f"protection.mode={'aor' if zero else mode}", "protection.interval=1", f"protection.flush_every={every}"]


def draw_faults(
    rng: random.Random, nodes: int, wpn: int, steps: int, budget: int, twists: random.Random
) -> tuple[list[str], list[str]]:
    """A schedule that loses at most ``budget`` nodes (joins come on top). ``twists`` draws which explicit node faults
    come with a preemption warning and which hangs end (stalls), apart from ``rng``'s draws."""
    if budget == 0:
        return ["faults=explicit", f"faults.events=[{{kind: join, node: {nodes}, at_step: {rng.randint(1, steps - 2)}}}]"], ["join only"]
    schedule = rng.choice(["explicit", "explicit", "explicit", "fixed", "exponential", "weibull", "trace"])
    failures = rng.randint(1, budget)
    common = [f"faults.max_failures={failures}"]
    if schedule != "trace":
        common.append(f"faults.seed={rng.randint(0, 999)}")
    # Half of them on the seconds clock, which (unlike steps) runs on while workers restart: faults during recovery.
    seconds = rng.random() < 0.5
    if schedule == "fixed":
        rate = f"faults.interval_steps=null faults.interval_s={rng.uniform(1.0, 6.0):.2f}" if seconds else f"faults.interval_steps={rng.randint(2, steps - 2)}"
        return ["faults=fixed", *rate.split(), *common, f"faults.kind={rng.choice(['node', 'process'])}"], []
    if schedule == "exponential":
        rate = f"faults.mtbf_steps=null faults.mtbf_s={rng.uniform(1.0, 8.0):.2f}" if seconds else f"faults.mtbf_steps={rng.uniform(2, steps):.1f}"
        return ["faults=exponential", *rate.split(), *common, f"faults.kind={rng.choice(['node', 'process', 'hang'])}"], []
    if schedule == "weibull":
        scale = (f"faults.weibull_scale_steps=null faults.weibull_scale_s={rng.uniform(2.0, 8.0):.2f}" if seconds
                 else f"faults.weibull_scale_steps={rng.uniform(2, steps):.1f}")  # fmt: skip
        return ["faults=weibull", f"faults.weibull_shape={rng.uniform(0.5, 1.5):.2f}", *scale.split(), *common], []
    if schedule == "trace":
        rate = (f"faults.trace_s_per_step=null faults.time_compression={rng.choice([300, 600, 1200])}" if seconds
                else f"faults.trace_s_per_step={rng.choice([60, 120, 240])}")  # fmt: skip
        return ["faults=trace", f"faults.trace={rng.choice(['p3', 'g4dn'])}", *rate.split(), *common], []
    events, dead, joined = [], set(), 0
    for _ in range(failures):
        kind = rng.choice(["node", "node", "process", "hang"])
        node = rng.choice([n for n in range(nodes) if n not in dead])
        step = rng.randint(1, steps - 2)
        phase = rng.choice([None, *PHASES])
        if kind == "node":
            dead.add(node)
        event = f"{{kind: {kind}, node: {node}, at_step: {step}"
        if kind in ("process", "hang"):
            event += f", worker: {rng.randrange(wpn)}"
            dead.add(node)  # a lost process loses its node under an in-place policy
        warned = kind == "node" and twists.random() < WARNED_SHARE
        if warned:  # a warned preemption is killed when its grace ends, in no phase
            event += f", warning_s: {twists.uniform(0.5, 3.0):.1f}"
        elif phase and kind != "hang":
            event += f", phase: {phase}"
        if kind == "hang" and twists.random() < STALL_SHARE:
            event += f", for_s: {twists.uniform(1.0, 5.0):.1f}"
        events.append(event + "}")
    if rng.random() < 0.4:
        events.append(f"{{kind: join, node: {nodes + joined}, at_step: {rng.randint(1, steps - 2)}}}")
    events.sort(key=lambda e: int(e.split("at_step: ")[1].split(",")[0].rstrip("}")))
    return ["faults=explicit", f"faults.events=[{', '.join(events)}]"], []


# -- running and checking --------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    ok: bool
    problems: list[str]
    seconds: float


def run_ftlab(
    overrides: list[str], workdir: Path, cache: Path, mark: str, disk_mib: int | None = None, kill_at: int | None = None,
    read_only: bool = False,
) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run one job through the ftlab command, its checkpoints on a small disk of ``disk_mib`` if given (``read_only``
    once its first checkpoint is committed), its coordinator SIGKILLed before step ``kill_at`` if given (held there:
    ``runtime.processes.hold``); its completed process (``args`` holds the command and, last, the coordinator's pid,
    which names the job's node memories in /dev/shm) and its MLflow store."""
    workdir.mkdir(parents=True, exist_ok=True)
    store = f"sqlite:///{workdir}/mlflow.db"
    checkpoints = workdir / "checkpoints"
    command = [sys.executable, "-m", "ftlab.experiments.main", *overrides, "progress=false", f"tracking.uri={store}",
               f"train.cache_dir={cache}", f"train.checkpoint_dir={checkpoints}", f"hydra.run.dir={workdir}/hydra"]  # fmt: skip
    if disk_mib is not None:
        checkpoints.mkdir(exist_ok=True)
        command = on_small_disk(command, checkpoints, disk_mib, read_only)
    env = {**os.environ, MARK: mark}
    reached = None
    if kill_at is not None:
        holds = workdir / "holds"
        holds.mkdir(exist_ok=True)
        (holds / f"{step_point(kill_at)}.hold").touch()
        reached = holds / f"{step_point(kill_at)}.reached"
        env[HOLD_DIR_ENV] = str(holds)
    # The job stops with the campaign (a SIGTERM, which it answers by marking its run FAILED and freeing its workers
    # and memory), and so does a job that outlives its time.
    with subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=terminate_with_parent) as proc:  # fmt: skip
        try:
            out, err = _until(proc, reached, 1800)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
    return subprocess.CompletedProcess([*command, str(proc.pid)], proc.returncode, out, err), store


def _until(proc: subprocess.Popen[str], reached: Path | None, timeout_s: float) -> tuple[str, str]:
    """The output of ``proc`` once it ends, or once ``reached`` appears: then its coordinator is SIGKILLed (its agents
    and workers are left to notice)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:  # retried, communicate loses no output
            return proc.communicate(timeout=0.5 if reached is not None else timeout_s)
        except subprocess.TimeoutExpired:
            if reached is not None and reached.exists():
                proc.kill()
                return proc.communicate()
            if time.monotonic() > deadline:
                raise


def on_small_disk(command: list[str], folder: Path, mib: int, read_only: bool = False) -> list[str]:
    """``command`` run with ``folder`` a tmpfs of ``mib`` MiB, mounted in a user and mount namespace of its own (it
    needs no root, and the mount goes with the job); the job's pid stays the command's (``exec``). ``read_only``: a
    watcher in the namespace remounts it read-only as soon as a committed checkpoint (its manifest) is there, and
    gives up when the job ends."""
    mount = 'mount -t tmpfs -o size="$1"m tmpfs "$2" || exit 1; dir="$2"; shift 2; '
    if read_only:
        mount += (f'job=$$; {{ until ls "$dir"/*/step-*/{checkpoint.MANIFEST} >/dev/null 2>&1; do '
                  'kill -0 $job 2>/dev/null || exit 0; sleep 0.1; done; mount -o remount,ro "$dir"; } & ')  # fmt: skip
    mount += 'exec "$@"'
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount, "sh", str(mib), str(folder), *command]


def final_losses(store: str) -> tuple[str, dict[int, float], list[dict]]:
    """(run status, the loss of each step as finally committed, events.jsonl)."""
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.timestamp)
    losses = {m.step: m.value for m in history}  # a re-executed step's last value is its committed one
    with tempfile.TemporaryDirectory() as tmp:
        names = {a.path for a in client.list_artifacts(run.info.run_id)}
        events = []
        if "events.jsonl" in names:
            path = client.download_artifacts(run.info.run_id, "events.jsonl", tmp)
            events = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return run.info.status, losses, events


def leftovers(mark: str) -> list[str]:
    """Processes still running with this scenario's mark in their environment."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if f"{MARK}={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
        except (OSError, ValueError):
            continue
    return found


def shm_segments(coordinator_pid: str) -> list[str]:
    """The node memories of the job this coordinator ran (jobs of other users may run beside)."""
    return sorted(p.name for p in shm.ROOT.glob(f"ftlab-{coordinator_pid}-*"))


def leftover_problems(done: subprocess.CompletedProcess[str], mark: str) -> list[tuple[str, list[str]]]:
    """What a finished job left: its processes (by ``mark``) and its node memories (by its coordinator's pid)."""
    return [("processes", leftovers(mark)), ("shared-memory segments", shm_segments(done.args[-1]))]


def check(scenario: Scenario, root: Path, twins: dict[str, dict[int, float]], cache: Path) -> Outcome:
    began = time.monotonic()
    problems: list[str] = []
    key = " ".join(scenario.job)
    if key not in twins:
        mark = f"twin-{len(twins)}-{os.getpid()}"
        # Named by scenario: a twin that failed is not kept, and the next one must not find its store.
        done, store = run_ftlab([*scenario.job, "faults=none"], root / f"twin-{scenario.index}", cache, mark)
        if done.returncode != 0:
            return Outcome(False, [f"the fault-free twin failed: {done.stderr.strip()[-400:]}"], time.monotonic() - began)
        time.sleep(1.0)  # as after a scenario, below
        left = [f"the fault-free twin left {what}: {found}" for what, found in leftover_problems(done, mark) if found]
        if left:
            return Outcome(False, left, time.monotonic() - began)
        twins[key] = final_losses(store)[1]
    mark = f"scenario-{scenario.index}-{os.getpid()}"
    workdir, overrides, killed = root / f"scenario-{scenario.index}", scenario.overrides, None
    if scenario.kill_at is not None:
        killed, store = run_ftlab(overrides, workdir, cache, mark, kill_at=scenario.kill_at)
        if killed.returncode != -signal.SIGKILL:
            problems.append(f"the job ended (exit {killed.returncode}) before step {scenario.kill_at}, where its "
                            f"coordinator was to be killed: {killed.stderr.strip()[-400:]}")  # fmt: skip
            return Outcome(False, problems, time.monotonic() - began)
        client = MlflowClient(store)
        (run,) = client.search_runs([client.get_experiment_by_name("ftlab").experiment_id])
        overrides = [*overrides, f"train.resume_from={workdir / 'checkpoints' / run.info.run_id}"]
    done, store = run_ftlab(overrides, workdir, cache, mark, scenario.disk_mib, read_only=scenario.read_only)
    time.sleep(1.0)  # processes ended by the job's shutdown finish dying
    if done.returncode != 0:
        problems.append(f"exit {done.returncode}: {done.stderr.strip()[-600:]}")
    elif killed is not None and len(client.search_runs([run.info.experiment_id])) != 1:
        problems.append("the resumed job did not continue the killed job's run")
    else:
        status, losses, events = final_losses(store)
        if status != "FINISHED":
            problems.append(f"run {status}")
        reference = twins[key]
        if sorted(losses) != sorted(reference):
            problems.append(f"steps {sorted(set(reference) - set(losses))} never committed")
        wrong = [s for s in reference if s in losses and not math.isclose(losses[s], reference[s], rel_tol=LOSS_RTOL)]
        if wrong:
            problems.append(f"losses differ from the fault-free twin at steps {wrong[:5]}")
        problems += lost_step_problems(events, scenario.every)
        if scenario.disk_mib is not None and not any(e["kind"] == "save_failed" for e in events):
            problems.append(f"the small disk ({scenario.describe_disk()}) refused no save")
    problems += [f"{what} left behind: {found}" for what, found in leftover_problems(done, mark) if found]
    if killed is not None and (memories := shm_segments(killed.args[-1])):
        problems.append(f"the killed coordinator's node memories left behind: {memories}")
    return Outcome(not problems, problems, time.monotonic() - began)


def lost_step_problems(events: list[dict], every: int | None) -> list[str]:
    """Each noticed fault's lost steps are measured and within what its recovery promised: a restart goes back to
    the newest save, at most ``every`` steps behind and one interval more for each save that failed."""
    decisions = [e for e in events if e["kind"] == "recovery_decision"]
    restarted = any(e["outcome"] == "restart" for e in decisions)
    failed_saves = len([e for e in events if e["kind"] == "save_failed"])
    promise = (every or 0) * (1 + failed_saves) if restarted else 0
    problems = []
    for e in (e for e in events if e["kind"] == "recovered"):
        if e["lost_steps"] is None:
            problems.append(f"fault {e['fault']} has no lost-steps figure")
        elif not 0 <= e["lost_steps"] <= promise:
            problems.append(f"fault {e['fault']} lost {e['lost_steps']} committed steps, more than {promise}")
    noticed = len([e for e in events if e["kind"] == "failure_detected"])
    if noticed and not any(e["kind"] == "recovered" for e in events):
        problems.append("failures were noticed but no recovery was reported")
    return problems


def main(argv: list[str] | None = None) -> int:
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # one line per scenario in the log
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=int(time.strftime("%Y%m%d")), help="default: today's date")
    parser.add_argument("--scenarios", type=int, default=10)
    parser.add_argument("--first", type=int, default=0, help="start at scenario FIRST (to carry a campaign on)")
    parser.add_argument("--only", type=int, default=None, help="run scenario ONLY of the seed, alone")
    parser.add_argument("--workdir", type=Path, default=None, help="keep every scenario's files here")
    args = parser.parse_args(argv)
    indices = [args.only] if args.only is not None else list(range(args.first, args.first + args.scenarios))
    print(f"soak: seed {args.seed}, scenarios {indices[0]}..{indices[-1]}", flush=True)
    root = args.workdir or Path(tempfile.mkdtemp(prefix=f"ftlab-soak-{args.seed}-"))
    cache = root / "cache"
    twins: dict[str, dict[int, float]] = {}
    failures = []
    for index in indices:
        scenario = draw(args.seed, index)
        outcome = check(scenario, root, twins, cache)
        disk = f" (checkpoints on a {scenario.describe_disk()})" if scenario.disk_mib is not None else ""
        disk += f" (coordinator killed before step {scenario.kill_at})" if scenario.kill_at is not None else ""
        print(f"{'PASS' if outcome.ok else 'FAIL'} scenario {index} ({outcome.seconds:.0f} s): {scenario.command()}{disk}",
              flush=True)  # fmt: skip
        if not outcome.ok:
            reproduce = f"python -m ftlab.experiments.soak --seed {args.seed} --only {index}"
            for problem in outcome.problems:
                print(f"    {problem}", flush=True)
            print(f"    reproduce: {reproduce}", flush=True)
            failures.append({"scenario": index, "command": scenario.command(), "reproduce": reproduce,
                             "problems": outcome.problems})  # fmt: skip
    passed = len(indices) - len(failures)
    print(f"{passed} passed, {len(failures)} failed")
    print(json.dumps({"seed": args.seed, "scenarios": len(indices), "passed": passed, "failed": len(failures),
                      "failures": failures}))  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
