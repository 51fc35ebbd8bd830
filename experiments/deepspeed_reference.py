"""The reference side of ``experiments.bench_runtime``: DeepSpeed's own ``PipelineEngine`` on ftlab's model and data.

Same layers (``runtime.training.model.build_layer``, so the same initial weights), same split (DeepSpeed's "uniform"
partition equals ``runtime.core.plan.even_split``; checked), same micro-batches (``runtime.training.data.Batches``: data-parallel
rank r feeds micro-batches r, r + DP, ... of each step, as ftlab's ``grid_plan`` deals them), same optimizer
(fused ``torch.optim.AdamW``, same betas / weight decay) and the same learning rate schedule
(``runtime.training.optim.lr_at``, written into the optimizer before every step), one thread per process, gloo on CPU.

The one adaptation: ftlab's head layer takes (hidden, labels) and returns the loss; a ``PipelineModule`` layer gets
only the previous layer's output and DeepSpeed calls ``loss_fn(outputs, labels)``. So the last layer here returns
the head's logits (its norm and vocabulary projection) and ``loss_fn`` is the head's own mean cross-entropy: the same
operations on the same parameters.

In bf16 (``ReferenceJob.precision``) the two sides round differently, so their losses agree to bf16's precision, not
bit for bit. DeepSpeed runs on its CPU accelerator (which reports bf16 as supported) the way it runs on a GPU: the
engine casts every parameter of the module to bf16, so the whole forward and backward compute on bf16 parameters
(the loss's cross-entropy on bf16 logits included, so the loss is a bf16 number), and its ``BF16_Optimizer`` keeps
the fp32 master weights and the AdamW moments, sharded across the data-parallel replicas, then copies the updated
weights back into the bf16 parameters and all-gathers them. ftlab keeps fp32 weights and computes under
``torch.autocast``: matmuls take bf16 copies of the weights, the norms use their fp32 weights on bf16 inputs, every
layer's output leaves in bf16 (``runtime.training.mixed``), and the ops autocast keeps in fp32, the loss's
cross-entropy among them, compute in fp32. The reductions are paired alike: DeepSpeed accumulates the
micro-batches' gradients in fp32 (``data_types.grad_accum_dtype``, which its pipeline engine accepts only with ZeRO
stage 1, the sharding its ``BF16_Optimizer`` does anyway) and all-reduces them in fp32 (``communication_data_type``;
its bf16 default would halve the bytes ftlab's fp32 all-reduce sends).

The processes are started here with RANK / WORLD_SIZE / MASTER_* in their environment (not the DeepSpeed launcher);
rank 0 times ``engine.train_batch()`` and writes the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ftlab.runtime.processes.agent import die_with_parent

REPO = Path(__file__).resolve().parents[1]
_MASTER_ADDR = "127.0.0.1"


@dataclass
class ReferenceJob:
    model: str
    global_batch: int
    micro_batch: int
    stages: int
    world: int
    steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    beta1: float
    beta2: float
    seed: int
    tokens_path: str
    result_path: str
    threads: int = 1
    precision: str = "fp32"  # fp32 or bf16 (DeepSpeed's bf16: bf16 parameters, fp32 master weights)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((_MASTER_ADDR, 0))
        return s.getsockname()[1]


def _log_path(job: ReferenceJob, rank: int) -> Path:
    return Path(job.result_path).with_suffix(f".rank{rank}.log")


def run_reference(job: ReferenceJob, timeout_s: float = 900.0) -> dict:
    """Start ``job.world`` processes, wait for them, return rank 0's result (per-step times and losses)."""
    spec = Path(job.result_path).with_suffix(".job.json")
    spec.write_text(json.dumps(asdict(job)))
    port = _free_port()
    procs = []
    for rank in range(job.world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(job.world),
            "LOCAL_RANK": str(rank),
            "LOCAL_SIZE": str(job.world),
            "MASTER_ADDR": _MASTER_ADDR,
            "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu",
            "PYTHONUNBUFFERED": "1",
        }
        command = [sys.executable, "-m", "experiments.deepspeed_reference", str(spec)]
        log = open(_log_path(job, rank), "wb")  # DeepSpeed is chatty: keep its output out of the report
        # preexec_fn: the ranks die with this process, as ftlab's workers die with their agent.
        proc = subprocess.Popen(
            command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
        procs.append(proc)
        log.close()
    deadline = time.monotonic() + timeout_s
    try:
        for rank, proc in enumerate(procs):
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                tail = _log_path(job, rank).read_text(errors="replace")[-4000:]
                raise RuntimeError(f"DeepSpeed reference rank {rank} exited with code {code}; its output ends:\n{tail}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        _remove_shared_buffers(port)
    return json.loads(Path(job.result_path).read_text())


def _remove_shared_buffers(port: int) -> None:
    """DeepSpeed's CPU communication op leaves one 66 MB shared-memory buffer per rank in /dev/shm, named after the
    master address and port, and never removes it: without this, every reference run keeps 264 MB of RAM."""
    for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{_MASTER_ADDR}_{port}_*"):
        buffer.unlink(missing_ok=True)


# -- inside one rank -----------------------------------------------------------------------------------------------


def _worker(job: ReferenceJob) -> None:
    import torch
    from torch import nn

    torch.set_num_threads(job.threads)  # as ftlab's workers do (cluster.threads_per_worker)

    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    from ftlab.runtime.training.data import Batches, load_tokens
    from ftlab.runtime.training.model import build_layer
    from ftlab.runtime.core.model_spec import load_model_config, num_layers
    from ftlab.runtime.training.optim import OptimSettings, lr_at
    from ftlab.runtime.core.plan import even_split

    model = load_model_config(job.model)
    n_layers = num_layers(model)

    class Layer(nn.Module):
        """ftlab's layer ``index``, built lazily on the rank that holds it (LayerSpec needs an nn.Module type)."""

        def __init__(self, index: int) -> None:
            super().__init__()
            self.inner = build_layer(model, index, job.seed)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    class HeadLogits(nn.Module):
        """ftlab's head without its loss: norm, then the vocabulary projection (the loss is ``loss_fn`` below)."""

        def __init__(self, index: int) -> None:
            super().__init__()
            self.inner = build_layer(model, index, job.seed)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner.lm_head(self.inner.norm(x))

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # runtime.training.model_families.Head.forward's loss, verbatim.
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])

    specs = [LayerSpec(Layer, i) for i in range(n_layers - 1)] + [LayerSpec(HeadLogits, n_layers - 1)]
    module = PipelineModule(layers=specs, num_stages=job.stages, loss_fn=loss_fn, partition_method="uniform")
    bounds = [b for b, _ in even_split(n_layers, job.stages)] + [n_layers]
    if list(module.parts) != bounds:
        raise RuntimeError(f"DeepSpeed split the layers as {module.parts}, ftlab as {bounds}")

    config = deepspeed_config(job)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config)
    settings = OptimSettings(job.lr, job.min_lr, job.warmup_steps, job.steps, job.weight_decay, job.beta1, job.beta2)

    batches = Batches(load_tokens(Path(job.tokens_path)), model.seq_len, job.global_batch, job.micro_batch, job.seed)
    dp, dp_id = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_id()
    mine = range(dp_id, batches.num_microbatches, dp)  # ftlab's grid_plan deals micro-batches the same way

    def data(step: int):
        # Lazy, so loading a micro-batch is inside the timed step as in ftlab's LoadMicroBatch.
        return (tuple(map(torch.from_numpy, batches.microbatch(step, m))) for m in mine)

    times, ends, losses = [], [], []
    for step in range(job.steps):
        lr = lr_at(step, settings)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        started = time.perf_counter()
        loss = engine.train_batch(data_iter=data(step))
        ends.append(time.perf_counter())
        times.append(ends[-1] - started)
        losses.append(float(loss))  # the global-batch mean, broadcast from the last stage to every rank
    if rank == 0:
        result = {"iter_s": times, "end_s": ends, "loss": losses, "parts": list(module.parts)}
        Path(job.result_path).write_text(json.dumps(result))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def deepspeed_config(job: ReferenceJob) -> dict:
    """DeepSpeed's configuration for ``job``: ftlab's batch and optimizer, in fp32 or in DeepSpeed's bf16."""
    if job.precision not in ("fp32", "bf16"):
        raise ValueError(f"the DeepSpeed reference runs fp32 or bf16, not {job.precision}")
    bf16 = job.precision == "bf16"
    dp = job.world // job.stages
    config = {
        "train_batch_size": job.global_batch,
        "train_micro_batch_size_per_gpu": job.micro_batch,
        "gradient_accumulation_steps": job.global_batch // (job.micro_batch * dp),
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": job.lr,
                "betas": [job.beta1, job.beta2],
                "eps": 1e-8,
                "weight_decay": job.weight_decay,
                "torch_adam": True,  # torch.optim.AdamW (DeepSpeed's FusedAdam is a GPU kernel)
                "fused": True,  # the fused kernel, as runtime.training.optim.layer_optimizer uses
            },
        },
        # bf16: stage 1 is what lets the pipeline engine accumulate gradients in fp32 (the module docstring)
        "zero_optimization": {"stage": 1 if bf16 else 0},
        "fp16": {"enabled": False},
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        config["data_types"] = {"grad_accum_dtype": "fp32"}  # as ftlab's fp32 gradients sum the micro-batches
        config["communication_data_type"] = "fp32"  # as ftlab's data-parallel all-reduce
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description="one rank of the DeepSpeed reference (started by run_reference)")
    parser.add_argument("job", help="the ReferenceJob as a JSON file")
    args = parser.parse_args()
    _worker(ReferenceJob(**json.loads(Path(args.job).read_text())))


if __name__ == "__main__":
    main()
