"""The local deployment: supervised `triage proxy` processes, one per partition (pinned)
or N fleet processes that share the topic's partitions (`--proxies N`: each joins the
deployment's consumer group and serves what the group coordinator assigns it).

`triage deploy --target local` starts `triage supervise` detached (its own session, so a
Ctrl-C in the deploying terminal does not reach it) and returns once every proxy is
ready. The supervisor restarts a proxy that dies, with exponential backoff, and gives it
(its partition, or its slot in a fleet) up after repeated fast crashes (or at once when
the proxy says its config is bad: restarting cannot fix that). SIGTERM (what `triage
destroy` sends) stops it: SIGTERM every proxy -> wait for them to drain
(shutdown.drain_timeout_s + a margin) -> SIGKILL what is left -> remove the pid files ->
exit 0. SIGHUP is passed on to every proxy it runs (each re-reads the config's [auth]
section), so revoking a token is one `kill -HUP $(cat .triage/supervisor.pid)`; the
supervisor itself goes on.

Everything lives in one project folder (default `.triage/` next to the config):

    supervisor.pid  supervisor.log  state.json
    proxy-P.pid     proxy-P.log     (one each per partition; in a fleet, per process slot P)

`state.json` holds endpoints, pids, statuses and the token NAMES; no file here holds a
token (the proxies never log one), so the folder is safe to attach to a bug report.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from triage_cli.exitcodes import ExitCode
from triage_cli.signals import on_stop_signals

if TYPE_CHECKING:
    from triage_proxy.config.settings import Settings

logger = logging.getLogger(__name__)

DEFAULT_DIR_NAME = ".triage"
POLL_S = 0.2
STOP_MARGIN_S = 10.0
"""Added to shutdown.drain_timeout_s before a proxy that ignores SIGTERM is killed."""


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    """Wait before the first restart of a crashed proxy."""
    max_backoff_s: float = 30.0
    """Cap of the wait between restarts."""
    multiplier: float = 2.0
    """Growth of the wait per consecutive fast crash."""
    fast_crash_s: float = 10.0
    """A run shorter than this counts as a fast crash; a longer one resets the count."""
    max_fast_crashes: int = 5
    """Consecutive fast crashes after which the process (partition or slot) is given up."""


@dataclass(frozen=True)
class RestartDecision:
    fast_crashes: int
    """Consecutive fast crashes, counting this exit."""
    delay_s: float | None
    """Wait before restarting; None: give the process up."""


def restart_decision(
    policy: RestartPolicy, fast_crashes: int, ran_s: float, returncode: int
) -> RestartDecision:
    """What to do after a proxy exited on its own (a pure policy, tested exhaustively)."""
    if returncode == ExitCode.BAD_INPUT:
        return RestartDecision(fast_crashes + 1, None)  # its config is bad: retrying won't help
    crashes = fast_crashes + 1 if ran_s < policy.fast_crash_s else 1
    if crashes > policy.max_fast_crashes:
        return RestartDecision(crashes, None)
    delay = policy.initial_backoff_s * policy.multiplier ** (crashes - 1)
    return RestartDecision(crashes, min(delay, policy.max_backoff_s))


# --- the project folder -------------------------------------------------------------------


class ProjectDir:
    """Paths, pid files and state.json of one local deployment."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def for_config(cls, config: Path, state_dir: Path | None = None) -> ProjectDir:
        return cls(state_dir if state_dir is not None else config.parent / DEFAULT_DIR_NAME)

    @property
    def supervisor_pid_file(self) -> Path:
        return self.root / "supervisor.pid"

    @property
    def supervisor_log(self) -> Path:
        return self.root / "supervisor.log"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    def proxy_pid_file(self, partition: int) -> Path:
        return self.root / f"proxy-{partition}.pid"

    def proxy_log(self, partition: int) -> Path:
        return self.root / f"proxy-{partition}.log"

    def proxy_pid_files(self) -> list[Path]:
        return sorted(self.root.glob("proxy-*.pid"))

    def read_pid(self, path: Path) -> int | None:
        try:
            return int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def write_pid(self, path: Path, pid: int) -> None:
        _write_atomic(path, f"{pid}\n")

    def read_state(self) -> dict[str, Any] | None:
        try:
            state = json.loads(self.state_file.read_text())
        except (FileNotFoundError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def write_state(self, state: dict[str, Any]) -> None:
        _write_atomic(self.state_file, json.dumps(state, indent=2) + "\n")

    def owners(self) -> set[Path]:
        """The config files the deployment in this folder was made from: state.json's
        `config`, and the `--config` of every live triage process its pid files name.
        More than one, or one that is not the caller's, means the folder is another
        deployment's (a wrong --state-dir, or two configs sharing `.triage/`)."""
        found: set[Path] = set()
        state = self.read_state() or {}
        if isinstance(state.get("config"), str) and state["config"]:
            found.add(Path(state["config"]).resolve())
        for path in [self.supervisor_pid_file, *self.proxy_pid_files()]:
            pid = self.read_pid(path)
            config = command_config(pid) if pid is not None and pid_alive(pid) else None
            if config is not None:
                found.add(config)
        return found

    def describe_owner(self) -> str:
        """What state.json says the deployment is (for messages): config, topic, group,
        table and supervisor pid, as far as it records them."""
        state = self.read_state() or {}
        parts = [
            f"{name} {state[key]}"
            for name, key in (
                ("config", "config"),
                ("topic", "topic"),
                ("group", "group_id"),
                ("table", "dead_letter_table"),
                ("supervisor pid", "supervisor_pid"),
            )
            if state.get(key)
        ]
        return ", ".join(parts)


def _write_atomic(path: Path, text: str) -> None:
    """Readers (deploy, destroy, status) never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pid_alive(pid: int, marker: str | None = None) -> bool:
    """Whether `pid` runs (not a zombie) and, when /proc tells, its command line holds
    `marker` (so a recycled pid is never taken for ours)."""
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False  # it was our child and has just been reaped
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # someone else's process now: not ours
    proc = Path(f"/proc/{pid}")
    if not proc.exists():
        return True  # no /proc (macOS): trust the pid
    try:
        if proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
        cmdline = (
            proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except (OSError, IndexError):
        return False
    return marker is None or marker in cmdline


def command_config(pid: int) -> Path | None:
    """The `--config` of a live `triage` process (a supervisor or a proxy), from its
    command line in /proc; None when it is not one (or there is no /proc to tell)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any(arg == "triage_cli.main" or Path(arg).name == "triage" for arg in args):
        return None
    for flag in ("--config", "-c"):
        if flag in args[:-1]:
            return Path(args[args.index(flag) + 1]).resolve()
    return None


def listening_ports(pid: int) -> set[int] | None:
    """The TCP ports `pid` listens on, from /proc (None: no /proc to tell, e.g. macOS).

    How deploy knows a port that answers belongs to the proxy it started, not to
    another deployment (or anything else) that already held it. A process that is gone
    listens on nothing."""
    if not Path("/proc/self/net/tcp").exists():
        return None
    sockets = socket_inodes(pid)
    if not sockets:
        return set()
    listening = listen_inodes(Path(f"/proc/{pid}/net"))
    return {port for inode, port in listening.items() if inode in sockets}


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets `pid` holds open, from /proc/PID/fd; empty when it is
    gone or not ours to read. A descriptor closed between the listing and its readlink is
    skipped alone: a busy process (a test worker, a proxy) opens and closes descriptors
    all the time, and one that vanished must not hide the others."""
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # gone, or not ours to read
        return set()
    sockets: set[str] = set()
    for fd in fds:
        with contextlib.suppress(OSError):  # closed since listed
            target = os.readlink(fd)
            if target.startswith("socket:["):
                sockets.add(target[len("socket:[") : -1])
    return sockets


def listen_inodes(net: Path) -> dict[str, int]:
    """inode -> port of every listening TCP socket (IPv4 and IPv6) in the `tcp` and
    `tcp6` tables of `net` (/proc/net, or /proc/PID/net for that process's network
    namespace); a table that cannot be read is skipped."""
    listening: dict[str, int] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = net.joinpath(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st ... inode; st 0A is LISTEN
            if len(fields) > 9 and fields[3] == "0A":
                listening[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    return listening


def wait_gone(pids: Sequence[int], timeout_s: float, marker: str | None = None) -> list[int]:
    """Wait until none of `pids` is alive; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if pid_alive(p, marker)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if pid_alive(p, marker)]
    return alive


def signal_pid(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def proxy_command(config: Path, partition: int) -> list[str]:
    """`triage proxy` for one partition, as this interpreter runs it (the supervisor's
    children and `triage dev`'s)."""
    return [
        sys.executable,
        "-m",
        "triage_cli.main",
        "proxy",
        "--config",
        str(config),
        "--partition",
        str(partition),
    ]


def fleet_command(config: Path, slot: int) -> list[str]:
    """`triage proxy` for fleet process `slot` (ports server.port + slot and
    server.http_port + slot), as this interpreter runs it."""
    return [
        sys.executable,
        "-m",
        "triage_cli.main",
        "proxy",
        "--config",
        str(config),
        "--slot",
        str(slot),
    ]


def _ignore_sighup() -> None:
    """Run in a proxy child between fork and exec: it starts with SIGHUP ignored, as it
    did when the supervisor ignored SIGHUP itself. An ignored signal stays ignored across
    exec, a handled one does not, so without this a SIGHUP passed on while a proxy is
    still starting (before it installs its reload handler) would kill it. The supervisor
    runs no threads, which is what makes a preexec_fn safe here."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def supervisor_command(
    config: Path, project: ProjectDir, partitions: int, proxies: int | None = None
) -> list[str]:
    fleet = [] if proxies is None else ["--proxies", str(proxies)]
    return [
        sys.executable,
        "-m",
        "triage_cli.main",
        "supervise",
        "--config",
        str(config),
        "--state-dir",
        str(project.root),
        "--partitions",
        str(partitions),
        *fleet,
    ]


# --- the supervisor -----------------------------------------------------------------------


@dataclass
class _Child:
    partition: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    next_start_at: float = 0.0
    fast_crashes: int = 0
    restarts: int = 0
    status: str = "starting"
    last_exit: int | None = None


def _named(child: _Child, fleet: bool) -> str:
    """How log lines name a child: a fleet's by its process slot, a pinned one's by its
    partition (a fleet process serves whatever partitions the group assigns it)."""
    return f"proxy in slot {child.partition}" if fleet else f"proxy for partition {child.partition}"


class Supervisor:
    """Keeps one proxy process per partition (or `proxies` fleet processes) alive until
    stopped (runs in the foreground of the detached `triage supervise` process; `stop()`
    and `reload()` are signal-safe: they set an event the loop acts on). A fleet child's
    `partition` field is its slot."""

    def __init__(
        self,
        config: Path,
        project: ProjectDir,
        settings: Settings,
        partitions: int,
        policy: RestartPolicy | None = None,
        proxies: int | None = None,
        command: Callable[[Path, int], list[str]] | None = None,
    ) -> None:
        self.config = config
        self.project = project
        self.settings = settings
        self.policy = policy or RestartPolicy()
        self.fleet = proxies is not None
        """N fleet processes instead of one pinned process per partition."""
        self.partitions = partitions
        self.children = [_Child(p) for p in range(partitions if proxies is None else proxies)]
        self.command = command or (fleet_command if self.fleet else proxy_command)
        """(config, partition or slot) -> the child's command line (tests give their own)."""
        self._stopping = threading.Event()
        self._reloading = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def reload(self) -> None:
        """Ask the loop to pass SIGHUP on to every proxy (safe from a signal handler)."""
        self._reloading.set()

    def run(self) -> int:
        """Start every proxy, keep them alive until stop(), then stop them; exit status."""
        logger.info(
            "supervisor pid=%d: %d proxies for %s",
            os.getpid(),
            len(self.children),
            self.config,
        )
        self.project.write_pid(self.project.supervisor_pid_file, os.getpid())
        code = ExitCode.OK
        try:
            while not self._stopping.is_set():
                if self._tick(time.monotonic()):
                    self._write_state("running")
                if all(c.status == "failed" for c in self.children):
                    logger.error(
                        "every %s was given up; the supervisor exits",
                        "fleet process" if self.fleet else "partition's proxy",
                    )
                    code = ExitCode.FAILURE
                    break
                if self._reloading.is_set():
                    self._reloading.clear()
                    self._forward_reload()
                self._stopping.wait(POLL_S)
        finally:
            self._stop_children()
            self._write_state("stopped" if code == ExitCode.OK else "failed")
            if self.project.read_pid(self.project.supervisor_pid_file) == os.getpid():
                self.project.supervisor_pid_file.unlink(missing_ok=True)
            logger.info("supervisor stopped")
        return int(code)

    def _forward_reload(self) -> None:
        """SIGHUP every running proxy: each re-reads [auth] (idempotent in the proxy). One
        that is not running now reads the config afresh when it (re)starts."""
        pids = []
        for child in self.children:
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGHUP)
                pids.append(child.proc.pid)
        logger.info(
            "SIGHUP passed on to %d proxies (pids %s): they re-read [auth] from %s",
            len(pids),
            ", ".join(map(str, pids)) or "none",
            self.config,
        )

    def _tick(self, now: float) -> bool:
        """Reap exited proxies and (re)start due ones; True if anything changed."""
        changed = False
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                self._exited(child, now)
                changed = True
            if child.proc is None and child.status != "failed" and now >= child.next_start_at:
                self._start(child, now)
                changed = True
        return changed

    def _exited(self, child: _Child, now: float) -> None:
        assert child.proc is not None
        code = child.proc.returncode
        self.project.proxy_pid_file(child.partition).unlink(missing_ok=True)
        child.proc = None
        child.last_exit = code
        decision = restart_decision(self.policy, child.fast_crashes, now - child.started_at, code)
        child.fast_crashes = decision.fast_crashes
        if decision.delay_s is None:
            child.status = "failed"
            logger.error(
                "%s exited with status %s (%d fast exit(s) in a row); giving it up (see %s)",
                _named(child, self.fleet),
                code,
                decision.fast_crashes,
                self.project.proxy_log(child.partition),
            )
            return
        child.status = "restarting"
        child.next_start_at = now + decision.delay_s
        logger.warning(
            "%s exited with %s; restarting in %.1fs",
            _named(child, self.fleet),
            code,
            decision.delay_s,
        )

    def _start(self, child: _Child, now: float) -> None:
        log = open(self.project.proxy_log(child.partition), "ab")  # noqa: SIM115
        with log:
            child.proc = subprocess.Popen(
                self.command(self.config, child.partition),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=_ignore_sighup,  # safe: no threads here, see _ignore_sighup
            )
        if child.started_at:
            child.restarts += 1
        child.started_at = now
        child.status = "running"
        self.project.write_pid(self.project.proxy_pid_file(child.partition), child.proc.pid)
        logger.info("%s started pid=%d", _named(child, self.fleet), child.proc.pid)

    def _stop_children(self) -> None:
        """SIGTERM every proxy, wait for the drain, SIGKILL what outlives it."""
        live = [c for c in self.children if c.proc is not None]
        for child in live:
            assert child.proc is not None
            logger.debug("stopping %s", _named(child, self.fleet))
            signal_pid(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.settings.shutdown.drain_timeout_s + STOP_MARGIN_S
        for child in live:
            assert child.proc is not None
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM; killing", _named(child, self.fleet))
                child.proc.kill()
                child.proc.wait()
            child.last_exit = child.proc.returncode
            child.proc = None
            child.status = "stopped"
            self.project.proxy_pid_file(child.partition).unlink(missing_ok=True)

    def _write_state(self, status: str) -> None:
        self.project.write_state(describe(self, status))


def describe(supervisor: Supervisor, status: str) -> dict[str, Any]:
    """state.json: what deploy, destroy and people read (token names, never tokens).
    Pinned: `partitions`, one entry per partition's process; fleet: `proxies`, one entry
    per process slot (which partitions each serves is in its /status, `triage status`)."""
    settings = supervisor.settings
    entries = []
    for child in supervisor.children:
        http = settings.server.http_address(child.partition)
        entries.append(
            {
                "slot" if supervisor.fleet else "partition": child.partition,
                "pid": child.proc.pid if child.proc is not None else None,
                "status": child.status,
                "restarts": child.restarts,
                "last_exit": child.last_exit,
                "target": settings.listen_address(child.partition),
                "http": f"{http[0]}:{http[1]}" if http else None,
                "log": str(supervisor.project.proxy_log(child.partition)),
            }
        )
    return {
        "status": status,
        "config": str(supervisor.config),
        "supervisor_pid": os.getpid(),
        "topic": settings.kafka.topic,
        "group_id": settings.kafka.group_id,
        "dead_letter_table": settings.dead_letters.table,
        "tls": settings.tls.enabled,
        "token_names": sorted(settings.auth.active()),
        "mode": "fleet" if supervisor.fleet else "pinned",
        "topic_partitions": supervisor.partitions,
        "partitions": [] if supervisor.fleet else entries,
        "proxies": entries if supervisor.fleet else [],
    }


def run_supervisor(
    config: Path, project: ProjectDir, partitions: int, proxies: int | None = None
) -> int:
    """Body of `triage supervise` (see `serve` for its signals)."""
    from triage_proxy.config.loader import load_settings
    from triage_proxy.store.aws import read_secret

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # no proxy to pass it on to yet
    settings = load_settings(config, fetch_secret=read_secret)
    return serve(Supervisor(config, project, settings, partitions, proxies=proxies))


def serve(supervisor: Supervisor) -> int:
    """Run `supervisor` until SIGTERM/SIGINT stops it gracefully. SIGHUP is passed on to
    its proxies (they re-read [auth]) and does not end it, so it also outlives the
    terminal that deployed it. The handlers only set events; the loop does the work."""

    def hangup(signum: int, frame: FrameType | None) -> None:
        supervisor.reload()

    previous = signal.signal(signal.SIGHUP, hangup)
    try:
        with on_stop_signals(supervisor.stop):
            return supervisor.run()
    finally:
        signal.signal(signal.SIGHUP, previous)
