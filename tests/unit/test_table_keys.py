"""Item keys per deployment, and the migration's plan: pure, no DynamoDB."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.samples import GROUP, item, make_dl
from triage_proxy.config.validation import MAX_GROUP_BYTES
from triage_proxy.errors import ConfigError
from triage_proxy.store.deadletter_store import MemoryStore
from triage_proxy.store.items import (
    KIND_CHECKPOINT,
    KIND_DEAD_LETTER,
    KIND_LEASE,
    check_group,
    checkpoint_source,
    dead_letter_source,
    is_legacy_dead_letter,
    item_group,
    lease_source,
    legacy_dead_letter_source,
    legacy_lease_source,
    parse_source,
)
from triage_proxy.store.migrate import Move, migrated_item, plan_move
from triage_proxy.store.payload import payload_object_key
from triage_proxy.store.query import Filters, matches

TOPICS = st.from_regex(r"[a-zA-Z0-9._-]{1,249}", fullmatch=True)
"""Every legal Kafka topic name."""
GROUPS = st.text(min_size=1).filter(lambda g: len(g.encode("utf-8", "surrogatepass")) <= 255)
"""Group ids: anything, `#` and `/` included, up to MAX_GROUP_BYTES."""


def test_the_key_formats() -> None:
    assert dead_letter_source("orders", 3, "billing") == "orders#3#dead#billing"
    assert checkpoint_source("orders", 3, "billing") == "orders#3#checkpoint#billing"
    assert lease_source("orders", 3, "billing") == "orders#3#lease#billing"
    assert legacy_dead_letter_source("orders", 3) == "orders#3"
    assert legacy_lease_source("orders", 3) == "orders#3#lease"
    assert payload_object_key("t", "orders", 3, 9, "a/b#c") == "t/orders/3/9/a/b#c"


@given(topic=TOPICS, partition=st.integers(0, 2**31 - 1), group=GROUPS)
def test_every_key_parses_back_whatever_the_group_holds(
    topic: str, partition: int, group: str
) -> None:
    for kind, source in (
        (KIND_DEAD_LETTER, dead_letter_source(topic, partition, group)),
        (KIND_CHECKPOINT, checkpoint_source(topic, partition, group)),
        (KIND_LEASE, lease_source(topic, partition, group)),
    ):
        assert parse_source(source) == (topic, partition, kind, group)
    assert parse_source(legacy_dead_letter_source(topic, partition)) == (
        topic,
        partition,
        KIND_DEAD_LETTER,
        None,
    )
    assert parse_source(legacy_lease_source(topic, partition)) == (
        topic,
        partition,
        KIND_LEASE,
        None,
    )


@given(topic=TOPICS, partition=st.integers(0, 99), groups=st.lists(GROUPS, min_size=2, max_size=2))
def test_two_deployments_never_share_a_key(topic: str, partition: int, groups: list[str]) -> None:
    a, b = groups
    if a == b:
        return
    sources = {
        f(topic, partition, g)
        for f in (dead_letter_source, checkpoint_source, lease_source)
        for g in (a, b)
    }
    sources |= {legacy_dead_letter_source(topic, partition), legacy_lease_source(topic, partition)}
    assert len(sources) == 8
    assert payload_object_key("t", topic, partition, 1, a) != payload_object_key(
        "t", topic, partition, 1, b
    )


@pytest.mark.parametrize("source", ["", "orders", "orders#x", "#0", "orders#0#dead", "o#0#x#g"])
def test_malformed_keys_are_refused(source: str) -> None:
    with pytest.raises(ValueError, match="not a table key"):
        parse_source(source)


def test_a_group_must_fit_a_key() -> None:
    assert check_group("g" * MAX_GROUP_BYTES) == "g" * MAX_GROUP_BYTES
    with pytest.raises(ConfigError, match=r"kafka\.group_id"):
        check_group("")
    with pytest.raises(ConfigError, match="at most 255"):
        check_group("é" * 128)
    with pytest.raises(ConfigError):
        MemoryStore(group="")


def test_selection_never_crosses_deployments() -> None:
    ours, theirs = item(1), item(1, group="shipping")
    legacy = {k: v for k, v in item(1).items() if k != "group"}
    legacy["source"] = {"S": "orders#0"}
    assert matches(ours, Filters(), group=GROUP)
    assert not matches(theirs, Filters(), group=GROUP)
    assert matches(theirs, Filters(), group="shipping")
    assert not matches(legacy, Filters(), group=GROUP)
    assert (item_group(ours), item_group(legacy)) == (GROUP, None)
    assert is_legacy_dead_letter(legacy)
    assert not is_legacy_dead_letter(ours)


def test_two_deployments_write_the_same_offset_side_by_side() -> None:
    billing, shipping = MemoryStore(group="billing#eu"), MemoryStore(group="shipping")
    assert billing.put_batch([make_dl(5, reason="billing")]) == []
    assert shipping.put_batch([make_dl(5, reason="shipping")]) == []
    assert list(billing.items) == [("orders#0#dead#billing#eu", 5)]
    assert list(shipping.items) == [("orders#0#dead#shipping", 5)]


# --- the migration's plan ---------------------------------------------------------------

NOW = 1_000_000


def claimed(until: int) -> dict[str, Any]:
    return {"replay_claim": {"S": "run"}, "replay_claim_until": {"N": str(until)}}


@pytest.mark.parametrize(
    ("legacy", "current", "move"),
    [
        ({}, None, Move.MOVED),
        ({"status": {"S": "replayed"}}, None, Move.MOVED),
        (claimed(NOW - 1), None, Move.MOVED),  # a stale claim moves along, in doubt
        (claimed(NOW), None, Move.IN_USE),
        ({}, {"status": {"S": "pending"}}, Move.REPLACED),
        ({"status": {"S": "replayed"}}, {"status": {"S": "pending"}}, Move.REPLACED),
        ({}, {"status": {"S": "pending"}, **claimed(NOW + 5)}, Move.CONFLICT),
        ({}, {"status": {"S": "replayed"}}, Move.CONFLICT),
        ({}, {"status": {"S": "discarded"}}, Move.CONFLICT),
        (claimed(NOW + 5), {"status": {"S": "replayed"}}, Move.IN_USE),
    ],
)
def test_plan_move(legacy: dict[str, Any], current: dict[str, Any] | None, move: Move) -> None:
    base = {k: v for k, v in item(3).items() if k != "group"}
    assert plan_move({**base, **legacy}, current, NOW) is move


def test_a_migrated_item_keeps_every_attribute_and_gains_its_group() -> None:
    old = {k: v for k, v in item(3, status="replayed").items() if k != "group"}
    old["source"] = {"S": "orders#0"}
    old["replay_id"] = {"S": "r"}
    new = migrated_item(old, "billing#eu")
    assert new["source"] == {"S": "orders#0#dead#billing#eu"}
    assert new["group"] == {"S": "billing#eu"}
    assert new["dl_state"] == {"S": "replayed#billing#eu"}  # its place in the by-state index
    assert {k: v for k, v in new.items() if k not in ("source", "group", "dl_state")} == {
        k: v for k, v in old.items() if k not in ("source", "dl_state")
    }


def test_the_index_projects_everything_a_listing_reads() -> None:
    """A Query on a global index may only read projected attributes: a listing through
    `by-state` reads LIST_ATTRIBUTES, so each must be a key or projected."""
    from triage_proxy.store.items import AT_ATTR, INDEX_PROJECTION, STATE_ATTR
    from triage_proxy.store.pages import COUNT_ATTRIBUTES
    from triage_proxy.store.query import LIST_ATTRIBUTES

    keys = {"source", "offset", STATE_ATTR, AT_ATTR}
    assert set(LIST_ATTRIBUTES) | set(COUNT_ATTRIBUTES) <= keys | set(INDEX_PROJECTION)
    assert "value" not in INDEX_PROJECTION
    assert "headers" not in INDEX_PROJECTION
    assert len(INDEX_PROJECTION) <= 20  # DynamoDB's limit of projected non-key attributes
