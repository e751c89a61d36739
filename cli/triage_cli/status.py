"""`triage status`: is every partition keeping up? One row per partition.

    triage status --config F [--watch [--interval S]] [--json] [--host H] [--target aws]

Each row joins three sources, so one that is down costs only its own columns:

- the broker (a confluent-kafka client): the group's committed offset and the log end
  (high watermark); lag = log end - committed (log end - low watermark when nothing is
  committed yet). The partition count is `kafka.partitions`, else the topic's metadata.
- each proxy process's `/status` (`server.http_host`, or `--host`, at `server.http_port + k`
  for each process slot k; `process_slots` says which). A local deployment's record
  (`.triage/state.json` next to the config, written by its supervisor) names its slots:
  a fleet's N processes, or one per partition; each recorded slot is a process that
  should run, so one that does not answer is down. Without a record (processes started
  by hand, or on another host) slots 0..partitions-1 are asked, and in a fleet a slot
  above the last one answering is no process of it. A process lists the partitions it
  runs (`partitions`); a partition's row comes from the process that serves it
  (`served_by`: its pid, owner id and endpoint), so a fleet shows which process serves
  which partition. A partition no process lists is down. With
  `--target aws` the processes are the deployment's running ECS tasks (`aws.fleet_hosts`),
  each asked at `server.http_port` on its private IP. Per row:
  state, the endpoint it advertises to consumers (`server.advertised_*`, what the lease
  item and Topology carry), in-flight, connected instances, oldest unsettled age, dead
  letters still being
  written, and what is degraded: a dead letter that can never be written is named with
  its offset (where the commit waits) and the fix. A proxy that does not answer is shown
  as down. Its log end also raises the
  broker's (Tansu's high watermark can trail what was fetched, see DESIGN.md).
- the dead-letter table: this deployment's (`kafka.group_id`) items of the partition
  with `status = pending`; another app's dead letters on the same topic are not counted.

Push targets (`[[push]]`) get a second table, only when a process lists any: one row per
target per process (a process delivers the records of its own partitions), from its
/status `push` list: limit, in flight, p50/p99 latency, responses by class, errors, and
state ("ok", or why delivery waits, e.g. an outage). `--json` has them under `push`.

Only this config's processes count: a process that answers at one of its ports for
another topic, group or dead-letter table (`/status` names them) is another deployment's,
and its partition is down; when no process of this deployment answers and no supervisor
of it is alive, the report says plainly that nothing is deployed for it (and which
deployment answers instead). Processes that answer but serve no partition (during a
broker outage a fleet's processes lose their group session and drain everything) are
said to be so, with the broker's error, not taken for an absent deployment.

Exit codes (`exitcodes.ExitCode`): 0 every proxy answered; 1 some proxy (or recorded
process) is down, or nothing is deployed (the report is still printed); 2 bad config or
flags; 3 the broker could not be read (what could be read is printed: without
`kafka.partitions` the partitions are then the proxies that answer, 0, 1, ... up to the
first that does not; when none answers, no report); 4 the dead-letter table does not
exist (the report is printed, then what to do: deploy, or fix `dead_letters.table`);
`--watch` runs until Ctrl-C or SIGTERM and exits 0 (both end it the same way:
`exit_on_errors` turns SIGTERM into KeyboardInterrupt).

Heavy modules (confluent-kafka, boto3, rich) are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from triage_cli.exitcodes import CommandFailed, ExitCode, exit_on_errors

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

    from triage_proxy.config.settings import Settings

PROXY_TIMEOUT_S = 2.0
"""How long one proxy's /status may take before it counts as down."""
BROKER_TIMEOUT_S = 5.0
DeploymentDirOption = Annotated[
    Path | None,
    typer.Option(
        help="local: the deployment's project folder, as given to deploy (default: "
        ".triage/ by the config): its record names the processes that should run."
    ),
]
"""`--state-dir` of the commands that read a local deployment's record (status, console)."""
TABLE_ATTEMPTS = 2
"""botocore's attempts per dead-letter table call: status only reads and says what
failed, and the tools' 5 attempts (query.TABLE_ATTEMPTS) at the 5 s read timeout kept an
operator waiting 25 s for the report while DynamoDB did not answer."""
DEFAULT_WATCH_INTERVAL_S = 2.0
ANY_INTERFACE = ("", "0.0.0.0", "::")
MAX_PROBED_PARTITIONS = 1024
"""Most proxies asked in a row when the partition count is unknown (no broker)."""


@dataclass(frozen=True)
class BrokerView:
    """What the broker says about the group's partitions (None: could not be read)."""

    committed: Mapping[int, int | None] = field(default_factory=dict)
    """Committed offset per partition (None: the group committed nothing there)."""
    low: Mapping[int, int] = field(default_factory=dict)
    """Low watermark per partition (where an uncommitted group would start)."""
    high: Mapping[int, int] = field(default_factory=dict)
    """High watermark per partition."""
    error: str | None = None
    """Why the broker could not be read."""


@dataclass(frozen=True)
class ProxyView:
    """One proxy's /status answer, or why there was none."""

    url: str | None
    """Where it was asked (None: `server.http_enabled` is false)."""
    doc: Mapping[str, Any] | None = None
    """The /status document."""
    error: str | None = None
    """Why it did not answer."""
    foreign: str | None = None
    """Set when a process answered but belongs to another deployment (another topic,
    group or table): what it serves. Its answer is not this deployment's and is dropped."""


@dataclass(frozen=True)
class LocalDeployment:
    """What the supervisor's state.json records of this config's local deployment."""

    fleet: bool
    """N fleet processes share the partitions (else one pinned process per partition)."""
    slots: int
    """Process slots the supervisor keeps running: each should answer at its port."""
    topic_partitions: int | None
    """The topic's partition count when it was deployed."""
    supervisor_pid: int
    """The supervisor's pid (it runs the processes, restarting those that die)."""


def local_deployment(state: Mapping[str, Any] | None, config: Path) -> LocalDeployment | None:
    """The deployment `state` (state.json) records, if it is `config`'s (pure); None when
    there is no record, or it is another config's (a shared or wrong state folder)."""
    if not state or not isinstance(state.get("config"), str):
        return None
    if Path(state["config"]) != config:
        return None
    fleet = state.get("mode") == "fleet"
    entries = state.get("proxies" if fleet else "partitions")
    pid = state.get("supervisor_pid")
    if not isinstance(entries, list) or not entries or not isinstance(pid, int):
        return None
    partitions = state.get("topic_partitions")
    return LocalDeployment(
        fleet=fleet,
        slots=len(entries),
        topic_partitions=partitions if isinstance(partitions, int) else None,
        supervisor_pid=pid,
    )


def process_slots(deployment: LocalDeployment | None, partitions: int) -> int:
    """How many process slots to ask (pure): a recorded fleet's slots (a slot past them is
    no process: asking it showed a phantom down process); otherwise one per partition,
    the most either layout runs."""
    if deployment is not None and deployment.fleet:
        return deployment.slots
    return partitions


def is_fleet(views: Sequence[ProxyView], deployment: LocalDeployment | None) -> bool:
    """Whether the processes are a fleet (pure): the record says so, or one answers so."""
    if deployment is not None:
        return deployment.fleet
    return any(v.doc is not None and v.doc.get("mode") == "fleet" for v in views)


def unrecorded_slots(views: Sequence[ProxyView]) -> list[ProxyView]:
    """A fleet's views without a record of its size (pure): the slots above the last one
    that answers are dropped, since nothing says a process should run there; a slot below
    it that does not answer is a gap in the fleet, so a process that is down. (With a
    record, `process_slots` asks exactly the recorded slots and keeps every one.)"""
    answered = [k for k, v in enumerate(views) if v.doc is not None or v.foreign]
    return list(views[: answered[-1] + 1]) if answered else list(views)


@dataclass(frozen=True)
class Report:
    """Everything `triage status` prints, for every partition."""

    topic: str
    group_id: str
    partitions: Sequence[dict[str, Any]]
    broker_error: str | None = None
    dead_letters_error: str | None = None
    generated_at: str = ""
    legacy_partitions: Sequence[int] = ()
    """Partitions still holding dead letters written before deployment keys (invisible
    to every command until `triage dlq migrate` moves them)."""
    config: str = "<config>"
    """The config file, as the migrate hint names it."""
    push: Sequence[dict[str, Any]] = ()
    """One row per push target per process (`push_rows`)."""
    dead_letters_missing: bool = False
    """The dead-letter table does not exist (exit 4: nothing was deployed, or the name is
    wrong)."""
    foreign: Sequence[str] = ()
    """Processes that answered at this config's ports for another deployment."""
    table: str = ""
    """This config's dead-letter table."""
    processes: Sequence[dict[str, Any]] = ()
    """One row per proxy process asked (`process_rows`)."""
    supervisor_pid: int | None = None
    """The live supervisor of this config's local deployment (None: none runs)."""

    @property
    def proxies_down(self) -> list[int]:
        return [row["partition"] for row in self.partitions if row["proxy"] == "down"]

    @property
    def processes_down(self) -> list[str]:
        """The URLs of the process slots asked that did not answer as this deployment's:
        with a record, every one is a process that should run (a killed fleet process is
        down even while the others serve its partitions)."""
        return [row["url"] for row in self.processes if row["state"] == "down"]

    @property
    def answering(self) -> list[dict[str, Any]]:
        """The processes of this deployment that answered /status."""
        return [row for row in self.processes if row["state"] != "down"]

    @property
    def deployed(self) -> bool:
        """Some process of this deployment answered, or its supervisor is alive (or none
        could be asked: HTTP off). Not whether partitions are served: during a broker
        outage a fleet's processes answer yet serve nothing, and are still deployed."""
        return (
            not self.partitions
            or any(row["proxy"] != "down" for row in self.partitions)
            or bool(self.answering)
            or self.supervisor_pid is not None
        )

    def to_json(self) -> dict[str, Any]:
        def total(key: str) -> int | None:
            values = [row[key] for row in self.partitions]
            return None if any(v is None for v in values) else sum(values)

        return {
            "topic": self.topic,
            "group_id": self.group_id,
            "generated_at": self.generated_at,
            "broker_error": self.broker_error,
            "dead_letters_error": self.dead_letters_error,
            "legacy_dead_letters": list(self.legacy_partitions),
            "deployed": self.deployed,
            "supervisor_pid": self.supervisor_pid,
            "dead_letters_missing": self.dead_letters_missing,
            "other_deployments": list(self.foreign),
            "totals": {
                "lag": total("lag"),
                "in_flight": total("in_flight"),
                "dead_letters_pending": total("dead_letters_pending"),
                "proxies_down": len(self.proxies_down),
                "processes_down": len(self.processes_down),
            },
            "partitions": list(self.partitions),
            "push": list(self.push),
            "processes": list(self.processes),
        }


def partition_row(
    partition: int, broker: BrokerView, proxy: ProxyView, dead_letters_pending: int | None
) -> dict[str, Any]:
    """One partition's row from the three sources (pure)."""
    doc = proxy.doc or {}
    committed = broker.committed.get(partition)
    high = broker.high.get(partition)
    proxy_end = doc.get("log_end_offset")
    log_end = max((v for v in (high, proxy_end) if v is not None), default=None)
    lag: int | None = None
    if log_end is not None:
        if committed is not None:
            lag = max(0, log_end - committed)
        elif partition in broker.low:
            lag = max(0, log_end - broker.low[partition])
    if proxy.url is None and proxy.error is None:
        state = "unobserved"
    elif proxy.doc is None:
        state = "down"
    else:
        state = str(doc.get("state", "unknown"))
    return {
        "partition": partition,
        "committed_offset": committed,
        "log_end_offset": log_end,
        "lag": lag,
        "proxy": state,
        "proxy_url": proxy.url,
        "proxy_error": proxy.error,
        "endpoint": doc.get("advertised_endpoint") or None,
        "in_flight": doc.get("in_flight"),
        "in_window": doc.get("in_window"),
        "connected_instances": doc.get("connected_instances"),
        "instances": [i["consumer_id"] for i in doc.get("instances", [])],
        "oldest_unsettled_age_s": doc.get("oldest_unsettled_age_s"),
        "dead_letters_pending": dead_letters_pending,
        "dead_letters_writing": doc.get("dead_letters_pending"),
        "degraded": list(doc.get("degraded", [])),
        "dead_letters_unwritable": doc.get("dead_letters_unwritable"),
        "unwritable_dead_letters": list(doc.get("unwritable_dead_letters", [])),
        "served_by": doc.get("served_by"),
        "blocking": doc.get("blocking"),
        "queued": doc.get("queued"),
        "fetch_paused": doc.get("fetch_paused"),
        "instances_detail": [dict(i) for i in doc.get("instances", [])],
        "counters": dict(doc.get("counters") or {}),
    }


def process_rows(views: Sequence[ProxyView]) -> list[dict[str, Any]]:
    """Each proxy process asked, as the fleet view shows it (pure): its pid, owner id,
    mode, endpoint, the partitions it was assigned and serves, or why it did not answer."""
    rows: list[dict[str, Any]] = []
    for view in views:
        if view.url is None:
            continue
        doc = view.doc
        if doc is None:
            rows.append({"url": view.url, "state": "down", "error": view.error})
            continue
        parts = doc.get("partitions")
        pipelines = (
            [
                {"partition": p.get("partition"), "state": p.get("state"), "ready": p.get("ready")}
                for p in parts
                if isinstance(p, dict)
            ]
            if isinstance(parts, list)
            else []
        )
        rows.append(
            {
                "url": view.url,
                "state": doc.get("state"),
                "error": None,
                "pid": doc.get("pid"),
                "owner": doc.get("owner"),
                "mode": doc.get("mode"),
                "member": doc.get("member"),
                "ready": doc.get("ready"),
                "endpoint": doc.get("advertised_endpoint") or None,
                "assigned": list(doc.get("assigned") or []),
                "served": list(doc.get("served") or []),
                "pipelines": pipelines,
            }
        )
    return rows


def push_rows(views: Sequence[ProxyView]) -> list[dict[str, Any]]:
    """Each process's push targets, as its /status lists them, with the process that
    delivers (pure). A process delivers a target's records of its own partitions, so one
    target shows once per process that serves some."""
    rows: list[dict[str, Any]] = []
    for view in views:
        doc = view.doc or {}
        for target in doc.get("push") or []:
            if isinstance(target, dict):
                rows.append({**target, "pid": doc.get("pid"), "proxy_url": view.url})
    return sorted(rows, key=lambda r: (str(r.get("name")), list(r.get("partitions") or [])))


# --- reading the sources ------------------------------------------------------------------


class Sources:
    """The clients one `triage status` run reads from (kept across --watch refreshes)."""

    def __init__(
        self,
        settings: Settings,
        host: str | None,
        hosts: Sequence[str] | None = None,
        state_dir: Path | None = None,
    ) -> None:
        from confluent_kafka import Consumer

        from triage_proxy.kafka.logs import KafkaLog
        from triage_proxy.store.aws import dynamodb_client
        from triage_proxy.store.query import DeadLetterTable

        self.settings = settings
        self._host = host
        self._hosts = None if hosts is None else list(hosts)
        """Fleet processes each on its own host at slot 0 (AWS tasks), instead of slots
        0, 1, ... on one host."""
        self.config = "<config>"
        """The config file's path, as the migrate hint names it; with it, the local
        deployment's record is found (`deployment`)."""
        self._state_dir = state_dir
        """The local deployment's project folder (default `.triage/` by the config)."""
        config = {
            **settings.kafka.librdkafka_config(),
            "group.id": settings.kafka.group_id,
            "enable.auto.commit": False,
            # The report names what failed (broker_error): no librdkafka lines on stderr.
            **KafkaLog(settings.kafka.topic, quiet=True).config(),
        }
        self._consumer: Any = Consumer(config)
        self._dynamodb = dynamodb_client(settings.dead_letters, max_attempts=TABLE_ATTEMPTS)
        self._table = DeadLetterTable(
            settings.dead_letters, group=settings.kafka.group_id, dynamodb=self._dynamodb
        )
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="status")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._consumer.close()
        self._table.close()
        self._dynamodb.close()

    def partitions(self) -> int:
        """`kafka.partitions`, else the topic's partition count from the broker."""
        from triage_proxy.kafka.client import count_partitions

        if self.settings.kafka.partitions is not None:
            return self.settings.kafka.partitions
        return count_partitions(self._consumer, self.settings.kafka.topic, BROKER_TIMEOUT_S)

    def broker(self, partitions: int) -> BrokerView:
        from confluent_kafka import TopicPartition

        from triage_proxy.errors import BrokerUnavailable
        from triage_proxy.kafka.errors import kafka_errors

        topic = self.settings.kafka.topic
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        low: dict[int, int] = {}
        high: dict[int, int] = {}
        try:
            with kafka_errors("broker unreachable"):
                committed = {
                    tp.partition: tp.offset if tp.offset >= 0 else None
                    for tp in self._consumer.committed(tps, timeout=BROKER_TIMEOUT_S)
                }
                for tp in tps:
                    low[tp.partition], high[tp.partition] = self._consumer.get_watermark_offsets(
                        tp, timeout=BROKER_TIMEOUT_S, cached=False
                    )
        except BrokerUnavailable as exc:
            return BrokerView(error=str(exc))
        return BrokerView(committed=committed, low=low, high=high)

    def proxy_url(self, partition: int) -> str | None:
        if self._hosts is not None:  # k is a host of the fleet, each at slot 0's port
            address = self.settings.server.http_address(0)
            if address is None or address[1] == 0 or partition >= len(self._hosts):
                return None
            address = (self._hosts[partition], address[1])
        else:
            address = self.settings.server.http_address(partition)
        if address is None or address[1] == 0:
            return None
        host = self._host or address[0]
        if host in ANY_INTERFACE:
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{address[1]}/status"

    @property
    def on_hosts(self) -> bool:
        """The processes are a list of hosts (`--target aws`), not slots on one host."""
        return self._hosts is not None

    def deployment(self) -> LocalDeployment | None:
        """This config's local deployment, as its supervisor records it, while that
        supervisor is alive (None: no record, another config's, a dead one's, or the
        processes are ECS tasks)."""
        from triage_cli.supervisor import ProjectDir, pid_alive

        if self.on_hosts or self.config == "<config>":
            return None
        config = Path(self.config).resolve()
        project = ProjectDir.for_config(config, self._state_dir)
        found = local_deployment(project.read_state(), config)
        if found is None or not pid_alive(found.supervisor_pid, str(config)):
            return None
        return found

    def answering_proxies(self, most: int = MAX_PROBED_PARTITIONS) -> int:
        """How many proxies answer /status in a row from partition 0: the partition
        count when neither the config nor the broker can say."""
        for partition in range(most):
            if self._proxy(partition).doc is None:
                return partition
        return most

    def ask_proxies(self, slots: int) -> list[Future[ProxyView]]:
        """Ask the processes at `slots` slots (on AWS: every task) at once, in the
        background; the futures hold the answers."""
        count = slots if self._hosts is None else len(self._hosts)
        return [self._pool.submit(self._proxy, p) for p in range(count)]

    def _proxy(self, partition: int) -> ProxyView:
        url = self.proxy_url(partition)
        if url is None:
            return ProxyView(url=None)
        return mine_only(fetch_status(url), self.settings)

    def dead_letters(self, partitions: int) -> tuple[dict[int, int | None], str | None, bool]:
        """Pending dead letters per partition (a Query each, status only), why they could
        not be read, and whether that is because the table does not exist."""
        from triage_proxy.errors import TriageError
        from triage_proxy.store.query import Filters, TableNotFound

        topic = self.settings.kafka.topic
        counts: dict[int, int | None] = {}
        try:
            for p in range(partitions):
                items = self._table.scan(
                    Filters(topic=topic, partition=p, status="pending"), attributes=["status"]
                )
                counts[p] = sum(1 for _ in items)
        except TableNotFound as exc:
            return dict.fromkeys(range(partitions)), missing_table_hint(str(exc), self.config), True
        except TriageError as exc:
            return dict.fromkeys(range(partitions)), str(exc), False
        return counts, None, False

    def legacy_partitions(self, partitions: int) -> list[int]:
        """Partitions with dead letters from before deployment keys (a Query each, Limit
        1); none when the table cannot be read (dead_letters already says why)."""
        from triage_proxy.errors import TriageError
        from triage_proxy.store.migrate import legacy_partitions

        try:
            return legacy_partitions(self._table, self.settings.kafka.topic, range(partitions))
        except TriageError:
            return []


def fetch_status(url: str, timeout: float = PROXY_TIMEOUT_S) -> ProxyView:
    """GET a proxy's /status; any failure means down (with the reason)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            doc = json.loads(response.read())
    except (OSError, ValueError) as exc:  # URLError, timeouts and refusals are OSErrors
        reason = getattr(exc, "reason", None) or exc
        return ProxyView(url=url, error=str(reason))
    if not isinstance(doc, dict):
        return ProxyView(url=url, error="not a status document")
    return ProxyView(url=url, doc=doc)


def mine_only(view: ProxyView, settings: Settings) -> ProxyView:
    """`view` as this deployment sees it (pure): a process that answers for another topic,
    group or dead-letter table is not one of ours, so it counts as down, with the reason.
    An older proxy that does not say its group or table is judged by what it says."""
    doc = view.doc
    if doc is None:
        return view
    mine = {
        "topic": settings.kafka.topic,
        "group": settings.kafka.group_id,
        "table": settings.dead_letters.table,
    }
    theirs = {
        "topic": doc.get("topic"),
        "group": doc.get("group_id"),
        "table": doc.get("dead_letter_table"),
    }
    if all(not theirs[k] or theirs[k] == mine[k] for k in mine):
        return view
    what = ", ".join(f"{k} {theirs[k]!r}" for k in mine if theirs[k])
    pid = f"pid {doc['pid']} " if doc.get("pid") else ""
    return ProxyView(
        url=view.url,
        error=f"the process there ({pid}{what}) belongs to another deployment",
        foreign=f"{view.url}: {pid}{what}",
    )


def missing_table_hint(error: str, config: str) -> str:
    """What to do when the dead-letter table does not exist (pure)."""
    return (
        f"{error}: nothing was deployed with this config, or dead_letters.table names "
        f"another table. `triage deploy --config {config}` creates it; otherwise set "
        f"dead_letters.table (and dead_letters.region / endpoint_url) to the table the "
        f"proxies write"
    )


def not_deployed_note(report: Report) -> str:
    """The plain sentence for a deployment no process of which answers (pure)."""
    note = (
        f"nothing is deployed for group {report.group_id!r} (topic {report.topic!r}, table "
        f"{report.table!r}): no proxy of this deployment answers (or every one is down). "
        f"Start it with `triage deploy --config {report.config}`"
    )
    if report.foreign:
        note += "; the ports answer for another deployment: " + "; ".join(report.foreign)
    return note


def unserved_note(report: Report) -> str | None:
    """Why partitions are down while this deployment's processes answer (pure): they
    serve none of them. In a fleet a process that lost its group session (`member`
    false: the broker was unreachable for the session timeout) drains every partition and
    rejoins once the broker answers; that is a broker outage, not a missing deployment,
    and the note says so. When none answers but the supervisor is alive, the note says
    that. None when no partition is down for want of a serving process."""
    down = [
        row["partition"]
        for row in report.partitions
        if row["proxy"] == "down" and row["proxy_url"] is None and row["proxy_error"]
    ]
    answering = report.answering
    if down and not answering and report.supervisor_pid is not None:
        return (
            f"partition(s) {', '.join(map(str, down))} not served: the supervisor (pid "
            f"{report.supervisor_pid}) of this deployment is alive, but none of its processes "
            f"answers /status"
        )
    if not down or not answering:
        return None
    lost = [row for row in answering if row.get("member") is False]
    parts = ", ".join(map(str, down))
    note = (
        f"partition(s) {parts} not served, though {len(answering)} process(es) of this "
        f"deployment answer"
    )
    if lost:
        pids = ", ".join(str(row.get("pid")) for row in lost)
        note += (
            f"; {len(lost)} (pid {pids}) lost the consumer group session and serve "
            f"nothing until they rejoin"
        )
    if report.broker_error:
        note += f"; the broker is unreachable ({report.broker_error}): they rejoin once it answers"
    return note


def down_notes(row: Mapping[str, Any], *, deployed: bool) -> list[str]:
    """Why a row's partition is down, in words (pure). Pinned, a partition's proxy is its
    slot's process, named with its URL; in a fleet no one process is a partition's. When
    nothing is deployed `not_deployed_note` says it once, not a line per partition."""
    if row["proxy"] != "down" or not deployed:
        return []
    if row["proxy_url"] is None:
        return [f"partition {row['partition']} down: {row['proxy_error']}"]
    return [f"proxy {row['partition']} down ({row['proxy_url']}): {row['proxy_error']}"]


def partition_views(
    views: Sequence[ProxyView], partitions: int, *, fleet: bool = False
) -> list[ProxyView]:
    """Each partition's view, from the process that runs it (pure). A process document
    lists its partitions (`partitions`); an older one-partition proxy's document is its
    partition's. A partition no process lists is down: pinned, with its own slot's view
    (down, or a process serving other partitions: then with that reason); in a `fleet`
    slots are not partitions, so with no url, only the reason."""
    found: dict[int, ProxyView] = {}
    for view in views:
        doc = view.doc
        if doc is None or not isinstance(doc.get("partitions"), list):
            continue
        process = {
            "pid": doc.get("pid"),
            "owner": doc.get("owner"),
            "endpoint": doc.get("advertised_endpoint") or None,
            "url": view.url,
        }
        for part in doc["partitions"]:
            p = int(part.get("partition", -1))
            if p in found and not part.get("ready"):
                continue  # a standby or a draining one: the serving process wins
            found[p] = ProxyView(url=view.url, doc={**part, "served_by": process})
    out: list[ProxyView] = []
    for p in range(partitions):
        if p in found:
            out.append(found[p])
            continue
        if fleet and any(v.url is not None for v in views):  # HTTP off: unobserved
            out.append(ProxyView(url=None, error=f"no proxy process serves partition {p}"))
            continue
        own = views[p] if p < len(views) else ProxyView(url=None)
        if own.doc is not None and isinstance(own.doc.get("partitions"), list):
            own = ProxyView(url=own.url, error=f"no proxy process serves partition {p}")
        out.append(own)
    return out


def gather(sources: Sources, *, now: Callable[[], float] = time.time) -> Report:
    """Read every source once. Without `kafka.partitions` and without the broker, the
    partitions are what the local deployment's record says, else the proxies that answer
    (0, 1, ... up to the first that does not); raises BrokerUnavailable only when neither
    says (not even proxy 0 answers)."""
    from triage_proxy.errors import BrokerUnavailable

    settings = sources.settings
    deployment = sources.deployment()
    try:
        count = sources.partitions()
    except BrokerUnavailable:
        if deployment is not None and deployment.topic_partitions:
            count = deployment.topic_partitions
        else:
            count = sources.answering_proxies()
            if count == 0:
                raise
    asked = sources.ask_proxies(process_slots(deployment, count))
    broker = sources.broker(count)
    pending, dl_error, dl_missing = sources.dead_letters(count)
    legacy = sources.legacy_partitions(count) if dl_error is None else []
    answers = [future.result() for future in asked]
    fleet = is_fleet(answers, deployment)
    if fleet and deployment is None and not sources.on_hosts:  # an ECS task is no guess
        answers = unrecorded_slots(answers)
    views = partition_views(answers, count, fleet=fleet)
    rows = [partition_row(p, broker, views[p], pending.get(p)) for p in range(count)]
    stamp = datetime.fromtimestamp(now(), UTC).isoformat(timespec="seconds")
    return Report(
        topic=settings.kafka.topic,
        group_id=settings.kafka.group_id,
        partitions=rows,
        broker_error=broker.error,
        dead_letters_error=dl_error,
        generated_at=stamp,
        legacy_partitions=legacy,
        config=sources.config,
        push=push_rows([a for a in answers if a.doc is not None]),
        dead_letters_missing=dl_missing,
        foreign=[a.foreign for a in answers if a.foreign],
        table=settings.dead_letters.table,
        processes=process_rows(answers),
        supervisor_pid=None if deployment is None else deployment.supervisor_pid,
    )


# --- rendering ----------------------------------------------------------------------------


def _n(value: Any) -> str:
    return "-" if value is None else str(value)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


PROXY_STYLES = {"running": "green", "down": "bold red", "standby": "yellow"}


def render_table(report: Report) -> Table:
    """The report as a rich table (pure; the caller prints it). Fits 80 columns."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=f"{report.topic}  (group {report.group_id})  {report.generated_at}",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    for name in (
        "part",
        "proxy",
        "committed",
        "log\nend",
        "lag",
        "in\nflight",
        "inst-\nances",
        "oldest\nunsettled",
        "dead\nletters",
    ):
        table.add_column(name, justify="left" if name == "proxy" else "right", no_wrap=True)
    writing = False
    for row in report.partitions:
        state = row["proxy"]
        dead = _n(row["dead_letters_pending"])
        if row["dead_letters_writing"]:
            dead += f" (+{row['dead_letters_writing']})"
            writing = True
        table.add_row(
            str(row["partition"]),
            Text(state, style=PROXY_STYLES.get(state, "")),
            _n(row["committed_offset"]),
            _n(row["log_end_offset"]),
            Text(_n(row["lag"]), style="bold" if row["lag"] else ""),
            _n(row["in_flight"]),
            _n(row["connected_instances"]),
            _age(row["oldest_unsettled_age_s"]),
            dead,
        )
    notes = []
    if not report.deployed:
        notes.append(not_deployed_note(report))
    unserved = unserved_note(report)
    if unserved:
        notes.append(unserved)
    endpoints = [
        f"{row['partition']} {row['endpoint']}" for row in report.partitions if row.get("endpoint")
    ]
    if endpoints:
        notes.append(f"endpoints (partition host:port): {', '.join(endpoints)}")
    notes.extend(served_by_notes(report.partitions))
    if writing:
        notes.append("dead letters (+n): n more the proxy is still writing")
    if report.broker_error:
        notes.append(f"broker: {report.broker_error}")
    if report.dead_letters_error:
        notes.append(f"dead letters: {report.dead_letters_error}")
    if report.legacy_partitions:
        from triage_proxy.store.migrate import legacy_warning

        notes.append(
            "warning: " + legacy_warning(report.topic, report.legacy_partitions, report.config)
        )
    for row in report.partitions:
        notes.extend(down_notes(row, deployed=report.deployed))
        notes.extend(degraded_notes(row))
    if report.deployed:
        named = {row["proxy_url"] for row in report.partitions}
        notes.extend(
            f"process {row['url']} down: {row['error']}"
            for row in report.processes
            if row["state"] == "down" and row["url"] not in named
        )
    if notes:
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
    return table


def _latency(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    return f"{seconds:g}s"


def _counts(counts: Mapping[str, int] | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted((counts or {}).items()) if v) or "-"


def render_push_table(report: Report) -> Table | None:
    """The push targets, one row per target per process (pure); None when there are none.
    Latencies are bucket bounds (p50/p99 of the round trips that got an answer). The state
    column holds its first word ("ok", "outage", ...); why a target waits, in full, is a
    note under the table, so the table fits 80 columns."""
    if not report.push:
        return None
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title="push targets",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    for name in ("target", "part", "state", "limit", "in\nflight", "p50", "p99", "errors"):
        left = name in ("target", "state")
        table.add_column(name, justify="left" if left else "right", no_wrap=True)
    table.add_column("responses")
    notes: list[str] = []
    for row in report.push:
        state = str(row.get("state", "-"))
        parts = ",".join(str(p) for p in row.get("partitions") or []) or "-"
        if state != "ok":
            notes.append(f"{row.get('name')} (partitions {parts}): {state}")
        table.add_row(
            str(row.get("name")),
            parts,
            Text(state.split(":", 1)[0], style="green" if state == "ok" else "bold yellow"),
            _n(row.get("limit")),
            _n(row.get("in_flight")),
            _latency(row.get("latency_p50_s")),
            _latency(row.get("latency_p99_s")),
            Text(_n(row.get("errors")), style="bold red" if row.get("errors") else ""),
            _counts(row.get("responses")),
        )
    if notes:
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
    return table


def render_report(report: Report) -> RenderableType:
    """What the command prints: the partitions, then the push targets when there are any."""
    from rich.console import Group

    push = render_push_table(report)
    table = render_table(report)
    return table if push is None else Group(table, "", push)


def served_by_notes(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Which process serves which partitions, one line per process (pure); nothing when
    every process serves one partition (the layout of one process per partition)."""
    by: dict[tuple[Any, Any], list[int]] = {}
    for row in rows:
        served = row.get("served_by")
        if served and row["proxy"] == "running":
            by.setdefault((served.get("pid"), served.get("endpoint")), []).append(row["partition"])
    if all(len(parts) == 1 for parts in by.values()):
        return []
    return [
        f"process pid {pid} ({endpoint}) serves partitions {', '.join(map(str, parts))}"
        for (pid, endpoint), parts in sorted(by.items(), key=lambda kv: kv[1])
    ]


def degraded_notes(row: Mapping[str, Any]) -> list[str]:
    """What a row's proxy reports as degraded, in words (pure); unwritable dead letters
    name their offset and the fix."""
    partition = row["partition"]
    notes: list[str] = []
    others = [part for part in row.get("degraded", []) if part != "dead_letters_unwritable"]
    if others:
        notes.append(f"partition {partition} degraded: {', '.join(others)} (retrying)")
    count = row.get("dead_letters_unwritable") or 0
    shown = row.get("unwritable_dead_letters", [])
    if count and shown:
        first = shown[0]
        more = f" (and {count - 1} more)" if count > 1 else ""
        notes.append(
            f"partition {partition}: the dead letter at offset {first['offset']}{more} cannot "
            f"be written ({first['size']:,} bytes, over the {first['limit']:,} item limit); "
            f"the commit cannot pass it. Fix: {first['fix']}"
        )
    return notes


# --- the command --------------------------------------------------------------------------


def status(
    config: Annotated[Path, typer.Option("--config", "-c", help="The proxies' TOML config file.")],
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[
        float, typer.Option(help="Seconds between refreshes with --watch.", min=0.2)
    ] = DEFAULT_WATCH_INTERVAL_S,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
    host: Annotated[
        str | None, typer.Option(help="Ask the proxies on this host instead of server.http_host.")
    ] = None,
    target: Annotated[
        str,
        typer.Option(
            help="local: the proxies at server.http_port + k; aws: each running ECS task of "
            "the deployment at server.http_port (run inside the VPC)."
        ),
    ] = "local",
    state_dir: DeploymentDirOption = None,
) -> None:
    """Per partition: committed offset, log end, lag, in-flight, instances, dead letters;
    then each push target: limit, in-flight, latency, responses, errors and state."""
    from rich.console import Console

    from triage_proxy.config.settings import load_settings
    from triage_proxy.store.aws import read_secret

    with exit_on_errors():
        if watch and json_:
            raise CommandFailed(ExitCode.BAD_INPUT, "--watch and --json do not go together")
        if target not in ("local", "aws"):
            raise CommandFailed(ExitCode.BAD_INPUT, "--target must be local or aws")
        settings = load_settings(config, fetch_secret=read_secret)
        hosts = None
        if target == "aws":
            from triage_cli.aws import fleet_hosts

            hosts = fleet_hosts(config)
        sources = Sources(settings, host, hosts, state_dir)
        sources.config = str(config)
        console = Console(highlight=False)
        try:
            if watch:
                _watch(sources, console, interval)
                return
            report = gather(sources)
        finally:
            sources.close()
        if json_:
            print(json.dumps(report.to_json(), indent=2))
            if not report.deployed:
                typer.echo(not_deployed_note(report), err=True)
            if report.legacy_partitions:
                from triage_proxy.store.migrate import legacy_warning

                typer.echo(
                    "warning: "
                    + legacy_warning(report.topic, report.legacy_partitions, str(config)),
                    err=True,
                )
        else:
            console.print(render_report(report))
        if report.broker_error:
            raise typer.Exit(int(ExitCode.UNAVAILABLE))
        if report.dead_letters_missing:
            raise CommandFailed(ExitCode.NOT_FOUND, str(report.dead_letters_error))
        if report.proxies_down or report.processes_down:
            raise typer.Exit(int(ExitCode.FAILURE))


def _watch(sources: Sources, console: Any, interval: float) -> None:
    """Redraw the table every `interval` until Ctrl-C or SIGTERM (exit 0)."""
    from rich.live import Live
    from rich.text import Text

    from triage_proxy.errors import UnavailableError

    def frame() -> Any:
        try:
            return render_report(gather(sources))
        except UnavailableError as exc:
            return Text(f"{exc} (retrying every {interval:g} s)", style="red")

    with (
        contextlib.suppress(KeyboardInterrupt),  # Ctrl-C or SIGTERM (see exit_on_errors)
        Live(frame(), console=console, auto_refresh=False) as live,
    ):
        # On stderr once the first table is drawn, so a script (or a test) knows a
        # signal from now on ends it with 0 and leaves that table on a non-terminal.
        print(f"watching every {interval:g} s; Ctrl-C stops", file=sys.stderr, flush=True)
        while True:
            time.sleep(interval)
            live.update(frame(), refresh=True)
