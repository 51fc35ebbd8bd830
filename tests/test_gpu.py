"""The NCCL path on a GPU machine (``make gpu-test``; skipped without CUDA, so CI skips it).

With one GPU a job can give a GPU of its own to one worker only: the test runs a single-node, single-stage job on
NCCL (its worker on cuda:0, with set_device) and compares its per-step losses with the same job on the CPU. With two
or more GPUs it also runs a two-stage pipeline over two nodes, so activations and gradients cross NCCL. Each runs in
fp32, in tf32 (TF32 matmuls on the GPU, fp32 on the CPU) and in bf16 with global gradient clipping (the norms travel
in Ready, the clip factor in Commit, as on the CPU).

Tolerances: fp32's is looser than the CPU oracle's (rel 1e-4, not 1e-5): cuBLAS and the CPU sum in different
orders. bf16's is looser again (rel 2e-3): a bf16 value has 8 bits of mantissa, so a product that lands on the other
side of a rounding step moves by 2**-8, and the two autocasts do not cast the same ops (CUDA's keeps layer_norm and
softmax in fp32, the CPU's runs them in bf16). On the CPU the bf16 losses of these first steps stay within about
1e-5 of fp32's (near ln(vocabulary) the loss moves little), so 2e-3 still catches a wrong scale, a lost clip or a
stage boundary received in the wrong dtype, each of which moves the loss by far more. tf32's is bf16's: its matmuls
round their inputs to 11 bits of mantissa, more than bf16's 8 and far fewer than fp32's 24.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here: the NCCL path needs a GPU"),
]

STEPS = 4
PRECISIONS = {
    "fp32": ([], 1e-4),
    "tf32": (["train.precision=tf32"], 2e-3),
    "bf16-clipped": (["train.precision=bf16", "train.grad_clip=1.0"], 2e-3),
}


def losses(result) -> list[float]:  # noqa: ANN001 - a JobResult
    by_step = {r.step: r.loss for r in result.steps}
    return [by_step[s] for s in range(STEPS)]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_worker_on_its_gpu_trains_like_the_cpu(run, precision: str) -> None:  # noqa: ANN001
    numerics, rtol = PRECISIONS[precision]
    common = ["cluster.nodes=1", "train.stages=1", f"train.steps={STEPS}", *numerics]
    cpu = run(*common, "cluster.backend=gloo")
    gpu = run(*common, "cluster.backend=nccl")
    assert losses(gpu) == pytest.approx(losses(cpu), rel=rtol)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a two-stage pipeline on NCCL needs two GPUs")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_pipeline_across_two_gpus_trains_like_the_cpu(run, precision: str) -> None:  # noqa: ANN001
    numerics, rtol = PRECISIONS[precision]
    common = ["cluster.nodes=2", "train.stages=2", f"train.steps={STEPS}", *numerics]
    cpu = run(*common, "cluster.backend=gloo")
    gpu = run(*common, "cluster.backend=nccl")
    assert losses(gpu) == pytest.approx(losses(cpu), rel=rtol)
