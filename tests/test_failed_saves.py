"""A checkpoint that storage refuses is abandoned on every worker, and training goes on; a folder too small is refused.

The storage is real: a tmpfs of 60 MiB mounted for the test (one checkpoint of gpt2-tiny is about 38 MiB), so the
second checkpoint meets ENOSPC in the workers' own writes. Mounting needs root (CAP_SYS_ADMIN); elsewhere these tests
skip themselves and say why.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftlab.experiments.job import JobResult
from ftlab.runtime.control import events as ev
from ftlab.runtime.control.coordinator import JobStopped
from ftlab.runtime.core.contract import ConfigError
from ftlab.runtime.state import checkpoint
from tests.oracle import LOSS_RTOL, committed_losses

STEPS = 6
JOB = ["experiment=plain", "protection=storage", "protection.every=2", f"train.steps={STEPS}"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 60 MiB filesystem of its own, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=60m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> JobResult:
    from ftlab.experiments.job import compose_config, run_job

    d = tmp_path_factory.mktemp("fault-free")
    return run_job(compose_config([f"tracking.uri=sqlite:///{d}/mlflow.db", f"train.cache_dir={token_cache}",
                                   f"train.checkpoint_dir={d}", "progress=false", *JOB]))  # fmt: skip


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_a_full_disk_abandons_the_save_and_training_goes_on(
    run, small_disk: Path, fault_free: JobResult, tmp_path: Path, capsys: pytest.CaptureFixture[str]  # noqa: ANN001
) -> None:
    result = run(*JOB, f"train.checkpoint_dir={small_disk}", "protection.allow_low_space=true", "progress=true")
    failed = [e for e in result.events if isinstance(e, ev.SaveFailed)]
    assert [e.step for e in failed] == [4, 6]
    assert all("No space left on device" in e.reason for e in failed)
    assert committed_losses(result, STEPS) == pytest.approx(committed_losses(fault_free, STEPS), rel=LOSS_RTOL)
    # Nothing of the failed saves is left: the checkpoint of step 2 is the newest and the only files on the disk.
    run_dir = Path(result.checkpoint_dir)
    layers = [f"step-000002/layer-{i:04d}.pt" for i in range(8)]
    assert files_under(run_dir) == sorted([*layers, "step-000002/manifest.json"])
    assert checkpoint.latest(run_dir)[0] == 2
    assert checkpoint.free_bytes(small_disk) > 20 * 2**20  # the partial second checkpoint's space came back
    # Recorded: an event with its reason, a metric at each failed step, a warning on the progress line.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_run(result.run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(result.run_id, "ft/save_failed")] == [4, 6]
    events = Path(client.download_artifacts(result.run_id, "events.jsonl", str(tmp_path))).read_text().splitlines()
    logged = [json.loads(line) for line in events if '"save_failed"' in line]
    assert [e["step"] for e in logged] == [4, 6] and "No space left on device" in logged[0]["reason"]
    assert "warning: the checkpoint of step 4 was not saved: No space left on device" in capsys.readouterr().err


def test_failed_saves_in_a_row_stop_the_job_with_the_space_needed_and_where_to_resume(
    run, small_disk: Path, fault_free: JobResult, tmp_path: Path  # noqa: ANN001
) -> None:
    with pytest.raises(JobStopped) as info:
        run(*JOB, f"train.checkpoint_dir={small_disk}", "protection.allow_low_space=true",
            "protection.max_failed_saves=2")  # fmt: skip
    message = str(info.value)
    assert "2 checkpoints in a row could not be written (steps 4, 6" in message
    assert "The next one needs 37.7 MiB" in message and "113.1 MiB with the 2 kept beside it" in message
    resume_from = message.split("resume with train.resume_from=")[1].strip()
    assert resume_from.endswith("step-000002")
    resumed = run(*JOB, f"train.resume_from={resume_from}", f"train.checkpoint_dir={tmp_path}/roomy")
    assert [r.step for r in resumed.steps] == list(range(2, STEPS))
    assert [r.loss for r in resumed.steps] == pytest.approx(committed_losses(fault_free, STEPS)[2:], rel=LOSS_RTOL)


def test_a_checkpoint_folder_without_room_for_keep_plus_one_is_refused_with_the_sizes(run, small_disk: Path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError) as info:
        run(*JOB, f"train.checkpoint_dir={small_disk}")
    message = str(info.value)
    assert f"train.checkpoint_dir={small_disk} has 60.0 MiB free" in message
    assert "keeps 2 checkpoints of gpt2-tiny (37.7 MiB each)" in message and "113.1 MiB" in message
    assert "protection.allow_low_space=true" in message
    assert files_under(small_disk) == []
