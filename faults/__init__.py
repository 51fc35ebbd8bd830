"""Fault schedules: what fails, to whom, and when (see schedules.py), and the bundled node-availability traces."""

from ftlab.faults.schedules import (
    FAULT_KINDS,
    PHASES,
    SCHEDULES,
    ClusterShape,
    FaultConfigError,
    FaultEvent,
    FaultEventConfig,
    FaultKind,
    FaultsConfig,
    build_schedule,
    faults_config_from_dict,
)
from ftlab.faults.trace import BUNDLED_TRACES, TraceError, TraceRecord, read_trace

__all__ = [
    "BUNDLED_TRACES",
    "FAULT_KINDS",
    "PHASES",
    "SCHEDULES",
    "ClusterShape",
    "FaultConfigError",
    "FaultEvent",
    "FaultEventConfig",
    "FaultKind",
    "FaultsConfig",
    "TraceError",
    "TraceRecord",
    "build_schedule",
    "faults_config_from_dict",
    "read_trace",
]
