"""Checkpoints on storage: one file per layer (parameters + optimizer state), committed by a manifest.

A checkpoint directory ``step-NNNNNN`` counts only once its ``manifest.json`` exists; every file, the manifest
included, is written to a temporary name, fsynced and renamed, so a kill at any moment leaves either the previous
complete checkpoint or the new complete one, never a torn one. What a layer file holds is ``runtime.training.layer_state``'s;
this module handles only files and manifests, so the coordinator and the policies use it without torch.

A write that fails (a full disk, an I/O error, a folder that became read-only) removes its temporary file and raises;
the save it belonged to is then abandoned whole (``abandon``): a failed save leaves no bytes behind, and the previous
checkpoint stays the newest.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def layer_path(directory: Path, layer: int) -> Path:
    return directory / f"layer-{layer:04d}.pt"


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # a folder that became read-only keeps it: the write's error is the news
            tmp.unlink(missing_ok=True)  # a partial file would hold the space the next save needs
        raise


def write_error(exc: OSError, path: Path) -> str:
    """A failed write as a line: what the system said and where."""
    return f"{exc.strerror or exc} writing {path}"


def abandon(root: str | Path, step: int) -> None:
    """Remove everything a failed save of ``step`` wrote (called once every writer has stopped)."""
    shutil.rmtree(step_dir(root, step), ignore_errors=True)


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds ``path`` (or would: its nearest existing folder)."""
    folder = Path(path).absolute()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def write_manifest(root: str | Path, step: int, num_layers: int, extra: dict[str, Any]) -> Path:
    directory = step_dir(root, step)
    missing = [i for i in range(num_layers) if not layer_path(directory, i).exists()]
    if missing:
        raise RuntimeError(f"checkpoint of step {step} lacks layers {missing}; not committing it")
    atomic_write(directory / MANIFEST, json.dumps({"step": step, "num_layers": num_layers, **extra}).encode())
    return directory


def latest(root: str | Path) -> tuple[int, Path] | None:
    """The newest committed checkpoint, ignoring any directory a kill left without its manifest."""
    root = Path(root)
    if not root.is_dir():
        return None
    committed = sorted(
        (json.loads((d / MANIFEST).read_text())["step"], d) for d in root.glob("step-*") if (d / MANIFEST).exists()
    )
    return committed[-1] if committed else None


def find(path: str | Path) -> tuple[int, Path, int] | None:
    """(step, directory, number of layers) of a committed checkpoint directory, or of the newest one under ``path``."""
    path = Path(path)
    if (path / MANIFEST).exists():
        manifest = json.loads((path / MANIFEST).read_text())
        return manifest["step"], path, manifest["num_layers"]
    newest = latest(path)
    if newest is None:
        return None
    return newest[0], newest[1], json.loads((newest[1] / MANIFEST).read_text())["num_layers"]


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` committed checkpoints, and torn ones older than the newest."""
    newest = latest(root)
    if newest is None:
        return
    directories = sorted(Path(root).glob("step-*"))
    committed = [d for d in directories if (d / MANIFEST).exists()]
    for d in directories:
        if d in committed[-keep:] or d.name > newest[1].name:
            continue
        shutil.rmtree(d, ignore_errors=True)
