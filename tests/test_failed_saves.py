"""A checkpoint that storage refuses is abandoned on every worker, and training goes on; a folder too small is refused.

The storage is real: a tmpfs of 60 MiB mounted for the test (one checkpoint of gpt2-tiny is about 38 MiB), so the
second checkpoint meets ENOSPC in the workers' own writes. REFT's snapshots get the same: the job's node memories
live on a 16 MiB tmpfs instead of /dev/shm, too small for their records. Mounting needs root (CAP_SYS_ADMIN);
elsewhere these tests skip themselves and say why.
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
from ftlab.runtime.state import checkpoint, shm
from tests.oracle import LOSS_RTOL, committed_losses
from tests.support import run_apart

STEPS = 6
JOB = ["experiment=plain", "protection=storage", "protection.every=2", f"train.steps={STEPS}"]


def mounted(folder: Path, size: str) -> Iterator[Path]:
    """``folder`` as a tmpfs of ``size`` of its own, unmounted afterwards."""
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    yield from mounted(tmp_path / "disk", "60m")


@pytest.fixture
def small_host_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The root of the job's node memories (``shm.ROOT``, else /dev/shm) on 16 MiB: the coordinator names each
    agent's folder under it."""
    for memory in mounted(tmp_path / "memory", "16m"):
        monkeypatch.setattr(shm, "ROOT", memory)
        yield memory


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> JobResult:
    return run_apart(tmp_path_factory, token_cache, *JOB)


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


REFT = [*JOB[:1], "protection=reft", "protection.interval=1", "protection.flush_every=100", f"train.steps={STEPS}"]


def test_host_memory_without_room_for_reft_snapshots_is_refused_with_the_sizes(run, small_host_memory: Path) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError) as info:
        run(*REFT)
    assert f"{small_host_memory} has 16.0 MiB free, but the snapshot records of the 4 nodes on this machine take" \
        in str(info.value)  # fmt: skip
    assert "protection.allow_low_space=true" in str(info.value)


def test_full_host_memory_abandons_reft_snapshots_and_training_goes_on(
    run, small_host_memory: Path, fault_free: JobResult  # noqa: ANN001
) -> None:
    result = run(*REFT, "protection.allow_low_space=true", "protection.max_failed_saves=100")
    failed = [e for e in result.events if isinstance(e, ev.SaveFailed)]
    assert sorted({e.step for e in failed})[:5] == [1, 2, 3, 4, 5]
    assert all(e.location == "memory" and "No space left on device" in e.reason for e in failed)
    assert not [e for e in result.events if isinstance(e, ev.SnapshotTaken)]
    assert committed_losses(result, STEPS) == pytest.approx(committed_losses(fault_free, STEPS), rel=LOSS_RTOL)


def test_reft_snapshots_refused_in_a_row_stop_the_job_with_the_memory_needed(run, small_host_memory: Path) -> None:  # noqa: ANN001
    with pytest.raises(JobStopped, match="2 snapshots in a row could not be copied into host memory") as info:
        run(*REFT, "protection.allow_low_space=true", "protection.max_failed_saves=2")
    assert "free that much memory under /dev/shm on every node" in str(info.value)


def test_a_refused_write_leaves_no_file_whether_the_disk_is_full_or_read_only(tmp_path: Path) -> None:
    """``atomic_write`` on a real 1 MiB filesystem: ENOSPC when it is full, EROFS once it is remounted read-only;
    neither leaves its temporary file behind, and ``abandon`` removes what a save wrote before."""
    for disk in mounted(tmp_path / "tiny", "1m"):
        kept = checkpoint.layer_path(checkpoint.step_dir(disk, 2), 0)
        checkpoint.atomic_write(kept, b"x" * 1000)
        with pytest.raises(OSError, match="No space left on device"):
            checkpoint.atomic_write(checkpoint.layer_path(checkpoint.step_dir(disk, 4), 0), b"x" * 2**21)
        checkpoint.abandon(disk, 4)
        assert files_under(disk) == ["step-000002/layer-0000.pt"]
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        with pytest.raises(OSError, match="Read-only file system"):
            checkpoint.atomic_write(kept, b"y" * 1000)
        assert kept.read_bytes() == b"x" * 1000 and files_under(disk) == ["step-000002/layer-0000.pt"]
