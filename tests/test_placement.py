"""backend=auto chooses NCCL only when every worker has a GPU of its own, and says why (CPU-only: counts given)."""

from __future__ import annotations

import pytest

from ftlab.runtime.processes.placement import choose_backend, device_index


@pytest.mark.parametrize(
    ("gpus", "workers_per_node", "shared", "expected"),
    [
        ({0: 0, 1: 0}, 1, True, "gloo"),  # no GPU
        ({0: 4, 1: 4}, 2, True, "nccl"),  # one machine, 4 GPUs for 2 x 2 workers
        ({0: 3, 1: 3}, 2, True, "gloo"),  # one machine, 3 GPUs for 4 workers: two would share one
        ({0: 2, 1: 2}, 2, False, "nccl"),  # two hosts with 2 GPUs each
        ({0: 2, 1: 1}, 2, False, "gloo"),  # one host short of a GPU
    ],
)
def test_auto_chooses_nccl_only_with_a_gpu_per_worker(gpus: dict[int, int], workers_per_node: int, shared: bool, expected: str) -> None:
    backend, why = choose_backend("auto", gpus, workers_per_node, shared)
    assert backend == expected
    assert why.startswith("auto: ")


def test_nccl_without_a_gpu_per_worker_is_refused_with_what_to_change() -> None:
    with pytest.raises(ValueError, match="use cluster.backend=gloo"):
        choose_backend("nccl", {0: 1, 1: 1}, 1, True)
    assert choose_backend("gloo", {0: 8}, 1, False)[0] == "gloo"


def test_device_indices_are_distinct_where_nodes_share_a_machine() -> None:
    shared = {device_index(n, r, 2, True) for n in range(3) for r in range(2)}
    assert shared == set(range(6))
    assert {device_index(n, 1, 2, False) for n in range(3)} == {1}
