"""How node agents start, and how the coordinator signals processes of a node it may not share a machine with.

- ``local``: each agent is a child of the coordinator (as the project always ran), dying with it (PR_SET_PDEATHSIG).
- ``ssh``: ``ssh <host> ftlab-agent ...`` per node, on the hosts of ``cluster.hosts``; the secret goes down the ssh
  connection's standard input (``--secret-file -``), never on a command line. Signals (a fault injector's kill, a
  hung worker's fence) are ``ssh <host> kill``.
- ``slurm``: one SLURM job per node, submitted through submitit; the secret is written to a file only the user can
  read in submitit's folder (a shared filesystem, which submitit needs anyway) and named by ``--secret-file``.
  Signals go through ``srun --jobid ... --overlap kill``; a lost node is ``scancel``.

A remote agent's death is its closed control connection: ``AgentHandle.poll`` is only a hint where the launcher has
one (the local child's exit code, the ssh client's exit). ``ftlab-agent`` makes its own process group, so a node is
lost at once by signalling that group (the agent and every worker it started).

Choices the issue leaves open, written down here: the ssh launcher needs key-based, non-interactive login
(``-o BatchMode=yes``) and ``ftlab-agent`` on the remote PATH (``cluster.agent_command`` to change it); the SLURM
launcher asks for one task per node with the job's time limit (``cluster.slurm_timeout_min``) and takes the
partition from ``cluster.slurm_partition``. Neither sets up the remote Python environment.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class AgentSpec:
    """Everything an agent is told on its command line: nothing in it is secret."""

    coordinator_addr: str
    coordinator_port: int
    node: int
    workers: tuple[int, ...]
    heartbeat_s: float
    threads: int
    memory_root: str
    host_addr: str
    """The address this node's workers are reachable on (their gloo connections bind to it)."""
    device_offset: int = 0
    """The GPU index of the node's first worker (``runtime.processes.placement.device_index``)."""

    def args(self) -> list[str]:
        return [
            "--coordinator-addr", self.coordinator_addr,
            "--coordinator-port", str(self.coordinator_port),
            "--node", str(self.node),
            "--heartbeat-s", str(self.heartbeat_s),
            "--threads", str(self.threads),
            "--workers", *map(str, self.workers),
            "--memory-root", self.memory_root,
            "--host-addr", self.host_addr,
            "--device-offset", str(self.device_offset),
        ]  # fmt: skip


class AgentHandle(ABC):
    @abstractmethod
    def poll(self) -> int | None:
        """The agent's exit code if the launcher knows it ended, else None (running, or not known from here)."""

    @abstractmethod
    def wait(self, timeout_s: float) -> None:
        """Wait for the launched process to end; ``subprocess.TimeoutExpired`` if it does not in time."""

    @abstractmethod
    def kill(self) -> None:
        """End it now (and reap what the launcher started locally)."""


class PopenHandle(AgentHandle):
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float) -> None:
        self.proc.wait(timeout=timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()  # no zombie outlives the job


class Launcher(ABC):
    same_machine: bool = False
    """True when agents run on the coordinator's machine: pids can be signalled and watched from here."""

    @abstractmethod
    def start(self, spec: AgentSpec, secret: str) -> AgentHandle: ...

    @abstractmethod
    def signal(self, node: int, pid: int, sig: int) -> None:
        """Send ``sig`` to process ``pid`` of ``node``."""

    @abstractmethod
    def kill_node(self, node: int, agent_pid: int, worker_pids: Sequence[int]) -> None:
        """The loss of a machine: its agent and every worker die at once."""

    def host_addr(self, node: int) -> str:
        """The address ``node``'s workers are reachable on."""
        return "127.0.0.1"

    def close(self) -> None:
        """The job is over: remove what the launcher left behind (a secret file)."""


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class LocalLauncher(Launcher):
    """Agents are children of the coordinator (``python -m ftlab.runtime.processes.agent``), as always. ``host_addrs``: the
    loopback address of each node's workers (cycled), to run as separate hosts would on one machine."""

    same_machine = True

    def __init__(self, host_addrs: Sequence[str] = ()) -> None:
        self.host_addrs = list(host_addrs)

    def host_addr(self, node: int) -> str:
        return self.host_addrs[node % len(self.host_addrs)] if self.host_addrs else "127.0.0.1"

    def start(self, spec: AgentSpec, secret: str) -> AgentHandle:
        from ftlab.runtime.processes.agent import terminate_with_parent
        from ftlab.runtime.processes.messages import SECRET_ENV

        env = {**os.environ, SECRET_ENV: secret, "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "ftlab.runtime.processes.agent", *spec.args()]
        return PopenHandle(subprocess.Popen(command, env=env, preexec_fn=terminate_with_parent))

    def signal(self, node: int, pid: int, sig: int) -> None:
        _kill(pid, sig)

    def kill_node(self, node: int, agent_pid: int, worker_pids: Sequence[int]) -> None:
        _kill(agent_pid, signal.SIGKILL)
        for pid in worker_pids:
            _kill(pid, signal.SIGKILL)


class SshLauncher(Launcher):
    """``ssh <host> ftlab-agent ... --secret-file -`` per node; the secret is the first line of its standard input."""

    def __init__(self, hosts: Sequence[str], ssh: Sequence[str] = ("ssh", "-o", "BatchMode=yes"),
                 agent_command: str = "ftlab-agent", host_addrs: Sequence[str] | None = None) -> None:  # fmt: skip
        self.hosts = list(hosts)
        self.ssh = list(ssh)
        self.agent_command = agent_command
        self.host_addrs = list(host_addrs) if host_addrs else [h.rsplit("@", 1)[-1] for h in self.hosts]

    def host_addr(self, node: int) -> str:
        return self.host_addrs[node % len(self.host_addrs)]

    def host(self, node: int) -> str:
        return self.hosts[node % len(self.hosts)]

    def agent_command_line(self, spec: AgentSpec) -> list[str]:
        """The ssh command that starts ``spec``'s agent: no secret in it (it goes on standard input)."""
        remote = shlex.join([*shlex.split(self.agent_command), *spec.args(), "--secret-file", "-"])
        return [*self.ssh, self.host(spec.node), remote]

    def signal_command_line(self, node: int, pid: int, sig: int) -> list[str]:
        return [*self.ssh, self.host(node), f"kill -{int(sig)} {int(pid)}"]

    def kill_node_command_line(self, node: int, agent_pid: int) -> list[str]:
        # ftlab-agent leads its own process group: the group is the agent and every worker it started.
        return [*self.ssh, self.host(node), f"kill -KILL -- -{int(agent_pid)}"]

    def start(self, spec: AgentSpec, secret: str) -> AgentHandle:
        proc = subprocess.Popen(self.agent_command_line(spec), stdin=subprocess.PIPE, start_new_session=True)
        assert proc.stdin is not None
        proc.stdin.write(secret.encode() + b"\n")
        proc.stdin.close()
        return PopenHandle(proc)

    def signal(self, node: int, pid: int, sig: int) -> None:
        subprocess.run(self.signal_command_line(node, pid, sig), check=False, stdin=subprocess.DEVNULL)

    def kill_node(self, node: int, agent_pid: int, worker_pids: Sequence[int]) -> None:
        subprocess.run(self.kill_node_command_line(node, agent_pid), check=False, stdin=subprocess.DEVNULL)


def run_agent(argv: list[str]) -> None:
    """A SLURM job's entry (submitit pickles this call): the agent, in its own process group."""
    from ftlab.runtime.processes import agent

    agent.main(argv, own_group=True)


class _SubmititHandle(AgentHandle):
    def __init__(self, job: Any) -> None:
        self.job = job

    def poll(self) -> int | None:
        return 0 if self.job.done() else None

    def wait(self, timeout_s: float) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while not self.job.done():
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"slurm job {self.job.job_id}", timeout_s)
            time.sleep(0.5)

    def kill(self) -> None:
        self.job.cancel(check=False)


class SlurmLauncher(Launcher):
    """One SLURM job per node through submitit; the secret in a 0600 file of submitit's (shared) folder."""

    def __init__(self, folder: str | Path, partition: str | None = None, timeout_min: int = 60,
                 cluster: str | None = None) -> None:  # fmt: skip
        """``cluster``: submitit's executor (None: SLURM where ``sbatch`` is found; ``local`` runs the same
        submission as local processes, which is how it is tested off a SLURM cluster)."""
        self.folder = Path(folder)
        self.partition = partition
        self.timeout_min = timeout_min
        self.cluster = cluster
        self.jobs: dict[int, Any] = {}
        self._hosts: dict[int, str] = {}

    def secret_file(self, secret: str) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "job-secret"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        return path

    def close(self) -> None:
        (self.folder / "job-secret").unlink(missing_ok=True)

    def host_addr(self, node: int) -> str:
        # A SLURM node's address is known only once the job runs; the agent finds it (``--host-addr auto``).
        return "auto"

    def start(self, spec: AgentSpec, secret: str) -> AgentHandle:
        import submitit

        executor = submitit.AutoExecutor(folder=self.folder / f"node-{spec.node}", cluster=self.cluster)
        parameters: dict[str, Any] = {"nodes": 1, "tasks_per_node": 1, "timeout_min": self.timeout_min}
        if self.partition:
            parameters["slurm_partition"] = self.partition
        executor.update_parameters(**parameters)
        job = executor.submit(run_agent, [*spec.args(), "--secret-file", str(self.secret_file(secret))])
        self.jobs[spec.node] = job
        return _SubmititHandle(job)

    def signal(self, node: int, pid: int, sig: int) -> None:
        job = self.jobs[node]
        subprocess.run(["srun", f"--jobid={job.job_id}", "--overlap", "kill", f"-{int(sig)}", str(pid)], check=False)

    def kill_node(self, node: int, agent_pid: int, worker_pids: Sequence[int]) -> None:
        self.jobs[node].cancel(check=False)


LAUNCHERS = ("local", "ssh", "slurm")


def _is_loopback(addr: str) -> bool:
    import ipaddress

    host = addr.rsplit("@", 1)[-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: taken to be another machine


def _bind_problems(c: Any) -> list[str]:
    """The control server and the store bind ``coordinator_addr`` (at their ports, when fixed): it must be an
    address of this machine and the ports free, or the job would fail after its run opened."""
    import socket

    problems = []
    for name, port in (("coordinator_port", c.coordinator_port), ("store_port", c.store_port)):
        if not 0 <= port < 65536:
            continue  # said above
        try:
            with socket.create_server((c.coordinator_addr, port)):
                pass
        except OSError as exc:  # an unknown name too: create_server re-raises it as OSError
            reason = str(exc.strerror).split(" (while")[0]
            if port == 0:
                return [f"cluster.coordinator_addr={c.coordinator_addr} is not an address of this machine "
                        f"({reason}): use 127.0.0.1 for local runs, or this machine's address on the network the "
                        f"hosts share"]  # fmt: skip
            problems.append(f"cluster.{name}={port} on {c.coordinator_addr}: {reason}; choose a free port, or 0")
    return problems


def launch_problems(c: Any) -> list[str]:
    """What is wrong with a ClusterConfig's launch settings, each with what to change (torch-free: preflight)."""
    problems = []
    if c.launcher not in LAUNCHERS:
        return [f"cluster.launcher={c.launcher!r}: use local, ssh or slurm"]
    for name in ("coordinator_port", "store_port"):
        if not 0 <= getattr(c, name) < 65536:
            problems.append(f"cluster.{name}={getattr(c, name)}: use a TCP port, or 0 for any free one")
    problems += _bind_problems(c)
    if c.launcher == "local":
        remote = [h for h in c.hosts if not _is_loopback(h)]
        if remote:
            problems.append(
                f"cluster.hosts={list(c.hosts)} with cluster.launcher=local: local agents run on this machine, so "
                f"{remote} cannot be their address; use loopback addresses (127.0.0.x) or cluster.launcher=ssh"
            )
        if not _is_loopback(c.coordinator_addr) and c.hosts:
            problems.append(
                f"cluster.coordinator_addr={c.coordinator_addr} with loopback cluster.hosts: the store and the "
                f"control server must be reachable from the workers' addresses; use 127.0.0.1"
            )
    if c.launcher == "ssh":
        if len(c.hosts) != c.nodes:
            problems.append(
                f"cluster.launcher=ssh needs one host per node: cluster.hosts has {len(c.hosts)} entries for "
                f"cluster.nodes={c.nodes}; give cluster.hosts=[host0,host1,...] (a node that joins later reuses "
                f"the host of its id modulo their count)"
            )
        remote = [h for h in c.hosts if not _is_loopback(h)]
        if remote and _is_loopback(c.coordinator_addr):
            problems.append(
                f"cluster.coordinator_addr={c.coordinator_addr} is loopback, which the hosts {remote} cannot reach: "
                f"set it to this machine's address on the network they share"
            )
    if c.launcher == "slurm":
        if _is_loopback(c.coordinator_addr):
            problems.append(
                f"cluster.launcher=slurm: cluster.coordinator_addr={c.coordinator_addr} is loopback, which the "
                f"SLURM nodes cannot reach; set it to this machine's address on the cluster's network"
            )
        if c.slurm_timeout_min < 1:
            problems.append(f"cluster.slurm_timeout_min={c.slurm_timeout_min}: give the jobs' time limit in minutes")
        import importlib.util

        if importlib.util.find_spec("submitit") is None:
            problems.append("cluster.launcher=slurm needs submitit: pip install submitit")
    return problems


def make_launcher(c: Any) -> Launcher:
    """The launcher a ClusterConfig names (checked by ``launch_problems`` first)."""
    if c.launcher == "local":
        return LocalLauncher(list(c.hosts))
    if c.launcher == "ssh":
        return SshLauncher(list(c.hosts), agent_command=c.agent_command)
    if c.launcher == "slurm":
        return SlurmLauncher(c.slurm_folder, c.slurm_partition, c.slurm_timeout_min)
    raise ValueError(f"unknown launcher {c.launcher!r}: use local, ssh or slurm")
