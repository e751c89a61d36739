"""Session fixtures: the real broker (Tansu) and the real AWS endpoint (moto server).

Both run as child processes on free loopback ports and are stopped by PID when
the session ends, pass or fail. Every integration test runs with the default ports
(the proxy's gRPC and HTTP ports, Kafka's, moto's) taken, as beside a local
deployment: a listener a test starts must bind a free port (0 or probed), never a
default, or it fails here rather than on a user's machine.

Under pytest-xdist each worker is a session of its own: it starts its own broker and
moto server (workers share nothing but the machine), puts its worker id in its topic
and table names, and stops both by PID when it exits. What workers do share (the
TypeScript package's node_modules and dist/, the CPU a heavy test needs) is taken under
a file lock (tests/runlock.py)."""

from __future__ import annotations

import os

# The test process runs gRPC servers and channels and also starts children (Spark's JVM,
# npm, the CLI): each fork is followed at once by exec, which is what gRPC's own advice
# for GRPC_ENABLE_FORK_SUPPORT=false covers. With its fork handlers on, a fork while gRPC
# threads were busy left the child dead before exec (CI: "Java gateway process exited",
# after "Other threads are currently calling into gRPC, skipping fork() handlers").
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# gRPC's core logs at INFO by default, from its own threads: a client whose server stopped
# without a grace (the fake proxy vanishing, a push target's server) printed "Got goaway
# [2] ... Cancelling all calls" into the run's progress line whenever the line fell
# between two tests' captures. The tests see what matters as status codes; errors still
# print.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import contextlib
import errno
import itertools
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from hypothesis import settings as hypothesis_settings

from tests import leftovers
from tests.bytecode import allow_writes, compile_ahead
from tests.runlock import shared_lock
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_proxy.config.sections import DEFAULT_HTTP_PORT, DEFAULT_PORT
from triage_proxy.gctuning import freeze_startup_heap, set_collection_policy

# Properties check behaviour, not speed: on CI's 2 shared cores one example of a stateful
# test can take longer than hypothesis' default 200 ms deadline for no fault of the code.
hypothesis_settings.register_profile("triage", deadline=None)
hypothesis_settings.load_profile("triage")

SHORT_JVM_OPTIONS = (
    "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    " -XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote"
)
"""For the Spark JVMs the tests start, each alive for seconds on a small data set: the
C1 compiler alone (C2's compiler threads spend more CPU optimizing than such a JVM gets
back), the serial collector (no parallel GC threads), and no bytecode verification of the
classes the JVM loads from pyspark's own jars (a local session's JVM: 5.8 s of CPU
instead of 6.9 s). CPU the whole suite shares."""
# spark-submit's and PySpark's driver JVMs read SPARK_SUBMIT_OPTS, a standalone cluster's
# master and workers SPARK_DAEMON_JAVA_OPTS (executors: test_spark_cluster's conf).
os.environ.setdefault("SPARK_SUBMIT_OPTS", SHORT_JVM_OPTIONS)
os.environ.setdefault("SPARK_DAEMON_JAVA_OPTS", SHORT_JVM_OPTIONS)

DEFAULT_PARTITIONS_HELD = 4
"""Partitions whose default proxy ports are held (tests run at most 2 partitions)."""
KAFKA_DEFAULT_PORT = 9092
"""Tansu's default --listener-url port."""
MOTO_DEFAULT_PORT = 5000
"""moto server's default port."""
CONSOLE_DEFAULT_PORT = 9800
"""`triage console`'s default port."""
DEFAULT_PORTS = (
    *(DEFAULT_PORT + p for p in range(DEFAULT_PARTITIONS_HELD)),
    *(DEFAULT_HTTP_PORT + p for p in range(DEFAULT_PARTITIONS_HELD)),
    KAFKA_DEFAULT_PORT,
    MOTO_DEFAULT_PORT,
    CONSOLE_DEFAULT_PORT,
)

_names = itertools.count()
_run_marker = pytest.StashKey[str]()
"""The controller's marker for the processes this run starts (tests/leftovers.py)."""
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
"""This process's xdist worker id (gw0, gw1, ...), or "main" when the run is serial."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def pytest_configure(config: pytest.Config) -> None:
    # A SIGTERM (CI timeout, kill) then tears the fixtures down like Ctrl-C does, so the
    # broker and moto server are stopped by PID instead of outliving the run.
    signal.signal(signal.SIGTERM, _interrupt)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started as a background job by a non-interactive shell (`.ci/run &`, a CI step),
        # the run inherits SIGINT ignored, and so would every process a test starts: the
        # tests that stop one with Ctrl-C (the getting-started page's receiver) then
        # waited their whole bound and killed it. A handled signal is reset to the default
        # in a child at exec; an ignored one is not.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if WORKER == "main":
        # Before the first process the run starts (xdist's workers too): see leftovers.py.
        config.stash[_run_marker] = leftovers.mark_this_run()
        allow_writes()  # every process the run starts writes what it compiles: bytecode.py
    if WORKER == "main" and config.getoption("numprocesses", None):
        # Under xdist, before the workers start: see tests/bytecode.py.
        compile_ahead(
            pytest_rewrites=config.getoption("assertmode") == "rewrite"
            and not config.getini("enable_assertion_pass_hook")
        )


def pytest_collection_finish(session: pytest.Session) -> None:
    # The process that runs the tests (a worker; the only one under -n 0) takes the
    # proxy's collector policy (triage_proxy/gctuning.py): with CPython's, full
    # collections walked the imported modules and the collected tests again and again,
    # 9 s of the unit tests' 96 s of CPU (3 s with it).
    set_collection_policy()
    freeze_startup_heap()


LEFTOVER_GRACE = 15.0
"""Seconds a helper that ends by itself (`leftovers.ends_alone`) gets to exit after the
last test before it is killed and named."""

FIRST_GROUPS = ("cpu-heavy", "spark-local", "typescript")
"""xdist groups (each runs on one worker, one test after another) that start the run, the
longest first: a long chain that started last would end the run alone."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The groups' order, which pyproject's `--no-loadscope-reorder` keeps: FIRST_GROUPS,
    then the other groups (modules whose module fixture is costly), then every other test
    one at a time, which fill in behind them."""

    def rank(item: pytest.Item) -> int:
        marker = item.get_closest_marker("xdist_group")
        if marker is None:
            return len(FIRST_GROUPS) + 1
        group = marker.args[0] if marker.args else marker.kwargs.get("name")
        return FIRST_GROUPS.index(group) if group in FIRST_GROUPS else len(FIRST_GROUPS)

    items.sort(key=rank)  # stable: the order within a rank stays the collection's


def hold_default_ports(held: contextlib.ExitStack) -> None:
    """Listen on every default port that is free (one already in use, e.g. by a local
    deployment or by the xdist controller, is taken anyway) until `held` closes."""
    for port in DEFAULT_PORTS:
        sock = held.enter_context(socket.socket())
        # As servers bind: a port left in TIME_WAIT by an earlier test is still held.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            continue
        sock.listen()


_controller_holds = contextlib.ExitStack()


def pytest_sessionstart(session: pytest.Session) -> None:
    # Under xdist the controller holds the default ports from the first test to the last:
    # a worker that held them would free them when it ends, while others still run.
    if WORKER == "main" and session.config.getoption("numprocesses", None):
        hold_default_ports(_controller_holds)


@pytest.hookimpl(trylast=True)  # after xdist's, which stops the workers
def pytest_sessionfinish(session: pytest.Session) -> None:
    _controller_holds.close()
    marker = session.config.stash.get(_run_marker, None)
    left = leftovers.sweep(marker, grace=LEFTOVER_GRACE) if marker else []
    if left:
        # A worker that died ran no teardown; otherwise a test or fixture leaked these.
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_sep("=", f"killed {len(left)} process(es) the run left running")
            for process in left:
                reporter.write_line(f"pid {process.pid}: {process.command[:200]}", red=True)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def default_ports_taken() -> Iterator[tuple[int, ...]]:
    """Hold every default port (see `hold_default_ports`); return the ports. Closed at
    the end of the session."""
    with contextlib.ExitStack() as held:
        hold_default_ports(held)
        yield DEFAULT_PORTS


@pytest.fixture(autouse=True)
def _integration_beside_a_deployment(request: pytest.FixtureRequest) -> None:
    """Integration tests run with the default ports taken (see the module docstring)."""
    if request.node.get_closest_marker("integration") is not None:
        request.getfixturevalue("default_ports_taken")


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as proc:
        yield proc


@pytest.fixture(scope="session")
def aws() -> Iterator[EmbeddedAWS]:
    with EmbeddedAWS() as proc:
        yield proc


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A topic/table name no other test in this session uses."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name)[:40]
    return f"{base}-{WORKER}-{next(_names)}"


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every xdist worker of this run shares (the parent of the workers' own
    temporary folders), or this session's own when the run is serial."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if WORKER != "main" else base


@pytest.fixture
def cpu_heavy(shared_dir: Path) -> Iterator[None]:
    """For a test that keeps both cores busy for long (a Spark cluster, a fault suite's
    fleet of processes): no two such tests run at once across xdist workers, so neither
    misses its deadlines because the other took the CPU. Lighter tests still run beside."""
    with shared_lock(shared_dir, "cpu-heavy"):
        yield
