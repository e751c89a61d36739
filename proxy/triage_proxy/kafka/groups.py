"""Who else uses the deployment's consumer group: the group fence of a pinned proxy, and
the warning `triage init` and `triage deploy` print.

Why a fence by the group. The partition lease (store/leases.py) lives in the
deployment's dead-letter table, so it fences only the processes that share that table.
Two deployments with one group id and two tables (a `triage dev` stack and a `triage
init` that picked the same default group, say) would both deliver a partition. What
they do share is the broker's consumer group, and Kafka already settles who runs a
group's partitions: its live members, by the group protocol (a fleet's processes are
members, see assignment.py). A pinned proxy (`--partition`) reads with assign() and is
no member; while the group has live members, Kafka (and Tansu 0.6) refuse its commits
(UNKNOWN_MEMBER_ID), so it cannot serve that group correctly anyway. Hence the rule:

    a process that is not a member of the group does not deliver the group's partitions
    while the group has live members (state Stable, PreparingRebalance or
    CompletingRebalance); it waits as a standby, and one that serves stops at its next
    lease renewal.

`GroupFence.busy()` answers it with one DescribeGroups call. A broker that does not
answer is not a reason to stop (the lease still fences within the table); the caller
asks again at its next renewal. Tansu 0.6 answers a group's state but lists no members;
a broker that lists them lets the reason name them.

`group_in_use` is what `init` and `deploy` warn with: live members now, or committed
offsets on the topic (a deployment that used the group before, or pinned proxies, which
are no members).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from confluent_kafka import ConsumerGroupState, ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from triage_proxy.config.sections import KafkaSettings
from triage_proxy.errors import BrokerUnavailable
from triage_proxy.kafka.errors import admin_answer, kafka_errors
from triage_proxy.kafka.logs import KafkaLog

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0
"""How long one DescribeGroups (or offsets listing) may take."""
LIVE_STATES = frozenset(
    {
        ConsumerGroupState.STABLE,
        ConsumerGroupState.PREPARING_REBALANCING,
        ConsumerGroupState.COMPLETING_REBALANCING,
    }
)
"""States of a group with live members (Empty, Dead and Unknown have none we can see)."""


@dataclass(frozen=True)
class GroupView:
    """What the broker says about a consumer group."""

    state: str
    """The group's state, lower case ("stable", "empty", ...)."""
    live: bool
    """It has live members (the group protocol runs its partitions)."""
    members: tuple[str, ...] = ()
    """Its members as "client-id@host" (empty when the broker does not list them)."""


def admin_client(settings: KafkaSettings, admin: Any = None) -> Any:
    """`admin` when given, else a new AdminClient for `settings`. (Not `admin or ...`: an
    AdminClient is falsy, its len() is 0, so that idiom made a second client every time.)

    Its librdkafka reports go through `KafkaLog`, quietly, since every caller reports a
    failed call itself (BrokerUnavailable). Without it librdkafka printed its own
    `%3|...|FAIL|...` line to stderr at every refused connect, into a pinned proxy's log
    and under `triage init`'s and `triage deploy`'s output. The reports wait in the client
    until it is polled: a client kept for long must be polled (`GroupFence.busy`)."""
    if admin is not None:
        return admin
    return AdminClient(
        {**settings.librdkafka_config(), **KafkaLog(settings.topic, quiet=True).config()}
    )


def describe_group(settings: KafkaSettings, admin: Any = None) -> GroupView:
    """The group's state and members (BrokerUnavailable: no answer)."""
    admin = admin_client(settings, admin)
    group = settings.group_id
    what = f"describing group {group!r} ({settings.bootstrap_servers})"
    with kafka_errors(what):
        futures = admin.describe_consumer_groups([group], request_timeout=CALL_TIMEOUT_S)
    found = admin_answer(futures[group], what, CALL_TIMEOUT_S + 1)
    members = tuple(f"{m.client_id}@{m.host}".strip("@") for m in found.members or ())
    state = found.state
    return GroupView(
        state=str(getattr(state, "name", state)).lower(),
        live=state in LIVE_STATES or bool(members),
        members=members,
    )


def committed_partitions(settings: KafkaSettings, admin: Any = None) -> list[int]:
    """Partitions of the topic the group has committed offsets on (BrokerUnavailable)."""
    admin = admin_client(settings, admin)
    group = settings.group_id
    what = f"listing the offsets of group {group!r} ({settings.bootstrap_servers})"
    with kafka_errors(what):
        futures = admin.list_consumer_group_offsets(
            [ConsumerGroupTopicPartitions(group)], request_timeout=CALL_TIMEOUT_S
        )
    found = admin_answer(futures[group], what, CALL_TIMEOUT_S + 1)
    parts: list[TopicPartition] = list(found.topic_partitions or ())
    return sorted(
        tp.partition
        for tp in parts
        if tp.topic == settings.topic and tp.offset is not None and tp.offset >= 0
    )


def group_in_use(settings: KafkaSettings, *, offsets: bool = True) -> str | None:
    """Why the group looks used by someone already, in words; None when it does not (or
    the broker cannot say: the caller has its own check of the broker). `offsets` False:
    live members only (a redeploy finds its own earlier commits)."""
    group, topic = settings.group_id, settings.topic
    admin = admin_client(settings)
    try:
        view = describe_group(settings, admin)
        committed = [] if view.live or not offsets else committed_partitions(settings, admin)
    except BrokerUnavailable:
        return None
    if view.live:
        who = f" ({', '.join(view.members)})" if view.members else ""
        return (
            f"consumer group {group!r} has live members now{who}: another deployment (or "
            f"consumer) uses it. Two deployments with one group id must not share a topic; "
            f"give this one its own kafka.group_id"
        )
    if committed:
        return (
            f"consumer group {group!r} has committed offsets on topic {topic!r} (partitions "
            f"{', '.join(map(str, committed))}): another deployment used it, or still does "
            f"with pinned proxies (which are no group members). Unless that is this "
            f"deployment, give this one its own kafka.group_id"
        )
    return None


class GroupFence:
    """The group fence of a process that is not a member of the group (module
    docstring). Sync: called from a lease thread."""

    def __init__(self, settings: KafkaSettings) -> None:
        self._settings = settings
        self._admin: Any = admin_client(settings)

    def busy(self) -> str | None:
        """Why this process must not deliver the group's partitions now (the group has
        live members); None when it may (or the broker did not answer)."""
        try:
            view = describe_group(self._settings, self._admin)
        except BrokerUnavailable as exc:
            logger.debug("group fence: %s", exc)
            return None
        finally:
            # Serve the client's queued reports (`admin_client`: KafkaLog). Nothing else
            # polls this long-lived client, and a broker that stays down queues a report
            # or two every second until something does.
            self._admin.poll(0)
        if not view.live:
            return None
        who = f": {', '.join(view.members)}" if view.members else ""
        return (
            f"consumer group {self._settings.group_id!r} has live members ({view.state}{who}), "
            f"so the group protocol runs its partitions and this proxy, which is pinned and "
            f"no member, must not deliver them (Kafka refuses its commits). Another deployment "
            f"(with another dead-letter table) uses this group id: stop it, or give one of "
            f"them its own kafka.group_id"
        )
