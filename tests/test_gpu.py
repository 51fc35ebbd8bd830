"""The NCCL path on a GPU machine (``make gpu-test``; skipped without CUDA, so CI skips it).

With one GPU a job can give a GPU of its own to one worker only: the test runs a single-node, single-stage job on
NCCL (its worker on cuda:0, with set_device) and compares its per-step losses with the same job on the CPU. With two
or more GPUs it also runs a two-stage pipeline over two nodes, so activations and gradients cross NCCL. The
tolerance is looser than the CPU oracle's (rel 1e-4, not 1e-5): cuBLAS and the CPU sum in different orders.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here: the NCCL path needs a GPU"),
]

STEPS = 4
LOSS_RTOL = 1e-4


def losses(result) -> list[float]:  # noqa: ANN001 - a JobResult
    by_step = {r.step: r.loss for r in result.steps}
    return [by_step[s] for s in range(STEPS)]


def test_one_worker_on_its_gpu_trains_like_the_cpu(run) -> None:  # noqa: ANN001
    common = ["cluster.nodes=1", "train.stages=1", f"train.steps={STEPS}"]
    cpu = run(*common, "cluster.backend=gloo")
    gpu = run(*common, "cluster.backend=nccl")
    assert losses(gpu) == pytest.approx(losses(cpu), rel=LOSS_RTOL)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a two-stage pipeline on NCCL needs two GPUs")
def test_a_pipeline_across_two_gpus_trains_like_the_cpu(run) -> None:  # noqa: ANN001
    common = ["cluster.nodes=2", "train.stages=2", f"train.steps={STEPS}"]
    cpu = run(*common, "cluster.backend=gloo")
    gpu = run(*common, "cluster.backend=nccl")
    assert losses(gpu) == pytest.approx(losses(cpu), rel=LOSS_RTOL)
