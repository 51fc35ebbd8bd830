"""A generation's groups are built once all their members have arrived (``runtime.processes.comm._arrive``), on a real
TCPStore: a member that never comes (it died before its rendezvous) ends the wait with Aborted as soon as the
coordinator aborts the generation, or with a CommError after the timeout, never with a crash of the waiting worker."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from ftlab.runtime.core.plan import grid_plan
from ftlab.runtime.processes.comm import Aborted, CommError, GenerationComm

PLAN = grid_plan([0, 1], 1, 4, 2, 1, generation=3)  # two replicas: worker 1 is the member that never comes


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)


def test_a_member_that_never_arrives_is_waited_for_until_the_generation_is_aborted(store: dist.TCPStore) -> None:
    aborted = threading.Event()
    threading.Timer(0.5, aborted.set).start()
    with pytest.raises(Aborted):
        GenerationComm(store, PLAN, 0, timeout_s=60, abort_requested=aborted.is_set)


def test_a_member_that_never_arrives_is_a_comm_error_after_the_timeout(store: dist.TCPStore) -> None:
    with pytest.raises(CommError, match="gen3/world did not all arrive"):
        GenerationComm(store, PLAN, 0, timeout_s=1)

