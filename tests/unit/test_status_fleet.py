"""`triage status` against a local fleet: which process slots it asks (the supervisor's
record, not one per partition), and what it says when the processes answer during a
broker outage but serve nothing (not "nothing is deployed"). No broker: `gather` reads a
stub of `Sources`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from triage_cli.console.sampler import CachedSources
from triage_cli.exitcodes import ExitCode
from triage_cli.status import command as status_command
from triage_cli.status.render import render_table
from triage_cli.status.report import (
    BrokerView,
    LocalDeployment,
    ProxyView,
    Report,
    local_deployment,
    process_slots,
)
from triage_cli.status.sources import Sources, gather
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.settings import Settings

PARTITIONS = 3
BASE = 19700
REFUSED = "[Errno 111] Connection refused"
BROKER_DOWN = "broker unreachable: KafkaError{code=_TIMED_OUT}"


def make_settings() -> Settings:
    return settings_from_dict(
        {
            "kafka": {
                "bootstrap_servers": "127.0.0.1:1",
                "topic": "orders",
                "group_id": "orders-local",
                "partitions": PARTITIONS,
            },
            "auth": {"token": "0123456789abcdef"},
            "dead_letters": {"table": "dlq", "endpoint_url": "http://127.0.0.1:1"},
            "server": {"http_port": BASE},
        },
        {},
    )


def url(slot: int) -> str:
    return f"http://127.0.0.1:{BASE + slot}/status"


def fleet_doc(pid: int, served: Sequence[int], *, member: bool = True) -> dict[str, Any]:
    """A fleet process's /status (`ProcessSnapshot.to_json`), serving `served`."""
    return {
        "topic": "orders",
        "group_id": "orders-local",
        "dead_letter_table": "dlq",
        "state": "running",
        "ready": member,
        "pid": pid,
        "owner": f"owner-{pid}",
        "mode": "fleet",
        "member": member,
        "assigned": list(served),
        "served": list(served),
        "advertised_endpoint": f"127.0.0.1:{7700 + pid % 10}",
        "partitions": [
            {"partition": p, "state": "running", "ready": True, "in_flight": 0} for p in served
        ],
        "push": [],
    }


class StubSources(Sources):
    """`Sources` with canned answers: `docs[k]` is slot k's /status (None: refused)."""

    def __init__(
        self,
        docs: Sequence[Mapping[str, Any] | None],
        *,
        deployment: LocalDeployment | None = None,
        broker: BrokerView | None = None,
    ) -> None:
        self.settings = make_settings()
        self.config = "dep/triage.toml"
        self._hosts = None
        self._docs = list(docs)
        self._deployment = deployment
        self._broker = broker or BrokerView(
            committed=dict.fromkeys(range(PARTITIONS), 0),
            low=dict.fromkeys(range(PARTITIONS), 0),
            high=dict.fromkeys(range(PARTITIONS), 0),
        )
        self.asked: list[int] = []

    def close(self) -> None:
        pass

    def partitions(self) -> int:
        return PARTITIONS

    def broker(self, partitions: int) -> BrokerView:
        return self._broker

    def deployment(self) -> LocalDeployment | None:
        return self._deployment

    def ask_proxies(self, slots: int) -> list[Future[ProxyView]]:
        self.asked.append(slots)
        futures = []
        for k in range(slots):
            doc = self._docs[k] if k < len(self._docs) else None
            future: Future[ProxyView] = Future()
            view = ProxyView(url(k), doc=doc) if doc else ProxyView(url(k), error=REFUSED)
            future.set_result(view)
            futures.append(future)
        return futures

    def dead_letters(self, partitions: int) -> tuple[dict[int, int | None], str | None, bool]:
        return dict.fromkeys(range(partitions), 0), None, False

    def legacy_partitions(self, partitions: int) -> list[int]:
        return []


def text_of(report: Report) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(render_table(report))
    return console.export_text()


FLEET_OF_2 = LocalDeployment(fleet=True, slots=2, topic_partitions=3, supervisor_pid=4242)


# --- bug 1: a phantom third process ----------------------------------------------------


def test_the_supervisors_record_names_the_fleets_slots() -> None:
    """state.json as `supervisor.describe` writes it for `--proxies 2` on 3 partitions."""
    config = Path("/srv/dep/triage.toml")
    entry = {"status": "running", "restarts": 0, "last_exit": None}
    state = {
        "status": "running",
        "config": str(config),
        "supervisor_pid": 4242,
        "mode": "fleet",
        "topic_partitions": 3,
        "partitions": [],
        "proxies": [{**entry, "slot": 0, "pid": 11}, {**entry, "slot": 1, "pid": 12}],
    }
    found = local_deployment(state, config)
    assert found == FLEET_OF_2
    assert process_slots(found, PARTITIONS) == 2
    pinned = {**state, "mode": "pinned", "proxies": [], "partitions": [entry] * 3}
    assert process_slots(local_deployment(pinned, config), PARTITIONS) == 3
    assert local_deployment(state, Path("/srv/other/triage.toml")) is None  # not ours
    assert local_deployment(None, config) is None
    assert process_slots(None, PARTITIONS) == 3  # no record: one slot per partition


def test_a_fleet_of_two_on_three_partitions_has_no_phantom_third_process() -> None:
    sources = StubSources([fleet_doc(11, [0, 1]), fleet_doc(12, [2])], deployment=FLEET_OF_2)
    report = gather(sources)
    assert sources.asked == [2]
    doc = report.to_json()
    assert [p["url"] for p in doc["processes"]] == [url(0), url(1)]
    assert all(p["state"] == "running" for p in doc["processes"])
    assert doc["totals"]["proxies_down"] == doc["totals"]["processes_down"] == 0
    assert [p["proxy"] for p in doc["partitions"]] == ["running"] * 3
    assert "down" not in text_of(report)


def test_a_fleet_without_a_record_does_not_count_the_slot_above_it() -> None:
    """Processes started by hand (no state.json): slot 2 does not answer and no process
    is known to belong there."""
    report = gather(StubSources([fleet_doc(11, [0, 1]), fleet_doc(12, [2])]))
    assert [p["url"] for p in report.processes] == [url(0), url(1)]
    assert report.to_json()["totals"]["processes_down"] == 0


def test_a_killed_fleet_process_is_down_even_while_the_other_serves_everything() -> None:
    report = gather(StubSources([fleet_doc(11, [0, 1, 2]), None], deployment=FLEET_OF_2))
    doc = report.to_json()
    assert [(p["url"], p["state"]) for p in doc["processes"]] == [
        (url(0), "running"),
        (url(1), "down"),
    ]
    assert doc["totals"]["processes_down"] == 1
    assert doc["totals"]["proxies_down"] == 0  # its partitions were taken over
    assert f"process {url(1)} down: {REFUSED}" in " ".join(text_of(report).split())


def test_a_partition_no_fleet_process_serves_is_down_without_a_slots_url() -> None:
    report = gather(StubSources([fleet_doc(11, [0]), fleet_doc(12, [1])], deployment=FLEET_OF_2))
    row = report.partitions[2]
    assert (row["proxy"], row["proxy_url"]) == ("down", None)
    assert report.proxies_down == [2]
    text = " ".join(text_of(report).split())
    assert "partition 2 down: no proxy process serves partition 2" in text
    assert "proxy 2 down" not in text


def test_after_destroy_nothing_is_deployed_and_no_proxy_is_named_down() -> None:
    """`triage destroy` removed state.json and stopped every process."""
    report = gather(StubSources([None, None, None]))
    assert not report.deployed
    text = " ".join(text_of(report).split())
    assert "nothing is deployed for group 'orders-local'" in text
    assert "proxy 2 down" not in text


# --- bug 2: "nothing is deployed" during a broker outage --------------------------------

OUTAGE = BrokerView(error=BROKER_DOWN)


def outage_docs() -> list[dict[str, Any] | None]:
    """Both fleet processes after the broker froze for the session timeout: the group
    session is lost, every partition drained, the processes still answer."""
    return [fleet_doc(11, [], member=False), fleet_doc(12, [], member=False)]


@pytest.mark.parametrize("deployment", [FLEET_OF_2, None], ids=["recorded", "unrecorded"])
def test_processes_that_lost_the_group_during_an_outage_are_deployed(
    deployment: LocalDeployment | None,
) -> None:
    report = gather(StubSources(outage_docs(), deployment=deployment, broker=OUTAGE))
    assert report.deployed
    assert report.to_json()["deployed"] is True
    assert [p["member"] for p in report.processes] == [False, False]
    text = " ".join(text_of(report).split())
    assert "nothing is deployed" not in text
    assert "triage deploy" not in text
    assert "2 process(es) of this deployment answer" in text
    assert "lost the consumer group session" in text
    assert "the broker is unreachable" in text


def test_a_restarted_process_joining_the_group_is_not_said_to_have_lost_its_session() -> None:
    """Seen after `kill -9` of a fleet process: the supervisor restarted it, and until the
    group assigns it partitions it answers /status as starting, not a member."""
    joining = {**fleet_doc(13, [], member=False), "state": "starting"}
    report = gather(StubSources([joining, fleet_doc(12, [1])], deployment=FLEET_OF_2))
    text = " ".join(text_of(report).split())
    assert "partition(s) 0, 2 not served" in text, text
    assert "lost the consumer group session" not in text
    assert "1 (pid 13) started and is joining the consumer group" in text


def test_a_live_supervisor_is_a_deployment_even_when_no_process_answers() -> None:
    report = gather(StubSources([None, None], deployment=FLEET_OF_2, broker=OUTAGE))
    assert report.deployed
    text = " ".join(text_of(report).split())
    assert "nothing is deployed" not in text
    assert "the supervisor (pid 4242) of this deployment is alive" in text


@pytest.fixture
def stubbed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """`triage status` reads StubSources with the outage's answers."""
    import triage_proxy.config.loader as loader_module

    monkeypatch.setattr(loader_module, "load_settings", lambda *a, **k: make_settings())
    monkeypatch.setattr(
        status_command,
        "Sources",
        lambda *a, **k: StubSources(outage_docs(), broker=OUTAGE),
    )
    config = tmp_path / "triage.toml"
    config.write_text("")
    return config


def test_the_command_exits_unavailable_and_gives_no_deploy_advice(stubbed: Path) -> None:
    from triage_cli.main import app

    result = CliRunner().invoke(app, ["status", "--config", str(stubbed), "--json"])
    assert result.exit_code == ExitCode.UNAVAILABLE, result.output
    doc = json.loads(result.stdout)
    assert doc["deployed"] is True
    assert doc["broker_error"] == BROKER_DOWN
    assert "nothing is deployed" not in result.stderr
    table = CliRunner().invoke(app, ["status", "--config", str(stubbed)])
    assert table.exit_code == ExitCode.UNAVAILABLE
    assert "triage deploy" not in table.stdout
    assert "the broker is unreachable" in " ".join(table.stdout.split())


# --- the record is found by the config, and only while its supervisor lives -------------


def test_sources_find_the_record_only_while_its_supervisor_runs(tmp_path: Path) -> None:
    from triage_cli.supervisor import ProjectDir

    config = (tmp_path / "triage.toml").resolve()
    config.write_text("")
    # A stand-in for `triage supervise --config CONFIG`: its command line names the config.
    stand_in = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--config", str(config)]
    )
    try:
        project = ProjectDir.for_config(config)
        project.root.mkdir()
        project.write_state(
            {
                "config": str(config),
                "supervisor_pid": stand_in.pid,
                "mode": "fleet",
                "topic_partitions": 3,
                "proxies": [{"slot": 0}, {"slot": 1}],
                "partitions": [],
            }
        )
        sources = Sources(make_settings(), None)
        try:
            assert sources.deployment() is None  # no config given: no record looked for
            sources.config = str(config)
            assert sources.deployment() == LocalDeployment(
                fleet=True, slots=2, topic_partitions=3, supervisor_pid=stand_in.pid
            )
            moved = tmp_path / "elsewhere"  # `deploy --state-dir`, so `status --state-dir`
            project.root.rename(moved)
            assert sources.deployment() is None
            elsewhere = Sources(make_settings(), None, state_dir=moved)
            console = CachedSources(make_settings(), None, state_dir=moved)  # the console's
            try:
                for other in (elsewhere, console):
                    other.config = str(config)
                    assert other.deployment() is not None
            finally:
                elsewhere.close()
                console.close()
            moved.rename(project.root)
            stand_in.kill()
            stand_in.wait()
            assert sources.deployment() is None  # a dead supervisor's record
        finally:
            sources.close()
    finally:
        if stand_in.poll() is None:
            stand_in.kill()
            stand_in.wait()
