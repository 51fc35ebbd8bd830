"""The control plane admits only peers that prove the job's secret, unpickles nothing from any other, and the secret
never shows in a process's arguments or in the run's MLflow params."""

from __future__ import annotations

import pickle
import socket
import struct
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import mlflow
import pytest

from ftlab.runtime.processes import messages as msg
from ftlab.runtime.processes.cluster import LocalCluster

SECRET = "ab" * 32


class Creates:
    """A pickle whose loading creates a file: proof that something was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return open, (str(self.path), "w")


@pytest.fixture
def server() -> Iterator[tuple[msg.ControlServer, list[Connection]]]:
    admitted: list[Connection] = []
    server = msg.ControlServer("127.0.0.1", 0, SECRET, admitted.append)
    yield server, admitted
    server.close()


def wait_until(condition, timeout_s: float = 20.0) -> bool:  # noqa: ANN001 - a predicate
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def closed_by_peer(sock: socket.socket) -> bool:
    """Read until the server closes the connection (it must, having read nothing it would unpickle)."""
    sock.settimeout(30)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_pickle_from_a_peer_without_the_secret_is_never_loaded(server, tmp_path: Path) -> None:
    control, admitted = server
    created = tmp_path / "unpickled"
    payload = pickle.dumps(Creates(created))
    with socket.create_connection(control.address) as sock:
        # Framed as multiprocessing.connection would frame it, sent before and instead of the handshake's answer.
        sock.sendall(struct.pack("!i", len(payload)) + payload + b"\0" * 64)
        assert closed_by_peer(sock)
    assert wait_until(lambda: control.refused == 1)
    assert not created.exists(), "the server unpickled bytes from a peer that never proved the secret"
    assert admitted == []
    pickle.loads(payload)  # the payload does what it claims, so its absence above means something
    assert created.exists()


def test_a_peer_with_a_wrong_secret_is_refused(server) -> None:
    control, admitted = server
    with pytest.raises(msg.AuthenticationError):
        msg.connect(*control.address, secret="cd" * 32)
    assert wait_until(lambda: control.refused == 1)
    assert admitted == []


def test_a_peer_with_the_secret_is_admitted_and_a_silent_one_blocks_nobody(server) -> None:
    control, admitted = server
    with socket.create_connection(control.address):  # connects and says nothing
        conn = msg.connect(*control.address, secret=SECRET)
        assert wait_until(lambda: len(admitted) == 1)
        conn.send(msg.Heartbeat())
        assert isinstance(admitted[0].recv(), msg.Heartbeat)
        conn.close()


def test_a_client_refuses_a_server_without_the_secret() -> None:
    """A server that pretends to be the coordinator learns nothing it could use and sends no pickle we load."""
    impostor = msg.ControlServer("127.0.0.1", 0, "ef" * 32, lambda conn: None)
    try:
        with pytest.raises(msg.AuthenticationError):
            msg.connect(*impostor.address, secret=SECRET)
    finally:
        impostor.close()


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_the_secret_is_in_no_command_line_and_the_store_listens_on_loopback_only() -> None:
    cluster = LocalCluster(nodes=2, workers_per_node=1, heartbeat_s=0.5, threads_per_worker=1)
    try:
        cluster.start(timeout_s=300)
        pids = [m.pid for m in cluster.agents.values()] + [m.pid for m in cluster.workers.values()]
        assert len(pids) == 4
        for pid in pids:
            assert cluster.secret.encode() not in _cmdline(pid)
        assert cluster.secret[:8] not in str(cluster.memory_root)
        listening = Path("/proc/net/tcp").read_text()
        port = f":{cluster.store_port:04X} "
        lines = [line for line in listening.splitlines() if port in line and line.split()[3] == "0A"]
        assert lines and all(line.split()[1].startswith("0100007F") for line in lines), lines
    finally:
        cluster.shutdown()


def test_the_secret_is_not_in_the_runs_params(run, monkeypatch: pytest.MonkeyPatch, job_overrides: list[str]) -> None:
    monkeypatch.setattr(msg, "new_secret", lambda: SECRET)
    result = run("cluster.nodes=1", "train.stages=1", "train.steps=2", "model=gpt2-tiny")
    assert len(result.steps) == 2
    uri = next(o.split("=", 1)[1] for o in job_overrides if o.startswith("tracking.uri="))
    client = mlflow.MlflowClient(tracking_uri=uri)
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    (found,) = client.search_runs([experiment.experiment_id])
    recorded = [*found.data.params.items(), *found.data.tags.items()]
    assert recorded and not [kv for kv in recorded if SECRET in kv[0] or SECRET in kv[1]]
    assert found.data.tags["comm_backend"] == "gloo"  # and the run says which backend it chose, and why
    assert found.data.tags["comm_backend.why"].startswith("auto: ")
