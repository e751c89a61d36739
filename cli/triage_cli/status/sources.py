"""Reading `triage status`'s sources: the broker (committed offsets, watermarks), each
proxy process's /status and the dead-letter table's pending counts (`Sources`), and
`gather`, which reads each once and joins them into a `Report`. A source that does not
answer costs only its own columns."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triage_cli.status.report import (
    BrokerView,
    LocalDeployment,
    ProxyView,
    Report,
    is_fleet,
    local_deployment,
    mine_only,
    missing_table_hint,
    partition_row,
    partition_views,
    process_rows,
    process_slots,
    push_rows,
    unrecorded_slots,
)

if TYPE_CHECKING:
    from triage_proxy.config.settings import Settings

PROXY_TIMEOUT_S = 2.0
"""How long one proxy's /status may take before it counts as down."""
BROKER_TIMEOUT_S = 5.0
TABLE_ATTEMPTS = 2
"""botocore's attempts per dead-letter table call: status only reads and says what
failed, and the tools' 5 attempts (query.TABLE_ATTEMPTS) at the 5 s read timeout kept an
operator waiting 25 s for the report while DynamoDB did not answer."""
ANY_INTERFACE = ("", "0.0.0.0", "::")
MAX_PROBED_PARTITIONS = 1024
"""Most proxies asked in a row when the partition count is unknown (no broker)."""


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
