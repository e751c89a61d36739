"""A client (or a push receiver) under test, run as a child process: its environment, its
JSON lines, its end.

Why a process: the scenarios SIGTERM and SIGKILL it, and any language's client or
receiver is a command. stdout is read by a thread into `events` as it arrives (a line
that is not JSON is kept in `bad_lines`) and to `<name>.stdout.log`, each line after its
wall-clock time, to read beside the proxies' logs; stderr goes to a log file.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True)
class Event:
    """One JSON line of the client's (or receiver's) stdout."""

    kind: str
    """`start` or `settled` (a client), `received` (a push receiver)."""
    partition: int
    offset: int
    at: float
    """time.monotonic() when the kit read it."""
    data: dict[str, Any] = field(default_factory=dict)
    """The whole line."""

    @property
    def attempt(self) -> int:
        return int(self.data.get("attempt", 0))

    @property
    def outcome(self) -> str:
        return str(self.data.get("outcome", ""))

    def blob(self, name: str) -> bytes | None:
        value = self.data.get(name)
        return None if value is None else base64.b64decode(value)

    def headers(self) -> tuple[tuple[str, bytes | None], ...]:
        return tuple(
            (str(name), None if value is None else base64.b64decode(value))
            for name, value in self.data.get("headers", [])
        )


class ChildProcess:
    """One run of a command under test (a shell command line, split with shlex) with
    `env` added to the kit's environment; its stdout JSON lines become `events`."""

    def __init__(self, command: str, *, name: str, env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.stdout_path = log_path.parent / f"{name}.stdout.log"
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen(
                shlex.split(command),
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # a Ctrl-C to the kit must not reach it first
            )
        self.events: list[Event] = []
        self.bad_lines: list[str] = []
        self._lock = threading.Lock()
        assert self._proc.stdout is not None
        self._reader = threading.Thread(
            target=self._read, args=(self._proc.stdout,), name=f"read-{name}", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read(self, stream: IO[bytes]) -> None:
        with open(self.stdout_path, "a", encoding="utf-8") as copy:
            for raw in stream:
                line = raw.decode("utf-8", "replace").strip()
                if line:
                    copy.write(f"{datetime.now().isoformat(timespec='milliseconds')} {line}\n")
                    copy.flush()
                    self._parse(line)

    def _parse(self, line: str) -> None:
        try:
            data = json.loads(line)
            partition, offset = self.where(data)
            event = Event(str(data["event"]), partition, offset, time.monotonic(), data)
        except (ValueError, KeyError, TypeError, AttributeError):
            with self._lock:
                self.bad_lines.append(line[:200])
            return
        with self._lock:
            self.events.append(event)

    def where(self, data: dict[str, Any]) -> tuple[int, int]:
        """The (partition, offset) a line is about."""
        return int(data["partition"]), int(data["offset"])

    def snapshot(self) -> list[Event]:
        with self._lock:
            return list(self.events)

    def count(self, kind: str) -> int:
        with self._lock:
            return sum(1 for e in self.events if e.kind == kind)

    def wait_for(self, kind: str, count: int, timeout_s: float) -> bool:
        """Wait until `count` events of `kind` arrived (False on timeout or exit)."""
        deadline = time.monotonic() + timeout_s
        while self.count(kind) < count:
            if time.monotonic() > deadline or self._proc.poll() is not None:
                return self.count(kind) >= count
            time.sleep(0.02)
        return True

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, signum)

    def wait(self, timeout_s: float) -> int | None:
        """The exit code, or None if it still runs after `timeout_s`."""
        try:
            code = self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(5)
        return code

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; returns the exit code of the SIGTERM
        (None if it had to be killed). Safe twice."""
        if self._proc.poll() is not None:
            self._reader.join(5)
            return self._proc.returncode
        self.signal(signal.SIGTERM)
        code = self.wait(grace_s)
        if code is None:
            self.kill()
        return code

    def kill(self) -> None:
        """SIGKILL by PID and reap."""
        if self._proc.poll() is None:
            self.signal(signal.SIGKILL)
            self._proc.wait()
        self._reader.join(5)

    def stderr_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class ClientProcess(ChildProcess):
    """A client under test, with the contract's environment."""

    def __init__(
        self,
        command: str,
        *,
        endpoint: str,
        token: str,
        consumer_id: str,
        concurrency: int,
        log_path: Path,
    ) -> None:
        self.consumer_id = consumer_id
        env = {
            "TRIAGE_ENDPOINT": endpoint,
            "TRIAGE_TOKEN": token,
            "TRIAGE_CONSUMER_ID": consumer_id,
            "TRIAGE_CONCURRENCY": str(concurrency),
        }
        super().__init__(command, name=consumer_id, env=env, log_path=log_path)
