"""Agents as another host would run them, on this machine: independent processes (``ftlab-agent``, started detached
in a session of their own, so neither children of the coordinator nor dying with it), whose workers are reachable
on a second loopback address (127.0.0.2) while the coordinator binds 127.0.0.1. A node is lost mid-run by a SIGKILL
of its agent's process group, and the job must stay on the fault-free run's losses (the equivalence oracle).

The ssh launcher runs against a real sshd (Debian's openssh-server) that the test starts on 127.0.0.2 with keys it
generates; where no sshd is installed (CI) that test is skipped and the command lines the launcher builds are
checked instead (``test_the_ssh_launcher_puts_no_secret_on_any_command_line``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from ftlab.experiments import job as job_module
from ftlab.runtime.state import checkpoint
from ftlab.runtime.processes.launchers import AgentHandle, AgentSpec, Launcher, SlurmLauncher, SshLauncher
from tests.oracle import LOSS_RTOL, committed_losses
from tests.support import run_apart

STEPS = 8
COMMON = ["experiment=plain", "policy=checkpoint_restart", "protection=storage", "protection.every=3", f"train.steps={STEPS}"]
KILL = ["faults=explicit", "faults.events=[{kind: node, node: 1, at_step: 5}]"]
AGENT = str(Path(sys.executable).with_name("ftlab-agent"))
SECOND = "127.0.0.2"


def loopback_reachable(addr: str) -> bool:
    try:
        with socket.create_server((addr, 0)) as server, socket.create_connection(server.getsockname()[:2], timeout=5):
            return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not loopback_reachable(SECOND), reason=f"{SECOND} is not a loopback address here")



def process_group(pid: int) -> tuple[int, int, int]:
    """(parent pid, process group, session) of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[2]), int(fields[3])


def connections_on(addr: str) -> int:
    """Established TCP connections whose local end is ``addr`` (IPv4)."""
    hexaddr = "".join(f"{int(part):02X}" for part in reversed(addr.split(".")))
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for line in lines if line.split()[1].startswith(hexaddr + ":") and line.split()[3] == "01")


class _Unknown(AgentHandle):
    """A detached agent: nothing here knows its process; its connection tells the coordinator it ended."""

    def poll(self) -> int | None:
        return None

    def wait(self, timeout_s: float) -> None:
        return None

    def kill(self) -> None:
        return None


class DetachedLauncher(Launcher):
    """``setsid -f ftlab-agent ... --secret-file -``: the agent forks off into a session of its own (its parent
    exits at once, so it is re-parented away from the test), reads the secret from its standard input, and
    advertises ``host_addr``. A node is lost by a SIGKILL of the agent's process group; on the way the launcher
    records what the process tree and the sockets looked like."""

    same_machine = True

    def __init__(self, host_addr: str, cwd: Path | None = None) -> None:
        self.addr = host_addr
        self.cwd = cwd
        self.secret = ""
        self.started: list[AgentSpec] = []
        self.seen: dict[str, object] = {}

    def host_addr(self, node: int) -> str:
        return self.addr

    def start(self, spec: AgentSpec, secret: str) -> AgentHandle:
        env = {k: v for k, v in os.environ.items() if k != "FTLAB_SECRET"}
        proc = subprocess.Popen(["setsid", "-f", AGENT, *spec.args(), "--secret-file", "-"], stdin=subprocess.PIPE, env=env,
                                cwd=self.cwd)  # fmt: skip
        assert proc.stdin is not None
        proc.stdin.write(secret.encode() + b"\n")
        proc.stdin.close()
        proc.wait()  # setsid's own process, which exits once it has forked the agent
        self.started.append(spec)
        self.secret = secret
        return _Unknown()

    def signal(self, node: int, pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def kill_node(self, node: int, agent_pid: int, worker_pids: Sequence[int]) -> None:
        parent, group, session = process_group(agent_pid)
        secret = self.secret.encode()
        self.seen["secret_shown"] = [pid for pid in (agent_pid, *worker_pids)
                                     if secret in Path(f"/proc/{pid}/cmdline").read_bytes()]  # fmt: skip
        self.seen["secret_in_agent_env"] = secret in Path(f"/proc/{agent_pid}/environ").read_bytes()
        self.seen.update(parent=parent, group=group, session=session, agent=agent_pid,
                         worker_groups={process_group(pid)[1] for pid in worker_pids},
                         connections=connections_on(self.addr))  # fmt: skip
        os.killpg(agent_pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory, token_cache: Path) -> list[float]:
    return committed_losses(run_apart(tmp_path_factory, token_cache, *COMMON), STEPS)


def test_independent_agents_on_a_second_address_lose_a_node_and_stay_on_the_fault_free_curve(
    run, fault_free: list[float], monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    launcher = DetachedLauncher(SECOND)
    monkeypatch.setattr(job_module, "make_launcher", lambda c: launcher)
    result = run(*COMMON, *KILL, "cluster.coordinator_addr=127.0.0.1")
    assert committed_losses(result, STEPS) == pytest.approx(fault_free, rel=LOSS_RTOL)
    assert {spec.host_addr for spec in launcher.started} == {SECOND}
    seen = launcher.seen
    assert seen, "the node was never killed"
    assert seen["parent"] != os.getpid(), "the agent is a child of the coordinator"
    assert seen["group"] == seen["session"] == seen["agent"], "the agent does not lead a session of its own"
    assert seen["worker_groups"] == {seen["agent"]}, "the node's workers are not in its agent's process group"
    assert seen["connections"] > 0, f"no worker connection uses {SECOND}"
    assert seen["secret_shown"] == [], "the job's secret is on a command line"
    assert not seen["secret_in_agent_env"], "the agent read the secret from its standard input, not its environment"


def test_agents_that_start_in_another_directory_read_write_and_resume_from_the_jobs_relative_folders(
    job_overrides: list[str], token_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ssh agent starts in the user's home, not where ftlab was started: a relative ``train.cache_dir``,
    ``train.checkpoint_dir`` and ``train.resume_from`` still name the folders under ftlab's directory on every node."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cache").symlink_to(token_cache)  # the corpus tokenized once for the session
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path / "job")
    launcher = DetachedLauncher(SECOND, cwd=tmp_path / "home")
    monkeypatch.setattr(job_module, "make_launcher", lambda c: launcher)
    relative = [
        *(o for o in job_overrides if not o.startswith(("train.cache_dir=", "train.checkpoint_dir="))), *COMMON,
        "train.cache_dir=cache", "train.checkpoint_dir=checkpoints", "cluster.coordinator_addr=127.0.0.1",
    ]  # fmt: skip
    result = job_module.run_job(job_module.compose_config(relative))
    assert len(result.steps) == STEPS
    saved = checkpoint.latest(result.checkpoint_dir)
    assert saved is not None and saved[0] == 6, f"no checkpoint of step 6 in {result.checkpoint_dir}"  # every=3
    assert Path(result.checkpoint_dir).parent == tmp_path / "job" / "checkpoints"
    resume_from = Path(result.checkpoint_dir).relative_to(Path.cwd())
    resumed = job_module.run_job(job_module.compose_config([*relative, f"train.resume_from={resume_from}"]))
    assert sorted(s.step for s in resumed.steps) == [6, 7]
    assert list((tmp_path / "home").iterdir()) == [], "a node wrote under the directory its agent started in"


# -- ssh ---------------------------------------------------------------------------------------------------------
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").exists() else None)


def free_port(addr: str) -> int:
    with socket.create_server((addr, 0)) as s:
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """An sshd on 127.0.0.2 that admits this user with a key made here; yields the ssh command that reaches it."""
    if SSHD is None:
        pytest.skip("no sshd here (Debian: apt-get install openssh-server)")
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user.pub").read_text())
    os.chmod(d / "authorized_keys", 0o600)
    port = free_port(SECOND)
    config = d / "sshd_config"
    config.write_text(
        f"ListenAddress {SECOND}:{port}\nHostKey {d / 'host'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
        f"PidFile {d / 'sshd.pid'}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        f"StrictModes no\nUsePAM no\nLogLevel ERROR\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # its privilege-separation directory
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)])
    ssh = ["ssh", "-p", str(port), "-i", str(d / "user"), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
           "-o", f"UserKnownHostsFile={d / 'known_hosts'}", "-o", "LogLevel=ERROR"]  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while subprocess.run([*ssh, SECOND, "true"], capture_output=True).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"sshd does not run here (exit {proc.poll()})")
            time.sleep(0.3)
        yield ssh
    finally:
        proc.terminate()
        proc.wait()


@pytest.mark.slow
def test_agents_started_over_ssh_lose_a_node_and_stay_on_the_fault_free_curve(
    run, fault_free: list[float], sshd: list[str], monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    launcher = SshLauncher([SECOND] * 4, ssh=sshd, agent_command=AGENT)
    monkeypatch.setattr(job_module, "make_launcher", lambda c: launcher)
    result = run(*COMMON, *KILL, "cluster.launcher=ssh", f"cluster.hosts=[{','.join([SECOND] * 4)}]")
    assert committed_losses(result, STEPS) == pytest.approx(fault_free, rel=LOSS_RTOL)


def test_the_ssh_launcher_puts_no_secret_on_any_command_line() -> None:
    launcher = SshLauncher(["alice@node0", "node1"], agent_command="/opt/venv/bin/ftlab-agent")
    spec = AgentSpec("10.0.0.1", 4242, 1, (2, 3), 0.5, 1, "/dev/shm/ftlab-x", launcher.host_addr(1))
    command = launcher.agent_command_line(spec)
    assert command[:4] == ["ssh", "-o", "BatchMode=yes", "node1"]
    remote = command[4]
    assert remote.startswith("/opt/venv/bin/ftlab-agent --coordinator-addr 10.0.0.1 --coordinator-port 4242 --node 1")
    assert remote.endswith("--host-addr node1 --device-offset 0 --secret-file -")
    assert launcher.host_addr(0) == "node0"
    assert launcher.kill_node_command_line(1, 777) == ["ssh", "-o", "BatchMode=yes", "node1", "kill -KILL -- -777"]
    assert launcher.signal_command_line(0, 5, signal.SIGSTOP) == ["ssh", "-o", "BatchMode=yes", "alice@node0", "kill -19 5"]


# -- SLURM (submitit) ------------------------------------------------------------------------------------------------
class LocalSubmititLauncher(SlurmLauncher):
    """The SLURM launcher's own submission (a pickled ``run_agent`` call, the secret in a 0600 file named by
    ``--secret-file``), run by submitit's local executor: there is no SLURM here. Signals go to local processes
    instead of through ``srun``/``scancel``, which are what this cannot test."""

    same_machine = True
    modes: list[int] = []

    def host_addr(self, node: int) -> str:
        return SECOND

    def secret_file(self, secret: str) -> Path:
        path = super().secret_file(secret)
        self.modes.append(path.stat().st_mode & 0o777)
        return path

    def signal(self, node: int, pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def kill_node(self, node: int, agent_pid: int, worker_pids: Sequence[int]) -> None:
        os.killpg(agent_pid, signal.SIGKILL)


@pytest.mark.slow
def test_agents_submitted_through_submitit_lose_a_node_and_stay_on_the_fault_free_curve(
    run, fault_free: list[float], monkeypatch: pytest.MonkeyPatch, tmp_path: Path  # noqa: ANN001
) -> None:
    launcher = LocalSubmititLauncher(tmp_path / "slurm", cluster="local")
    monkeypatch.setattr(job_module, "make_launcher", lambda c: launcher)
    result = run(*COMMON, *KILL)
    assert committed_losses(result, STEPS) == pytest.approx(fault_free, rel=LOSS_RTOL)
    assert launcher.modes and set(launcher.modes) == {0o600}, "the secret file is readable by others"
    assert not (tmp_path / "slurm" / "job-secret").exists(), "the secret file outlived the job"
