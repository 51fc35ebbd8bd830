"""The project's oracle of correctness: every layout of the same global batch trains the same model.

Five steps of gpt2-tiny on one process, on a 2 x 2 grid (with and without ZeRO-1's optimizer sharding and activation
checkpointing together), and on a
heterogeneous plan (a 3-stage and a 2-stage pipeline with unequal micro-batch counts) give the same loss at every
step and the same final parameters and optimizer state. Differences come only from the order of floating-point sums, so the tolerances are those of
float32 accumulation over a few steps: losses to 1e-5 relative, parameters to 2e-5 absolute.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftlab.runtime.state import checkpoint
from ftlab.runtime.training.layer_state import decode
from ftlab.experiments.job import JobResult

STEPS = 5
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-5


def final_state(result: JobResult) -> dict[int, dict]:
    latest = checkpoint.latest(result.checkpoint_dir)
    assert latest is not None and latest[0] == STEPS, f"no checkpoint of step {STEPS} in {result.checkpoint_dir}"
    directory: Path = latest[1]
    return {
        int(path.stem.split("-")[1]): decode(path.read_bytes())["module"]
        for path in sorted(directory.glob("layer-*.pt"))
    }


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> dict[str, JobResult]:
    from ftlab.experiments.job import compose_config, run_job

    base_dir = tmp_path_factory.mktemp("equivalence")
    common = [
        "experiment=plain",
        f"tracking.uri=sqlite:///{base_dir}/mlflow.db",
        f"train.cache_dir={token_cache}",
        f"train.checkpoint_dir={base_dir}/checkpoints",
        "progress=false",
        f"train.steps={STEPS}",
        "protection=storage", f"protection.every={STEPS}",
    ]
    runs = {
        "single": ["cluster.nodes=1", "train.stages=1"],
        "grid-2x2": ["cluster=local-4", "train.stages=2"],
        "grid-2x2-zero1-checkpointed": ["cluster=local-4", "train.stages=2", "train.zero=1",
                                        "train.activation_checkpointing=true"],
        "heterogeneous-3+2": ["cluster.nodes=5", "policy._target_=tests.support.HeterogeneousLayout"],
    }
    return {name: run_job(compose_config(common + extra)) for name, extra in runs.items()}


def test_the_layouts_are_what_they_claim(layouts: dict[str, JobResult]) -> None:
    shapes = {name: [len(p.stages) for p in r.plans[0].pipelines] for name, r in layouts.items()}
    assert shapes == {"single": [1], "grid-2x2": [2, 2], "grid-2x2-zero1-checkpointed": [2, 2], "heterogeneous-3+2": [3, 2]}
    hetero = layouts["heterogeneous-3+2"].plans[0]
    assert [len(p.microbatches) for p in hetero.pipelines] == [5, 3]


@pytest.mark.parametrize("layout", ["grid-2x2", "grid-2x2-zero1-checkpointed", "heterogeneous-3+2"])
def test_losses_match_one_process_at_every_step(layouts: dict[str, JobResult], layout: str) -> None:
    reference = [s.loss for s in layouts["single"].steps]
    losses = [s.loss for s in layouts[layout].steps]
    assert len(losses) == STEPS
    assert losses == pytest.approx(reference, rel=LOSS_RTOL)
    assert reference[-1] < reference[0], "training should lower the loss"


@pytest.mark.parametrize("layout", ["grid-2x2", "grid-2x2-zero1-checkpointed", "heterogeneous-3+2"])
def test_final_parameters_match_one_process(layouts: dict[str, JobResult], layout: str) -> None:
    reference = final_state(layouts["single"])
    state = final_state(layouts[layout])
    assert sorted(state) == sorted(reference)
    for index, params in reference.items():
        for name, value in params.items():
            torch.testing.assert_close(state[index][name], value, rtol=0, atol=PARAM_ATOL, msg=f"layer {index} {name}")
