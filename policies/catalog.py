"""The policies and protections, found rather than listed.

Every package under ``policies/`` may have a ``config.py`` whose ``SCHEMAS`` maps a group (``policy``,
``protection``) to its settings dataclass: the option of that name (the dataclass's ``name`` default), built as the
class its ``_target_`` names. A policy class says what it can be used for (``Policy.roles``: whether it recovers, in
place, by restarting, as one of adaptive's candidates, by choosing among other policies), and the code that runs
policies side by side selects them by those roles: the soak campaign, ``policy=adaptive``'s candidates, the
benches, the paper-scale simulations; ``make fault-ci`` runs every option of ``conf/policy``. So adding a policy is
adding its package and its ``conf/policy/<name>.yaml`` (``tests/test_policy_discovery.py`` holds it to that).

This module imports no Hydra (policies load without it, ``tests/test_contract.py``): ``_target_`` is resolved here
with importlib, as Hydra's ``get_class`` resolves it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from ftlab import policies
from ftlab.runtime.core.contract import Policy, Protection, Roles

COMPONENT_GROUPS = ("policy", "protection")


def component_schemas() -> dict[str, dict[str, type]]:
    """group -> option name -> settings dataclass, from every ``policies/<package>/config.py``, by option name."""
    found: dict[str, dict[str, type]] = {group: {} for group in COMPONENT_GROUPS}
    for package in pkgutil.iter_modules(policies.__path__):
        if not package.ispkg:
            continue
        try:
            module = importlib.import_module(f"{policies.__name__}.{package.name}.config")
        except ModuleNotFoundError as missing:
            if missing.name != f"{policies.__name__}.{package.name}.config":
                raise
            continue  # a package of shared planning code, not a component
        for group, schema in module.SCHEMAS.items():
            found[group][default_of(schema, "name")] = schema
    # By name, wherever each package lies on the search path: every caller sees one order.
    return {group: dict(sorted(options.items())) for group, options in found.items()}


def default_of(schema: type, setting: str) -> Any:  # noqa: ANN401 - a setting of any type
    """The default value of one setting of a settings dataclass."""
    return next(f.default for f in fields(schema) if f.name == setting)


def component_class(schema: type) -> type:
    """The class a settings dataclass names with its ``_target_``."""
    module, _, name = default_of(schema, "_target_").rpartition(".")
    return getattr(importlib.import_module(module), name)


def policy_classes() -> dict[str, type[Policy]]:
    """Option name -> policy class, for every policy found, by name."""
    return {name: component_class(schema) for name, schema in component_schemas()["policy"].items()}


def protection_classes() -> dict[str, type[Protection]]:
    """Option name -> protection class, for every protection found, by name."""
    return {name: component_class(schema) for name, schema in component_schemas()["protection"].items()}


def roles() -> dict[str, Roles]:
    """Option name -> the roles that policy declares, for every policy found, by name."""
    return {name: cls.roles for name, cls in policy_classes().items()}


def device_memory(policy: str, per_stage_gb: float) -> str:
    """The ``cluster.device_memory_gb`` override of a harness that sizes a device for one stage's state: that much
    for each stage's state ``policy`` keeps on a device (``Roles.state_copies``)."""
    return f"cluster.device_memory_gb={per_stage_gb * roles()[policy].state_copies:g}"


def policies_with(wanted: Callable[[Roles], bool]) -> tuple[str, ...]:
    """The policies whose roles ``wanted`` accepts, by name."""
    return tuple(name for name, declared in roles().items() if wanted(declared))


def settings_of(group: str, name: str) -> frozenset[str]:
    """The names of the settings option ``name`` of ``group`` has (beyond ``_target_`` and ``name``)."""
    return frozenset(f.name for f in fields(component_schemas()[group][name])) - {"_target_", "name"}


def build_default(group: str, name: str) -> Any:  # noqa: ANN401 - a Policy or a Protection
    """Option ``name`` of ``group`` built from its default settings."""
    schema = component_schemas()[group][name]
    return component_class(schema)(schema())
