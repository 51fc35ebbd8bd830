"""GPU types as the papers ran them: the peak follows the precision, a node's network is shared by its GPUs, and the
fraction of peak reached is the cluster's ``device_efficiency``."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from ftlab.experiments.job import check_job, compose_config, job_profile
from ftlab.runtime.core.config import ClusterConfig
from ftlab.runtime.core.contract import ConfigError
from ftlab.runtime.core.costs import CostModel, weight_copy_bytes
from ftlab.runtime.core.devices import GBIT_S, TFLOPS, node_spec
from ftlab.runtime.core.model_spec import load_model_config
from ftlab.runtime.core.precision import activation_scale
from ftlab.runtime.processes.profiler import analytic_profile
from ftlab.runtime.training.mixed import autocast

MODEL = load_model_config("gpt3-medium")


def profile(precision: str, **cluster: object) -> CostModel:
    node = node_spec(ClusterConfig(**{"device": "A40", **cluster}))
    return CostModel(analytic_profile(MODEL, node, 2, MODEL.seq_len, precision))


def test_tf32_moves_fp32_bytes_at_the_tf32_peak() -> None:
    assert activation_scale("tf32") == 1 and weight_copy_bytes(1e6, "tf32") == 0
    tf32, fp32 = profile("tf32"), profile("fp32")
    assert node_spec(ClusterConfig(device="A40")).flops("tf32") == pytest.approx(74.8 * TFLOPS * 0.45)
    assert tf32.stage_memory(1, 5, 3) == fp32.stage_memory(1, 5, 3)
    assert tf32.boundary_bytes(3) == fp32.boundary_bytes(3)
    assert fp32.forward_s(1, 2) == pytest.approx(2 * tf32.forward_s(1, 2))  # a block: 37.4 against 74.8 TFLOP/s


def test_compute_times_divide_by_the_device_efficiency() -> None:
    assert profile("bf16", device_efficiency=0.25).forward_s(1, 2) == pytest.approx(
        2 * profile("bf16", device_efficiency=0.5).forward_s(1, 2)
    )


def test_a_nodes_network_is_shared_by_its_gpus(job_overrides: list[str]) -> None:
    cfg = OmegaConf.to_object(compose_config([*job_overrides, "cluster=azure-a100-4x8", "model=gpt3-medium"]))
    costs = CostModel(job_profile(cfg)[0])
    assert costs.node_network_bytes_per_s == 640 * GBIT_S
    assert costs.profile.p2p_bytes_per_s == costs.profile.inter_node_allreduce_bytes_per_s == 640 * GBIT_S / 8
    assert costs.profile.intra_node_allreduce_bytes_per_s == 2400 * GBIT_S
    # Unstated, a node has the device's reference server's network: one 200 Gb/s port per A100.
    default = node_spec(ClusterConfig(device="A100-80GB", workers_per_node=8))
    assert default.network_bytes_per_s == 8 * 200 * GBIT_S and default.gpu_network_bytes_per_s == 200 * GBIT_S


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster=v100-128x4", "train.precision=tf32"], "V100-16GB does not compute tf32; use train.precision=fp32 or fp16"),
        (["cluster=a40-30x1", "cluster.device_efficiency=0"], "cluster.device_efficiency=0"),
        (["cluster=a40-30x1", "cluster.device_efficiency=1.5"], "cluster.device_efficiency=1.5"),
        (["cluster=a40-30x1", "cluster.node_network_gbps=0"], "cluster.node_network_gbps=0"),
    ],
)  # fmt: skip
def test_settings_no_device_has_are_refused(job_overrides: list[str], overrides: list[str], message: str) -> None:
    cfg = OmegaConf.to_object(compose_config([*job_overrides, "model=gpt3-medium", "mode=plan", *overrides]))
    with pytest.raises(ConfigError, match=message):
        check_job(cfg)


def test_tf32_on_a_cpu_computes_as_fp32() -> None:
    with autocast("tf32", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
