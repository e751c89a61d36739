"""The `triage` command as a user runs it: real processes, real signals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest

from tests.integration.harness import (
    TOKEN,
    RawConsumer,
    committed,
    create_topic,
    produce,
    wait_until,
)
from tests.perf.cpumeter import reaped_children_cpu
from triage_cli.devstack import write_config
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, wait_for_port
from triage_protocol import triage_pb2 as pb
from triage_protocol import triage_pb2_grpc as pb_grpc
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.store.provisioning import create_table

pytestmark = pytest.mark.integration

TRIAGE = [sys.executable, "-m", "triage_cli.main"]


def run_triage(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TRIAGE, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_help_is_instant() -> None:
    # The child's CPU time, not the wall clock: on 2 loaded cores (4 test workers beside
    # other work) a child can wait for a core longer than it runs.
    before = reaped_children_cpu()
    out = run_triage("--help")
    used = reaped_children_cpu() - before
    assert out.returncode == 0
    assert "proxy" in out.stdout
    assert "dev" in out.stdout
    assert used < 5


def test_a_command_parses_its_options_without_pydantic(tmp_path: Path) -> None:
    """typer 0.29 builds a pydantic TypeAdapter per option at every start, about 0.1 s of
    CPU before a command or a proxy does its work (tests/perf/bench_start.py), which is
    why pyproject.toml keeps typer below it: a typer that does so again fails here."""
    config = tmp_path / "triage.toml"
    write_config(
        config,
        {
            "kafka": {"bootstrap_servers": "127.0.0.1:9", "topic": "t", "group_id": "g"},
            "auth": {"token": TOKEN},
            "dead_letters": {"table": "dlq", "endpoint_url": "http://127.0.0.1:9"},
        },
    )
    config.chmod(0o600)
    script = (
        "import runpy, sys\n"
        "sys.argv = ['triage', 'config', 'check', '--config', sys.argv[1]]\n"
        "try:\n"
        "    runpy.run_module('triage_cli.main', run_name='__main__')\n"
        "except SystemExit as stop:\n"
        "    print('exit', stop.code, file=sys.stderr)\n"
        "print('pydantic' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "exit 0" in out.stderr, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("[kafka\n", "not valid TOML"),
        ('[kafka]\ntopic = "t"\ngroup_id = "g"\n', "kafka.bootstrap_servers"),
        (
            '[kafka]\nbootstrap_servers = "b"\ntopic = "t"\ngroup_id = "g"\n'
            '[auth]\ntoken = "x"\n[dead_letters]\ntable = "dlq"\n[window]\nmax_messages = "many"\n',
            "window.max_messages",
        ),
    ],
)
def test_malformed_config_exits_2_naming_the_key(tmp_path: Path, body: str, needle: str) -> None:
    path = tmp_path / "triage.toml"
    path.write_text(body)
    out = run_triage("proxy", "--config", str(path), "--partition", "0")
    assert out.returncode == 2
    assert needle in out.stderr


def _config(tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, topic: str) -> Path:
    table = f"dlq-{topic}"
    create_table(DeadLetterSettings(table=table, endpoint_url=aws.endpoint_url))
    path = tmp_path / "triage.toml"
    write_config(
        path,
        {
            "kafka": {
                "bootstrap_servers": broker.bootstrap,
                "topic": topic,
                "group_id": f"g-{topic}",
            },
            "server": {"host": "127.0.0.1", "port": free_port(), "http_port": 0},
            "auth": {"token": TOKEN},
            "dead_letters": {"table": table, "endpoint_url": aws.endpoint_url},
            "shutdown": {"drain_timeout_s": 20},
        },
    )
    return path


def test_config_file_is_private(
    tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    path = _config(tmp_path, broker, aws, unique_name)
    assert path.stat().st_mode & 0o777 == 0o600


def test_sigterm_drains_in_flight_work_commits_and_exits_0(
    tmp_path: Path, broker: EmbeddedBroker, aws: EmbeddedAWS, unique_name: str
) -> None:
    topic = unique_name
    create_topic(broker.bootstrap, topic)
    produce(broker.bootstrap, topic, [(None, b"v%d" % i, None) for i in range(6)])
    path = _config(tmp_path, broker, aws, topic)
    port = int(path.read_text().split("port = ")[1].split()[0])
    proc = subprocess.Popen(
        [*TRIAGE, "proxy", "--verbose", "--config", str(path), "--partition", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    draining = threading.Event()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if b"fetcher stopped" in line:  # DEBUG: the drain's first step is done
                draining.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        wait_for_port("127.0.0.1", port, 30, proc)

        async def scenario() -> None:
            async with RawConsumer(f"127.0.0.1:{port}", credits=6) as consumer:
                got = await consumer.receive(6)
                proc.send_signal(signal.SIGTERM)
                # Fetching has stopped, and the stream stays open for the work in flight: a
                # probe Settle (an offset never held) is still answered, not the stream ended.
                assert await asyncio.to_thread(draining.wait, 30), "no drain logged"
                consumer.settle(acks=[10**9])
                try:
                    frame = await asyncio.wait_for(consumer.read(), 15)
                except EOFError:
                    pytest.fail("the proxy ended the stream while work was in flight")
                assert list(frame.rejected.offsets) == [10**9]
                assert proc.poll() is None  # still draining: work is in flight
                consumer.settle(acks=[d.offset for d in got])
                for _ in range(100):
                    if proc.poll() is not None:
                        break
                    await asyncio.sleep(0.1)

        asyncio.run(scenario())
        assert proc.wait(30) == 0
        assert committed(broker.bootstrap, f"g-{topic}", topic) == 6
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
        if proc.stderr:
            proc.stderr.close()


def test_dev_json_prints_one_line_and_stops_everything_on_sigterm(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*TRIAGE, "dev", "--json", "--partitions", "2", "--state-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        info = json.loads(line)
        assert set(info) == {
            "bootstrap",
            "dynamodb_endpoint",
            "topic",
            "table",
            "token",
            "config",
            "endpoint",
            "proxies",
            "push",
            "console",
        }
        assert info["push"] == []  # no --push
        assert info["console"] is None  # no --console
        assert [p["partition"] for p in info["proxies"]] == [0, 1]
        for proxy in info["proxies"]:  # where the runbooks look first
            with urllib.request.urlopen(proxy["http"] + "/status", timeout=60) as answer:
                assert answer.status == 200
                assert json.loads(answer.read())["partitions"], proxy
        assert info["endpoint"] == info["proxies"][0]["target"]  # what a Consumer is given
        assert Path(info["config"]).is_file()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 4  # broker, moto, two proxies

        async def consume_one() -> None:
            async with RawConsumer(info["proxies"][1]["target"], token=info["token"]) as c:
                assert (await c.read()).WhichOneof("frame") == "welcome"
            # The one endpoint finds every partition's proxy.
            async with grpc.aio.insecure_channel(info["endpoint"]) as channel:
                stub = pb_grpc.TriageStub(channel)
                auth = [("authorization", f"Bearer {info['token']}")]
                reply = await stub.Topology(pb.TopologyRequest(), metadata=auth)
            assert reply.complete, reply.problem
            assert [r.endpoint for r in reply.partitions] == [p["target"] for p in info["proxies"]]

        asyncio.run(consume_one())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_until(lambda: not any(c.is_running() for c in children), timeout=10)
        assert proc.stdout.read() == ""  # exactly one line on stdout
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()


def test_dev_stops_everything_on_a_second_ctrl_c_during_the_first(tmp_path: Path) -> None:
    """Ctrl-C twice, as an impatient person does: the second one came while the first was
    stopping the stack, cut the stop short, and left the broker and moto server running
    with nobody to stop them."""
    proc = subprocess.Popen(
        [*TRIAGE, "dev", "--json", "--state-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    children: list[psutil.Process] = []
    try:
        assert proc.stdout is not None
        json.loads(proc.stdout.readline())
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 3  # broker, moto, a proxy
        proxies = [c for c in children if "proxy" in c.cmdline()]
        assert len(proxies) == 1, [c.cmdline() for c in children]
        proc.send_signal(signal.SIGINT)
        # The second once the stop is underway: the proxy goes first, then moto and Tansu.
        assert wait_until(lambda: not proxies[0].is_running(), timeout=60, interval=0.005)
        proc.send_signal(signal.SIGINT)
        # 0 once it waits for a signal; 130 (interrupted) when the first came just before
        assert proc.wait(60) in (0, 130)
        assert wait_until(lambda: not any(c.is_running() for c in children), timeout=30), [
            c.cmdline() for c in children if c.is_running()
        ]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        for child in children:  # what the bug left, orphaned
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()


def test_dev_console_serves_the_stack_and_stops_with_it(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [*TRIAGE, "dev", "--json", "--console", "--console-port", "0",
         "--state-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        url = info["console"]
        assert url.startswith("http://127.0.0.1:")
        assert "?token=" in url
        children = psutil.Process(proc.pid).children(recursive=True)

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args: object, **kwargs: object) -> None:
                return None

        opener = urllib.request.build_opener(NoRedirect)
        with pytest.raises(urllib.error.HTTPError) as login:
            opener.open(url, timeout=60)
        assert login.value.code == 302
        cookie = login.value.headers["Set-Cookie"]
        login.value.close()
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        overview = urllib.request.Request(
            url.split("/?", 1)[0] + "/api/overview",
            headers={"Cookie": cookie.split(";", 1)[0]},
        )
        with urllib.request.urlopen(overview, timeout=60) as answer:
            assert json.loads(answer.read())["deployment"]["topic"] == info["topic"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_until(lambda: not any(c.is_running() for c in children), timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
