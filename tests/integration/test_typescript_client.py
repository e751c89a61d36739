"""The TypeScript client (clients/typescript) against real parts: its own `node --test` suite,
then its conformance command and its example consumer against real proxies, Tansu and moto.

Node.js 20 and npm are on every machine this suite runs on: a missing `node` or `npm` fails
here with a clear message instead of skipping.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import (
    TOKEN,
    RawConsumer,
    await_until,
    committed,
    create_topic,
    dead_letters,
    produce,
    settings_for,
    target,
    wait_until,
)
from tests.runlock import TS_INSTALLED, TS_PACKAGE_LOCK, shared_lock
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_conformance import ACTION_HEADER
from triage_conformance.scenarios import SCENARIOS
from triage_proxy.app import Proxy

# One xdist worker runs the TypeScript tests (--dist loadgroup): it installs and builds the
# package once while the other workers go on with the rest instead of waiting for it.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("typescript")]

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "clients" / "typescript"
ADAPTER = PACKAGE / "dist" / "conformance.js"
EXAMPLE = PACKAGE / "examples" / "consumer.js"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not on PATH: the TypeScript client's tests need Node.js 20 and npm "
            "(install them; this suite does not skip without them)"
        )
    return path


def npm(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run npm in its own process group, killed whole on timeout (npm starts a shell that
    starts node: killing npm alone left a hung `node --test` running). The timeout stays
    under pytest-timeout's 300 s so this kill, not pytest's, ends a hang."""
    return in_package([tool("npm"), *args], timeout)


def in_package(command: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run `command` in the package as `npm` (above) does."""
    proc = subprocess.Popen(
        command,
        cwd=PACKAGE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={
            **os.environ,
            "npm_config_fund": "false",
            "npm_config_audit": "false",
            # `npm test` drives the repo's fake proxy (tests/fakeproxy.py): this interpreter
            # has its dependencies.
            "TRIAGE_PYTHON": sys.executable,
        },
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{shlex.join(command)} ran past {timeout} s:\n{out[-6000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def build_once(shared_dir: Path) -> None:
    """The package with its dependencies installed (`npm ci` when node_modules is missing)
    and compiled (dist/), once per run: the first xdist worker to need it builds while the
    others wait (tests/runlock.py), and nothing writes dist/ after that. Takes the lock
    itself: call it without holding TS_PACKAGE_LOCK."""
    done = shared_dir / "typescript-built"
    if not done.exists():
        with shared_lock(shared_dir, TS_PACKAGE_LOCK):
            if not (PACKAGE / "node_modules" / "typescript" / "bin" / "tsc").is_file():
                out = npm("ci", timeout=290)
                assert out.returncode == 0, out.stdout + out.stderr
            (shared_dir / TS_INSTALLED).touch()
            if not done.exists():
                out = npm("run", "build")
                assert out.returncode == 0, out.stdout + out.stderr
                done.touch()
    assert ADAPTER.is_file()


@pytest.fixture(scope="module")
def built(shared_dir: Path) -> Path:
    """The package installed and compiled for this run (`build_once`)."""
    tool("node")
    build_once(shared_dir)
    return PACKAGE


ALONE = [name for name in SCENARIOS if name != "side-by-side"]
"""The kit's scenarios the TypeScript client runs on its own (side-by-side runs beside the
Python client, below)."""


def run_kit(work_dir: Path, *args: str) -> str:
    """`python -m triage_conformance --client <the TypeScript adapter> ARGS`: its report,
    asserted to pass every scenario it ran with lost 0 (the kit starts and stops its own
    stack by PID)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "conformance"), str(ROOT)])}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "triage_conformance",
            "--client",
            shlex.join([tool("node"), str(ADAPTER)]),
            "--work-dir",
            str(work_dir),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, f"{report}\n(client logs under {work_dir}/clients)"
    assert "FAIL" not in report, report
    assert "lost 0" in report, report
    return report


@pytest.mark.slow
def test_the_typescript_client_passes_the_conformance_kit(built: Path, tmp_path: Path) -> None:
    """Every scenario but side-by-side, on two partitions: the client finds them with
    Topology discovery and drains both streams at SIGTERM."""
    report = run_kit(
        tmp_path, "--partitions", "2", *(arg for name in ALONE for arg in ("--scenario", name))
    )
    for name in ALONE:
        assert f"PASS  {name}" in report, report


@pytest.mark.slow
def test_the_typescript_and_python_clients_share_the_work(built: Path, tmp_path: Path) -> None:
    """The kit's side-by-side with a TypeScript and a Python instance on one deployment:
    both handle some, nothing is handled twice or lost."""
    peer = shlex.join([sys.executable, "-m", "triage_conformance.python_client"])
    report = run_kit(tmp_path, "--peer", peer, "--scenario", "side-by-side")
    assert "PASS  side-by-side" in report, report


def test_the_typescript_unit_suite_passes(built: Path) -> None:
    """`npm test`: builds, then `node --test` against the shared fake proxy. `built` ran
    the build (`npm run build`, its first half) once for the run; a second build here
    would rewrite dist/ while other workers' tests run what it holds: this runs the rest."""
    script = json.loads((PACKAGE / "package.json").read_text())["scripts"]["test"]
    build, _, rest = script.partition(" && ")
    assert build == "npm run build", f"`npm test` is {script!r}: update this test"
    out = in_package(["sh", "-c", rest])
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert re.search(r"\bfail 0\b", out.stdout), out.stdout[-3000:]


class NodeProcess:
    """A node command run with the kit's environment; its JSON lines collected as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, *args: str, env: dict[str, str]) -> NodeProcess:
        proc = await asyncio.create_subprocess_exec(
            tool("node"),
            *args,
            cwd=PACKAGE,
            env={**os.environ, **env},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            line = raw.decode()
            self.lines.append(line)
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def started(self, partition: int) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "start" and e["partition"] == partition]

    def outcomes(self, partition: int) -> dict[int, str]:
        """offset -> its last settled outcome."""
        return {
            e["offset"]: e["outcome"]
            for e in self.events
            if e["event"] == "settled" and e["partition"] == partition
        }

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> tuple[int, str]:
        """Signal, wait for exit; (exit code, stderr)."""
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        assert self.proc.stderr is not None
        try:
            err = await asyncio.wait_for(self.proc.stderr.read(), timeout)
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            raise
        await self._reader
        return code, err.decode()

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


@pytest.fixture
def nodes() -> Iterator[list[NodeProcess]]:
    """Node processes a test started: killed at teardown if still running."""
    started: list[NodeProcess] = []
    yield started
    for node in started:
        node.kill()


def adapter_env(endpoint: str, token: str = TOKEN, concurrency: int = 8) -> dict[str, str]:
    return {
        "TRIAGE_ENDPOINT": endpoint,
        "TRIAGE_TOKEN": token,
        "TRIAGE_CONSUMER_ID": "ts-conformance",
        "TRIAGE_CONCURRENCY": str(concurrency),
    }


def b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def workload(partition: int, n: int) -> list[Any]:
    """Acks with null or empty keys and values and binary headers; poison, retry and one
    handler that outlives the 2 s ack deadline."""
    out: list[Any] = []
    for i in range(n):
        action = b"ack"
        if i % 10 == 3:
            action = b"fail"
        elif i % 10 == 5:
            action = b"retry"
        elif i == 7:
            action = b"sleep:2500"
        key = None if i % 3 == 0 else (b"" if i % 3 == 1 else bytes([partition, i, 0, 255]))
        value: bytes | None = None if i % 4 == 2 and action == b"ack" else b"v\xff\x00-%d" % i
        if action == b"fail":
            value = "poison \u00e9 %d-%d".encode() % (partition, i)
        headers = [(ACTION_HEADER, action), ("bin", bytes([0, 1, 255, i % 256])), ("none", None)]
        out.append((key, value, headers))
    return out


def test_the_conformance_command_consumes_a_topic_with_nothing_lost(
    built: Path,
    broker: EmbeddedBroker,
    aws: EmbeddedAWS,
    unique_name: str,
    nodes: list[NodeProcess],
) -> None:
    """Two partitions through one Consumer (Topology discovery): every offset acked or
    dead-lettered (lost = 0), poison dead-lettered with `Error: <value>`, Retry redelivered
    until it acks, a handler past the ack deadline kept alive by Extend, bytes exact, and
    SIGTERM drains to exit 0."""
    create_topic(broker.bootstrap, unique_name, partitions=2)
    settings = settings_for(
        broker,
        aws,
        unique_name,
        # A lease shorter than the slow handler's 2.5 s, so only Extends keep it; 2 s
        # rather than 1 s leaves an Extend room for a loaded machine's stalls.
        delivery={"ack_deadline_s": 2.0, "redelivery_span_s": 0},
        retry={"initial_backoff_s": 0.05, "max_backoff_s": 0.2},
    )
    n = 40
    sent = {p: workload(p, n) for p in range(2)}
    for p in range(2):
        produce(broker.bootstrap, unique_name, sent[p], partition=p)

    async def scenario() -> tuple[NodeProcess, int, str]:
        async with Proxy(settings, 0) as p0, Proxy(settings, 1):
            node = await NodeProcess.start(str(ADAPTER), env=adapter_env(target(p0)))
            nodes.append(node)

            def all_committed() -> bool:
                return all(
                    committed(broker.bootstrap, settings.kafka.group_id, unique_name, p) == n
                    for p in range(2)
                )

            done = await await_until(
                lambda: all(len(node.outcomes(p)) == n for p in range(2)), timeout=90
            )
            assert done, {p: len(node.outcomes(p)) for p in range(2)}
            assert await asyncio.to_thread(wait_until, all_committed, 60), "commits lag"
            code, err = await node.stop()
            return node, code, err

    node, code, err = asyncio.run(scenario())
    assert code == 0, err
    letters = dead_letters(settings)
    for p in range(2):
        outcomes = node.outcomes(p)
        poison = {i for i in range(n) if i % 10 == 3}
        assert {o for o, what in outcomes.items() if what == "nack"} == poison
        assert all(outcomes[i] == "ack" for i in range(n) if i not in poison)
        dead = {d.record.offset: d for d in letters if d.record.partition == p}
        assert set(dead) == poison, "lost = 0: every other offset was acked"
        for offset, letter in dead.items():
            assert letter.reason == "Error: " + sent[p][offset][1].decode()
            assert letter.consumer_id == "ts-conformance"
        starts = node.started(p)
        for event in starts:
            key, value, headers = sent[p][event["offset"]]
            assert event["key"] == b64(key)
            assert event["value"] == b64(value)
            assert event["headers"] == [[name, b64(v)] for name, v in headers]
        attempts = {e["offset"]: e["attempt"] for e in starts}
        for i in range(n):
            if i % 10 == 5:
                assert attempts[i] == 3, "Retry redelivers until the handler acks at attempt 3"
        slow = [e for e in starts if e["offset"] == 7]
        assert [e["attempt"] for e in slow] == [1], "Extend kept the 2.5 s handler's 2 s lease"
    assert stopped_stats(err)["extended"] > 0, err


def stopped_stats(stderr: str) -> dict[str, Any]:
    """The stats the conformance command prints on stderr when it stopped cleanly."""
    stats: dict[str, Any] = json.loads(stderr.rsplit("stopped, ", 1)[1])
    return stats


def test_frames_of_many_4000_byte_records_do_not_break_the_stream(
    built: Path,
    broker: EmbeddedBroker,
    aws: EmbeddedAWS,
    topic: str,
    nodes: list[NodeProcess],
) -> None:
    """The issue's trap: 2,048 credits of 4,000-byte records make Deliveries frames over
    gRPC's default 4 MiB; the client's 64 MiB limit takes them without a reconnect."""
    settings = settings_for(broker, aws, topic)
    n = 1500
    produce(broker.bootstrap, topic, ((None, b"x" * 4000, None) for _ in range(n)))

    async def scenario() -> tuple[NodeProcess, int, str]:
        async with Proxy(settings, 0) as proxy:
            node = await NodeProcess.start(
                str(ADAPTER), env=adapter_env(target(proxy), concurrency=1024)
            )
            nodes.append(node)
            assert await await_until(lambda: len(node.outcomes(0)) == n, timeout=60)
            code, err = await node.stop()
            return node, code, err

    node, code, err = asyncio.run(scenario())
    assert code == 0, err
    assert all(e["attempt"] == 1 for e in node.started(0))
    stats = stopped_stats(err)
    assert stats["reconnects"] == 0, err
    assert stats["delivered"] == n


def test_a_wrong_token_exits_non_zero_saying_authentication(
    built: Path,
    broker: EmbeddedBroker,
    aws: EmbeddedAWS,
    topic: str,
    nodes: list[NodeProcess],
) -> None:
    settings = settings_for(broker, aws, topic)

    async def scenario() -> tuple[int, str]:
        async with Proxy(settings, 0) as proxy:
            node = await NodeProcess.start(
                str(ADAPTER), env=adapter_env(target(proxy), token="wrong-token")
            )
            nodes.append(node)
            assert node.proc.stderr is not None
            err = await asyncio.wait_for(node.proc.stderr.read(), 20)
            code = await asyncio.wait_for(node.proc.wait(), 20)
            # The proxy still serves a client with the right token.
            async with RawConsumer(target(proxy)) as raw:
                frame = await asyncio.wait_for(raw.read(), 10)
                assert frame.WhichOneof("frame") == "welcome"
            return code, err.decode()

    code, err = asyncio.run(scenario())
    assert code != 0
    assert "authentication" in err.lower(), err


def test_the_example_consumer_dead_letters_what_is_not_json(
    built: Path,
    broker: EmbeddedBroker,
    aws: EmbeddedAWS,
    topic: str,
    nodes: list[NodeProcess],
) -> None:
    settings = settings_for(broker, aws, topic)
    orders: list[Any] = [(None, json.dumps({"order": i}).encode(), None) for i in range(30)]
    orders[11] = (b"k", b"not json {", [("h", b"\x00")])
    produce(broker.bootstrap, topic, orders)

    async def scenario() -> tuple[int, str, str]:
        async with Proxy(settings, 0) as proxy:
            node = await NodeProcess.start(
                str(EXAMPLE),
                "--endpoint",
                target(proxy),
                "--concurrency",
                "4",
                "--id",
                "ts-example",
                env={"TRIAGE_TOKEN": TOKEN},
            )
            nodes.append(node)
            assert await asyncio.to_thread(
                wait_until,
                lambda: committed(broker.bootstrap, settings.kafka.group_id, topic) == len(orders),
                60,
            )
            code, err = await node.stop()
            return code, err, "".join(node.lines)

    code, err, out = asyncio.run(scenario())
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["handled"] == len(orders) - 1
    assert summary["nacked"] == 1
    letters = dead_letters(settings)
    assert [d.record.offset for d in letters] == [11]
    assert letters[0].reason.startswith("SyntaxError: ")
    assert letters[0].consumer_id == "ts-example"
    assert letters[0].record.value == b"not json {"
    assert list(letters[0].record.headers) == [("h", b"\x00")]


def test_a_handler_that_never_settles_is_extended_then_redelivered_after_a_kill(
    built: Path,
    broker: EmbeddedBroker,
    aws: EmbeddedAWS,
    topic: str,
    nodes: list[NodeProcess],
) -> None:
    """Bad input: a hanging handler keeps its 1 s lease (Extend) for as long as its process
    lives; once the process is killed, the message goes to the next instance. The kill cost
    it no attempt: it was not an isolated delivery the process had reported started (the
    client's Hello sets `isolation`), so it comes back a suspect with attempt 1 again."""
    settings = settings_for(broker, aws, topic, delivery={"ack_deadline_s": 1.0})
    produce(broker.bootstrap, topic, [(None, b"hangs", [(ACTION_HEADER, b"hang")])])

    async def scenario() -> tuple[list[int], list[int]]:
        async with Proxy(settings, 0) as proxy:
            first = await NodeProcess.start(str(ADAPTER), env=adapter_env(target(proxy)))
            nodes.append(first)
            assert await await_until(lambda: len(first.started(0)) == 1, timeout=30)
            # Three and a half ack deadlines of Extends (one every third of the deadline):
            # a lease that lapsed meanwhile is counted expired and its record redelivered.
            assert await await_until(lambda: proxy.snapshot().counters["extended"] >= 11, 60)
            assert proxy.snapshot().counters["expired"] == 0
            held = [e["attempt"] for e in first.started(0)]
            first.proc.send_signal(signal.SIGKILL)
            await first.proc.wait()
            second = await NodeProcess.start(str(ADAPTER), env=adapter_env(target(proxy)))
            nodes.append(second)
            assert await await_until(lambda: len(second.started(0)) == 1, timeout=30)
            again = [e["attempt"] for e in second.started(0)]
            second.kill()
            await second.proc.wait()
            return held, again

    held, again = asyncio.run(scenario())
    assert held == [1], "extended: never redelivered while its process lived"
    assert again == [1]
