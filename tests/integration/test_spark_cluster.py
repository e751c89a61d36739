"""The Spark replay job on a real standalone cluster: a master and two workers on loopback.

Local mode runs every task in one JVM next to the driver, so it cannot show what only a
cluster does: executors that start Python from their own work directory (a relative or
unset PYSPARK_PYTHON fails there), options and results pickled across processes, and
tasks spread over several workers. The cluster is started with the pyspark package's own
`spark-class` (the pip package has no sbin/ scripts), on free ports, each worker with
one core and its own work directory, where its executors' logs show which tasks it ran.

The commands are the cluster instructions of docs/guides/spark-replay.md
(`test_the_guide_shows_these_commands` keeps the two identical); what only a test needs (no
driver UI, small heaps, waiting for both executors before the first task) lives in a
spark-defaults.conf of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import boto3
import pyspark
import pytest

from tests.conftest import SHORT_JVM_OPTIONS
from tests.integration.harness import create_topic
from tests.integration.test_spark_replay import (
    ALL_BYTES,
    config_file,
    consume,
    items,
    make_dl,
    mixed_set,
    replay_of,
    write,
)
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.store.provisioning import create_table
from triage_proxy.structs import DeadLetter

# One xdist worker runs the CPU-heavy tests one after another (--dist loadgroup), while
# the others go on with the rest; the cpu_heavy lock guards any other --dist mode.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.xdist_group("cpu-heavy")]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
"""Where pip put spark-class, spark-submit and triage: beside this interpreter."""

MASTER = (
    "{bin}/spark-class org.apache.spark.deploy.master.Master"
    " --host 127.0.0.1 --port {port} --webui-port {ui}"
)
WORKER = (
    "{bin}/spark-class org.apache.spark.deploy.worker.Worker spark://127.0.0.1:{port}"
    " --host 127.0.0.1 --cores 1 --memory 1g --webui-port {ui} --work-dir {work}"
)
ENVIRONMENT = (
    "export SPARK_LOCAL_IP=127.0.0.1"
    " SPARK_HOME=$(.venv/bin/python -c 'import pyspark; print(pyspark.__path__[0])')"
)
"""Without SPARK_HOME, pip's spark-class looks for Spark with `python3` from the PATH,
which need not be the venv's."""
SUBMIT = (
    "PYSPARK_PYTHON=$PWD/.venv/bin/python {bin}/spark-submit --master spark://127.0.0.1:{port}"
    " replay/triage_replay/job.py -c {config} --topic {topic}"
)
TRIAGE = (
    "{bin}/triage dlq replay -c {config} --topic {topic} --spark --master spark://127.0.0.1:{port}"
)
GUIDE_VALUES = {
    "bin": ".venv/bin",
    "port": "7077",
    "config": "triage.toml",
    "topic": "orders",
}
"""What the guide shows for the values a test picks (free ports, its own paths)."""
GUIDE_WORKERS = [
    {"ui": "8081", "work": "/tmp/spark-worker-1"},
    {"ui": "8082", "work": "/tmp/spark-worker-2"},
]

TEST_DEFAULTS = {
    "spark.ui.enabled": "false",  # the driver's UI would take port 4040 or the next free one
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "512m",
    "spark.executor.memory": "512m",
    # Both executors registered before the first task: otherwise the first one to start
    # may take every task, and "both workers ran tasks" would depend on timing.
    "spark.scheduler.minRegisteredResourcesRatio": "1.0",
    "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
    # Executors live for one small job: C1 only, serial GC (tests/conftest.py says why).
    "spark.executor.extraJavaOptions": SHORT_JVM_OPTIONS,
}
START_TIMEOUT_S = 90.0
RUN_TIMEOUT_S = 240.0


def argv(template: str, **values: object) -> list[str]:
    """The command of a template as the test runs it (the $PWD prefix is the env's)."""
    words = template.format(**values).split()
    return [w for w in words if not w.startswith("PYSPARK_PYTHON=")]


def stop_group(proc: subprocess.Popen[Any], timeout_s: float = 20.0) -> None:
    """Stop a process started in its own session, and everything it started (a worker's
    executors and their Python workers share its process group), by its id."""
    for signum, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
            break
    # Executors outlive their worker's exit for a moment; the group is gone only then.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.2)


def master_state(ui: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=5) as response:
        state: dict[str, Any] = json.load(response)
    return state


class Cluster:
    """A started master and workers (see the module docstring)."""

    def __init__(self, tmp: Path, workers: int) -> None:
        self.port = free_port()
        self.ui = free_port()
        self.conf_dir = tmp / "conf"
        self.conf_dir.mkdir()
        defaults = "".join(f"{key} {value}\n" for key, value in TEST_DEFAULTS.items())
        (self.conf_dir / "spark-defaults.conf").write_text(defaults)
        self.env = {
            **os.environ,
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_HOME": pyspark.__path__[0],
            "SPARK_CONF_DIR": str(self.conf_dir),
            "SPARK_DAEMON_MEMORY": "256m",
        }
        for name in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYSPARK_SUBMIT_ARGS"):
            self.env.pop(name, None)
        # As from a shell where the venv is not active: `python3` on the PATH lacks triage,
        # so an executor that falls back to it fails instead of passing by luck.
        path = self.env.get("PATH", "").split(os.pathsep)
        self.env["PATH"] = os.pathsep.join(d for d in path if Path(d).resolve() != BIN.resolve())
        self.env.pop("VIRTUAL_ENV", None)
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.work_dirs = [tmp / f"worker-{n + 1}" for n in range(workers)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        self._daemon("master", argv(MASTER, bin=BIN, port=self.port, ui=self.ui))
        self._wait(lambda state: state.get("status") == "ALIVE", "the master")
        for n, work in enumerate(self.work_dirs):
            work.mkdir()
            command = argv(WORKER, bin=BIN, port=self.port, ui=free_port(), work=work)
            self._daemon(f"worker-{n + 1}", command)
        self._wait(lambda state: state.get("aliveworkers") == len(self.work_dirs), "both workers")

    def stop(self) -> None:
        for proc in reversed(self.procs):  # workers (and their executors) first
            stop_group(proc)

    def _daemon(self, name: str, command: list[str]) -> None:
        with open(self.logs / f"{name}.log", "ab") as log:
            self.procs.append(
                subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=self.env,
                    cwd=self.logs,
                    start_new_session=True,
                )
            )

    def _wait(self, ready: Any, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for proc in self.procs:
                assert proc.poll() is None, f"{proc.args!r} exited: {self.log_tail()}"
            with contextlib.suppress(OSError, ValueError):
                if ready(master_state(self.ui)):
                    return
            time.sleep(0.5)
        raise AssertionError(f"{what} not up after {START_TIMEOUT_S}s: {self.log_tail()}")

    def log_tail(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
            for path in sorted(self.logs.glob("*.log"))
        )

    def run(self, command: list[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
        """A client command (spark-submit, triage) from the checkout, as the guide runs it;
        its process group (driver JVM and Python) is killed if it outlives RUN_TIMEOUT_S."""
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env),
            cwd=REPO,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            out, err = proc.communicate()
            raise AssertionError(f"{command} ran over {RUN_TIMEOUT_S}s:\n{err[-5000:]}") from None
        finally:
            stop_group(proc)
        return subprocess.CompletedProcess(command, proc.returncode, out, err)

    def tasks_by_worker(self, app_id: str) -> list[int]:
        """Tasks each worker's executors ran for the application (from their logs)."""
        counts = []
        for work in self.work_dirs:
            logs = (work / app_id).glob("*/stderr")
            counts.append(sum(p.read_text(errors="replace").count("Running task") for p in logs))
        return counts


@pytest.fixture
def cluster(tmp_path: Path, cpu_heavy: None) -> Iterator[Cluster]:
    """A master and two workers, started while no other CPU-heavy test runs (conftest)."""
    started = Cluster(tmp_path, workers=2)
    try:
        started.start()
        yield started
    finally:
        started.stop()


def dead_letters(topic: str) -> list[DeadLetter]:
    """The byte-exactness set, and ten more in each of four partitions: several items
    (partition keys) for the parallel scan to spread over its segments."""
    spread = [
        make_dl(topic, p, o, key=f"k{p}-{o}".encode(), value=ALL_BYTES[o:] * (p + 1))
        for p in range(4)
        for o in range(100, 110)
    ]
    return [*mixed_set(topic), *spread]


SUMMARY = re.compile(r"replay (\S+): read=(\d+) selected=(\d+) replayed=(\d+) skipped=(\d+)")


def summary_line(stdout: str) -> dict[str, Any]:
    found = SUMMARY.search(stdout)
    assert found is not None, stdout
    replay_id, *counts = found.groups()
    return dict(zip(("read", "selected", "replayed", "skipped"), map(int, counts), strict=True)) | {
        "replay_id": replay_id
    }


def completed_apps(cluster: Cluster) -> list[str]:
    """Ids of the finished applications, oldest first."""
    apps = master_state(cluster.ui)["completedapps"]
    return [app["id"] for app in sorted(apps, key=lambda app: app["starttime"])]


def test_replay_on_a_standalone_cluster_with_two_workers(
    cluster: Cluster,
    broker: EmbeddedBroker,
    aws: EmbeddedAWS,
    unique_name: str,
    tmp_path: Path,
) -> None:
    topic = unique_name
    create_topic(broker.bootstrap, topic, partitions=4)
    table = DeadLetterSettings(table=unique_name, endpoint_url=aws.endpoint_url)
    create_table(table)
    dls = dead_letters(topic)
    dynamodb = boto3.client(
        "dynamodb",
        endpoint_url=aws.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    write(dynamodb, table.table, dls)
    config = config_file(tmp_path / "triage.toml", broker.bootstrap, table, topic)
    values = {"bin": BIN, "port": cluster.port, "config": config, "topic": topic}

    # spark-submit, with PYSPARK_PYTHON an absolute path as the guide exports it
    submit_env = {**cluster.env, "PYSPARK_PYTHON": str(BIN / "python")}
    started = time.monotonic()
    submitted = cluster.run(argv(SUBMIT, **values), submit_env)
    submit_s = time.monotonic() - started

    assert submitted.returncode == 0, submitted.stderr[-5000:]
    first = summary_line(submitted.stdout)
    assert (first["selected"], first["replayed"], first["skipped"]) == (46, 46, 0), first
    messages = consume(broker.bootstrap, topic, 4, expected=46)
    by_origin = {replay_of(m): m for m in messages}
    assert len(messages) == len(by_origin) == 46
    for dl in dls:
        record = dl.record
        origin = f"{record.topic}/{record.partition}/{record.offset}"
        msg = by_origin[origin]
        assert (msg.partition(), msg.key(), msg.value()) == (
            record.partition,
            record.key,
            record.value,
        )
        assert (msg.headers() or []) == [
            *record.headers,
            ("triage-replay-of", origin.encode()),
            ("triage-replay-reason", dl.reason.encode()),
            ("triage-replay-id", first["replay_id"].encode()),
        ]
    stored = items(dynamodb, table.table)
    assert {item["status"]["S"] for item in stored.values()} == {"replayed"}
    assert {item["replay_id"]["S"] for item in stored.values()} == {first["replay_id"]}

    # `triage dlq replay --spark` with no PYSPARK_PYTHON: it must give the executors its own
    # interpreter (the default `python3` on their PATH has no triage)
    assert "PYSPARK_PYTHON" not in cluster.env
    started = time.monotonic()
    rerun = cluster.run(argv(TRIAGE, **values), cluster.env)
    rerun_s = time.monotonic() - started

    assert rerun.returncode == 0, rerun.stderr[-5000:]
    second = summary_line(rerun.stdout)
    assert (second["selected"], second["replayed"], second["skipped"]) == (46, 0, 46), second
    assert len(consume(broker.bootstrap, topic, 4, expected=46)) == 46

    apps = completed_apps(cluster)
    assert len(apps) == 2, apps
    tasks = [cluster.tasks_by_worker(app) for app in apps]
    print(f"spark-submit {submit_s:.1f}s, triage {rerun_s:.1f}s, tasks per worker {tasks}")
    for app, per_worker in zip(apps, tasks, strict=True):
        assert all(n > 0 for n in per_worker), (app, per_worker, cluster.log_tail())


def guide_cluster_block() -> str:
    text = (REPO / "docs" / "guides" / "spark-replay.md").read_text()
    section = text[text.index("## On a standalone cluster") :]
    return section[: section.index("\n## ", 1)]


def test_the_guide_shows_these_commands() -> None:
    """The guide's cluster instructions are the commands the cluster test runs."""
    block = guide_cluster_block()
    lines = [
        ENVIRONMENT,
        MASTER.format(**GUIDE_VALUES, ui="8080"),
        *(WORKER.format(**GUIDE_VALUES, **worker) for worker in GUIDE_WORKERS),
        SUBMIT.format(**GUIDE_VALUES),
        TRIAGE.format(**GUIDE_VALUES),
    ]
    shown = {" ".join(line.rstrip(" &\\").split()) for line in _joined_lines(block)}
    for line in lines:
        assert line in shown, f"docs/guides/spark-replay.md's cluster section lacks: {line}"


def _joined_lines(block: str) -> Sequence[str]:
    """The shell lines of a docs section, continuation lines joined."""
    out: list[str] = []
    pending = ""
    for raw in block.splitlines():
        line = raw.strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    return out
