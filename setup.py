"""Packaging: the project's top-level folders install as subpackages of the one name ``ftlab``.

The folders stay where the project's layout puts them (runtime/, policies/, ...); the mapping below installs
``runtime/`` as ``ftlab.runtime`` and so on, so installing ftlab adds a single top-level name. The package list is
found here rather than written down in pyproject.toml, so a new policy package needs no packaging change.
"""

from setuptools import find_packages, setup

FOLDERS = ("runtime", "policies", "faults", "experiments", "conf")

setup(
    packages=[f"ftlab.{name}" for name in find_packages(include=[f"{folder}*" for folder in FOLDERS])],
    package_dir={"ftlab": "."},
)
