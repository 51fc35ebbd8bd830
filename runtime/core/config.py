"""The settings the runtime itself owns: the cluster, the training run, tracking. Plain dataclasses, no Hydra.

Each component owns its dataclass (the model's is ``runtime.core.model_spec.ModelConfig``, the fault schedule's
``faults.schedules.FaultsConfig``, each policy's and protection's in its own package); ``experiments.config``
assembles them into the job's schema for Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OPTIMIZERS = ("adamw", "adam")
LR_SCHEDULES = ("cosine", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
WARMUP_TYPES = ("log", "linear")


@dataclass
class ClusterConfig:
    name: str = "local-4"
    nodes: int = 4
    workers_per_node: int = 1
    backend: str = "auto"
    """auto: NCCL when CUDA is present, gloo otherwise."""
    device: str = "cpu"
    """cpu (or cuda): costs measured on this machine; a GPU type of runtime.core.devices (A40, A100-80GB, ...): an
    analytic profile, for planning at paper scale (mode=plan)."""
    device_memory_gb: float = 2.0
    """Memory of one simulated device; a plan whose stage needs more is refused before any worker starts."""
    device_efficiency: float = 0.45
    """A GPU type: the fraction of its peak in ``train.precision`` that training reaches (0 < e <= 1). Megatron-LM
    reached 44-52% of A100 peak on GPT models at scale (Narayanan et al., SC'21, Table 1); the default takes the
    lower half of that range. ``sim.calibrate_samples_per_s`` finds it from a stated throughput instead."""
    node_network_gbps: float | None = None
    """A GPU type: the node's inter-node network, all its GPUs together, Gb/s one direction; None: the device's
    reference server's, one port per GPU (``runtime.core.devices``)."""
    intra_node_gbps: float | None = None
    """A GPU type: GPU to GPU inside a node (NVLink, or PCIe), Gb/s one direction; None: the device's."""
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 10.0
    """A worker silent for this long is declared hung, killed and treated as failed."""
    comm_timeout_s: float = 120.0
    threads_per_worker: int = 1
    """0: this job's share of the machine's CPUs, split among its workers (in a parallel sweep the CPUs are first
    split among the jobs that run at once: ``experiments/main.py``)."""
    parallel_jobs: int = 1
    """Jobs sharing this machine at once; set by a parallel sweep (the joblib launcher's n_jobs)."""
    start_timeout_s: float = 300.0
    coordinator_addr: str = "127.0.0.1"
    """Where the control server and the rendezvous store listen: loopback (the default) is reachable from this
    machine only; give this machine's address on the network the hosts share to run agents elsewhere."""
    coordinator_port: int = 0
    """The control server's port (0: any free one; fix it where a firewall must let it through)."""
    store_port: int = 0
    """The rendezvous store's port (0: any free one)."""
    launcher: str = "local"
    """local: agents are children of the coordinator; ssh: ``ssh <host> ftlab-agent`` on each of ``hosts``;
    slurm: one SLURM job per node through submitit (README, "Running on a cluster")."""
    hosts: list[str] = field(default_factory=list)
    """ssh: one host per node (``[user@]host``; its address is what workers connect to). local: optional, the
    loopback address each node's workers use (e.g. 127.0.0.2, to test as another host would be)."""
    agent_command: str = "ftlab-agent"
    """ssh: the agent's command on the hosts (e.g. ``/opt/venv/bin/ftlab-agent``)."""
    slurm_partition: str | None = None
    slurm_timeout_min: int = 60
    slurm_folder: str = ".ftlab/slurm"
    """submitit's folder (logs, pickled calls, the job's secret in a 0600 file): on a filesystem the nodes share."""


@dataclass
class TrainConfig:
    steps: int = 30
    global_batch: int = 16
    micro_batch: int = 2
    stages: int = 2
    """Pipeline stages of the default plan (a PP x DP grid over every worker)."""
    activation_checkpointing: bool = False
    """Each stage keeps only its input per micro-batch and recomputes its forward in the backward pass: far less
    activation memory for one more forward per micro-batch (``runtime.core.costs``). Losses are the same."""
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 5
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    # The optimizer and the learning-rate schedule beyond the defaults above, named as DeepSpeed names them: a
    # ds_config (train.deepspeed_config, experiments/deepspeed_config.py) maps onto these and the keys above.
    deepspeed_config: str | None = None
    """A DeepSpeed config JSON whose settings become the ``train.*`` settings (README, "DeepSpeed configs")."""
    optimizer: str = "adamw"
    """adamw: weight decay decoupled from the gradient (torch AdamW); adam: weight decay added to the gradient as L2
    (torch Adam; DeepSpeed's Adam with ``adam_w_mode: false``)."""
    eps: float = 1e-8
    lr_schedule: str = "cosine"
    """cosine: linear warm-up over warmup_steps to lr, then cosine to min_lr at train.steps. DeepSpeed's, exactly as
    its schedulers step (``runtime.training.optim.lr_at``): WarmupLR (warmup_min_lr to lr over warmup_steps, then
    lr), WarmupDecayLR (then linear to 0 at decay_steps), WarmupCosineLR (lr times a ratio from warmup_min_ratio to
    1 over warmup_steps, then cosine to cos_min_ratio at decay_steps)."""
    warmup_type: str = "log"
    """DeepSpeed's schedules: the warm-up's shape, log or linear."""
    warmup_min_lr: float = 0.0
    warmup_min_ratio: float = 0.0
    cos_min_ratio: float = 1e-4
    decay_steps: int | None = None
    """DeepSpeed's total_num_steps (WarmupDecayLR, WarmupCosineLR); None: train.steps."""
    seed: int = 0
    zero: int = 0
    """1: ZeRO-1, each layer's optimizer state split across the layer's replicas (gradients reduce-scattered, each
    replica steps its chunk, parameters all-gathered); 0: every replica holds its layers' whole optimizer state."""
    resume_from: str | None = None
    """A committed checkpoint directory (``.../step-NNNNNN``) or a directory of them (the newest is taken)."""
    data: str | None = None
    """A local text file (plain or .gz); None: the bundled WikiText-2."""
    cache_dir: str = ".ftlab/cache"
    checkpoint_dir: str = ".ftlab/checkpoints"
    """Each run writes its checkpoints (its protection's, and the survivors' when a job stops) under
    <checkpoint_dir>/<MLflow run id>, so two jobs never read each other's. A relative path is taken from the
    directory ftlab starts in; with ssh or SLURM nodes it must be on a filesystem they share at the same path."""
    # Numerics of the update (``runtime.core.precision``; the names are DeepSpeed's, which ds_config keys map onto).
    precision: str = "fp32"
    """fp32 | tf32 | bf16 | fp16: the compute precision (tf32: fp32 tensors, matmuls on a GPU's TF32 tensor cores).
    Weights, gradients and AdamW's moments stay fp32 in every case."""
    grad_clip: float = 0.0
    """Max global L2 norm of the gradient over every layer of the model; 0: no clipping."""
    loss_scale: float = 0.0
    """fp16: 0 = dynamic loss scaling, > 0 a static scale."""
    initial_scale_power: int = 16
    """fp16 dynamic: the first scale is 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """fp16 dynamic: the scale doubles after this many steps without an overflow."""
    hysteresis: int = 2
    """fp16 dynamic: overflows tolerated before the scale is halved."""
    min_loss_scale: float = 1.0
    max_skipped_steps: int = 20
    """fp16: consecutive steps skipped for an overflow after which the job stops with the reason."""


@dataclass
class TrackingConfig:
    uri: str = "sqlite:///mlflow.db"
    experiment: str = "ftlab"
    run_name: str | None = None
    """None: policy-protection-faults-seed."""
    parent_run_id: str | None = None
    """The sweep's run, when the job is one of a sweep (set by ``ftlab -m``): the job's run is its child."""
    sweep_id: str | None = None


@dataclass
class SimConfig:
    """The simulator's settings (``mode=simulate``, ``runtime.sim.backend``) and the costs it cannot read off a
    model profile: constants of the machinery around training, measured by ``experiments/measure_sim_constants.py``
    and stored in ``conf/sim/measured.yaml``. The job's machine (``runtime.sim.machines``) reads them: the fields
    marked *shared host* only where every worker is a process of one host (``SharedHostMachine``)."""

    horizon_s: float | None = None
    """Simulated seconds of training after which the job ends (with train.steps as a cap); None: train.steps."""
    calibrate_samples_per_s: float | None = None
    """A GPU type: the fault-free throughput the job is stated to reach; the simulation runs at the
    ``cluster.device_efficiency`` at which its first plan reaches it (``experiments.calibration``). None: the
    configured efficiency."""
    check_programs: bool = True
    """Hold every distinct component of every plan's programs to the program checker."""
    detect_s: float = 0.0
    """A kill to the coordinator noticing it (a closed connection)."""
    failure_window_s: float = 0.0
    """After the first sign of a failure, how long the coordinator waits for the rest of it."""
    control_s: float = 0.0
    """Per step, the coordinator's round trip around the workers' computation (Ready, Commit, next RunStep), where
    no worker computes."""
    step_cpu_s: float = 0.0
    """Per step, each worker's own work besides its instructions and optimizer step (taking the step, zeroing its
    gradients, reporting), charged with its optimizer step; on a shared host the workers do it at once and share the
    cores for it."""
    layer_overhead_s: float = 0.0
    """*Shared host.* The runtime's own cost per layer of a forward or backward instruction, on top of the profiled
    layer times (autograd's bookkeeping, buffers, dispatch). Per layer, not per instruction: an instruction's excess
    over its profiled layers grows with the layers it runs. A device's profile is the whole cost."""
    message_cpu_s: float = 0.0
    """*Shared host.* The CPU a message between two stages (an activation or a gradient) costs its sender and
    receiver together beyond the link's delay, measured with both workers on one core. Little of it is the transfer:
    it is mostly the passes next to the boundary, which find their working set gone after the wait, and on one core
    the switch between the two processes at every message. Being the passes' cost, it is charged per message up to
    one worker's half per pass of its own (``runtime.sim.shared_host``)."""
    message_cpu_own_core_s: float | None = None
    """*Shared host.* ``message_cpu_s`` where a plan's processes (its workers and their snapshot copies) fit the
    host's cores: measured the same way with each worker on a core of its own, which it keeps while it waits, so no
    switch and no lost working set. None: ``message_cpu_s``."""
    allreduce_cpu_bytes_per_s: float | None = None
    """*Shared host.* The rate a gradient all-reduce costs each member CPU at, bytes of its buffer per CPU second
    whatever the members (``IterationTimer._reduce_cpu_s``). The link's rate is wall time between two processes with
    a core each, its waits included, and would charge the waits as CPU. None: the link's rate."""
    abort_s: float = 0.0
    """Aborting the iteration in flight on every survivor."""
    configure_s: float = 0.0
    """Configuring a plan on a worker that holds its layers, before layers move: its programs, the generation's
    process group, its stage and executor. On a shared host every worker of the plan does it at once, and they
    share the cores (``SimMachine.configuration_s``)."""
    configure_group_s: float = 0.0
    """What each gradient reduce group a worker is in adds to its configuration: the group's own process group and
    its gradient bucket."""
    process_start_s: float = 0.0
    """Starting one worker process until it registers (torch and the runtime imported), on an idle host."""
    node_start_s: float = 0.0
    """A joining node's agent starting, before its workers start."""
    build_bytes_per_s: float = 1.0
    """*Shared host.* Building a layer's weights and optimizer state (a fresh worker's model load), bytes of state per
    second. A device builds on the device, at no cost beyond the bandwidths."""
    codec_bytes_per_s: float = 1.0
    """*Shared host.* Serialising and deserialising a layer's state for a copy or a checkpoint, bytes per second. A
    device's tensors move as they are."""
    storage_write_bytes_per_s: float = 1.0
    """Checkpoint writes, all writers together."""
    storage_read_bytes_per_s: float = 1.0
    """Checkpoint reads, all readers together."""
    snapshot_bytes_per_s: float = 1e9
    """A REFT snapshot's copy into the node's memory (with its checksum), and a record's read back, per worker, bytes
    per second of the copy thread's CPU: what a real run records as ``ft/snapshot_bytes`` over
    ``ft/snapshot_cpu_s`` (``experiments/measure_sim_constants.py``)."""
    snapshot_launch_s: float = 1e-3
    """A snapshot's cost on the training thread before its copy runs beside training: starting the copy thread
    and describing the state to it (``policies/reft/interval.py``'s ``LAUNCH_S``, an estimate, not a measurement)."""
    host_cores: float = 0.0
    """*Shared host.* Cores of the host every worker shares: compute slows down when more workers compute at once
    than there are cores, and processes that start, configure or copy together take longer. 0: the processes do not
    slow each other."""
    host_cores_by_load: list[float] = field(default_factory=list)
    """*Shared host.* Where measured beside a job (``runtime.processes.profiler.cores_by_load``), the cores' worth
    ``k`` processes computing at once get on that host together, entry k - 1 (past the last, each process more gets
    what each of the last entry's got while ``host_cores`` has a core for it: ``shared_host.HostCores.worth``): past
    the cores, switching between processes and their working sets in the shared caches costs more than
    ``host_cores`` says. Measured beside a job, each entry counts the processes against their own rates alone (entry
    0 is 1): how fast each worker computes against its charge is ``host_layer_speed``'s. Empty: min(k, host_cores)."""
    host_layer_speed: list[float] = field(default_factory=list)
    """*Shared host.* Where measured beside a job (``experiments/bench_simulator.py``'s ``measured_host``), one entry a
    layer: how fast a process of this host, computing its stage alone, computes the layer against what the
    simulation charges it (the profile's time and ``layer_overhead_s``): the profile times each layer alone, and a
    stage computed by a process of its own runs at its own speed against that. A worker's forward and backward
    instructions run at its layers' speed, each layer weighted by its charge; communication, copies and the optimizer
    are measured constants of their own. Empty: every layer at 1."""
