"""Installing ftlab adds one top-level name, ``ftlab``, with its configs, data and traces inside."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_wheel_holds_only_the_ftlab_package_with_its_data(tmp_path: Path) -> None:
    # Built from a copy: a setuptools build writes build/ and *.egg-info into the tree it builds.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", ".ftlab", "__pycache__", "*.db"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("ftlab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"ftlab", wheel.name.split("-py3")[0] + ".dist-info"}
    top_level = next(n for n in names if n.endswith("top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["ftlab"]
    for needed in ("ftlab/runtime/processes/worker.py", "ftlab/policies/oobleck/policy.py", "ftlab/conf/config.yaml",
                   "ftlab/conf/protection/storage.yaml", "ftlab/runtime/training/datasets/wikitext-2-valid.txt.gz",
                   "ftlab/faults/traces/p3-trace.csv"):  # fmt: skip
        assert needed in names
