"""A gRPC server dropped before it started (its port was taken) does not crash a process
whose log handler keeps records at DEBUG.

gRPC's aio server (grpcio 1.85) logs itself at DEBUG from its own deallocator unless it
was stopped: a handler that keeps the record then holds a freed object, and the process
segfaults when the record goes. Test runs met it twice (a worker died at a test's
teardown, freeing pytest's captured records). `create_server` keeps that logger at INFO;
this runs its failing path in a child process, whose death is what it checks for.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import asyncio, gc, logging, socket, sys

from triage_proxy.config.loader import settings_from_dict
from triage_proxy.errors import ConfigError
from triage_proxy.server.service import TriageService, create_server
from triage_proxy.server.topology import Topology


class Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


keep = Keep()
logging.getLogger().addHandler(keep)
logging.getLogger().setLevel(logging.DEBUG)


async def main(port):
    settings = settings_from_dict(
        {
            "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "t", "group_id": "g"},
            "server": {"host": "127.0.0.1", "port": port},
            "auth": {"token": "a-token-of-the-test"},
            "dead_letters": {"table": "t-dead-letters"},
        },
        {},
    )
    service = TriageService(settings, {}, Topology(settings, "owner"))
    try:
        create_server(settings, 0, service)
    except ConfigError as exc:
        print("refused:", exc, flush=True)
    gc.collect()


with socket.socket() as squatter:
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    asyncio.run(main(squatter.getsockname()[1]))
gc.collect()
keep.records.clear()
gc.collect()
print("survived", flush=True)
"""


def test_a_server_whose_port_is_taken_is_dropped_without_a_crash() -> None:
    run = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}{run.stderr}"
    assert "refused:" in run.stdout, run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("survived"), run.stdout + run.stderr
