"""A managed process (the embedded broker, the moto server) is started on a port probed
free; another process may bind that port first. `wait_for_port` must not take that
listener for the process's own, or a test would talk to another test's server (and stop
the wrong one): the process is given another port instead."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from triage_cli import embedded
from triage_cli.embedded import ManagedProcess, PortTaken, free_port, listeners, wait_for_port

SERVER = """
import socket, sys, time
time.sleep(0.3)  # as a real server imports before it binds
sock = socket.socket()
try:
    sock.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(98)
sock.listen()
time.sleep(120)
"""


class Server(ManagedProcess):
    name = "server"

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-c", SERVER, str(port)]


@pytest.fixture
def taken() -> Iterator[socket.socket]:
    """A port this test process listens on: another process's, for the server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


def test_a_port_someone_else_bound_first_is_not_taken_for_the_servers(
    taken: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = taken.getsockname()[1]
    ports = iter([first, free_port()])
    monkeypatch.setattr(embedded, "free_port", lambda: next(ports))
    server = Server()
    with server:
        assert server.port != first
        assert listeners(server.port) == {server.pid}


def test_a_port_taken_at_every_attempt_fails_naming_why_and_leaves_nothing_running(
    taken: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = taken.getsockname()[1]
    started: list[subprocess.Popen[bytes]] = []
    spawn = Server._spawn

    def recorded(self: Server, port: int) -> subprocess.Popen[bytes]:
        started.append(spawn(self, port))
        return started[-1]

    monkeypatch.setattr(embedded, "free_port", lambda: port)
    monkeypatch.setattr(Server, "_spawn", recorded)
    with pytest.raises(PortTaken, match=f"another process listens on 127.0.0.1:{port}"):
        Server().start()
    assert len(started) == embedded.PORT_ATTEMPTS
    assert [proc.poll() for proc in started] == [98] * embedded.PORT_ATTEMPTS


def test_a_listener_of_a_process_the_started_one_started_is_its_own() -> None:
    """`triage dev` and the tests may start a server through a wrapper (a shell)."""
    port = free_port()
    proc = subprocess.Popen(["sh", "-c", f"\"{sys.executable}\" -c '{SERVER}' {port}; true"])
    try:
        wait_for_port("127.0.0.1", port, 30, proc)
        (owner,) = listeners(port) or {0}
        assert owner != proc.pid  # the shell's child listens, not the shell
    finally:
        subprocess.run(["pkill", "-P", str(proc.pid)], check=False)
        proc.kill()
        proc.wait()


def test_a_listener_is_seen_while_its_process_opens_and_closes_other_descriptors() -> None:
    """A test worker or a proxy opens and closes descriptors all the time. One closed
    between `listeners`' listing of a process's fds and its look at each once hid the
    whole process, so `wait_for_port` took another process's listener for the started
    one's (a run beside two busy loops failed the first test above that way)."""
    below = [os.open(os.devnull, os.O_RDONLY) for _ in range(30)]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        for fd in below:  # free the numbers under the listener's, for the churn to take
            os.close(fd)
        stop = threading.Event()

        def churn() -> None:
            while not stop.is_set():
                for fd in [os.open(os.devnull, os.O_RDONLY) for _ in range(20)]:
                    os.close(fd)

        thread = threading.Thread(target=churn)
        thread.start()
        try:
            seen = [listeners(sock.getsockname()[1]) for _ in range(100)]
        finally:
            stop.set()
            thread.join()
    assert seen == [{os.getpid()}] * 100
