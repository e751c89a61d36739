"""A push receiver under test, run as a child process on the port the stack's `[[push]]`
target posts to.

Its stdout lines carry the CloudEvents id ("<topic>/<partition>/<offset>") rather than a
partition and an offset: that id is all a receiver knows of where a record came from,
and the kit turns it back into the (partition, offset) every check keys on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from triage_cli.embedded import HOST, wait_for_port
from triage_conformance.client import ChildProcess


def where_of(event_id: str) -> tuple[int, int]:
    """(partition, offset) of an event id (topic names hold no '/')."""
    _topic, partition, offset = event_id.rsplit("/", 2)
    return int(partition), int(offset)


class ReceiverProcess(ChildProcess):
    """One run of the receiver command, listening on `port` in `mode`."""

    def __init__(self, command: str, *, name: str, port: int, mode: str, log_path: Path) -> None:
        self.port = port
        env = {"TRIAGE_PUSH_PORT": str(port), "TRIAGE_PUSH_MODE": mode}
        super().__init__(command, name=name, env=env, log_path=log_path)

    def where(self, data: dict[str, Any]) -> tuple[int, int]:
        return where_of(str(data["id"]))

    def wait_listening(self, timeout_s: float) -> None:
        """Block until the receiver accepts connections; raise if it exits or times out
        (records produced before it listens would first meet an outage)."""
        wait_for_port(HOST, self.port, timeout_s, self._proc)
