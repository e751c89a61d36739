"""The console's bulk replay and discard (`DeadLetters.bulk`, what a job runs) against a
real moto server and Tansu, without a browser: counts, progress and the items that
changed between the count and the action, which must come out as `triage dlq`'s routines
(`store.bulk`) count them. The browser tests (test_console.py) drive the same jobs
through the page."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from tests import samples
from tests.integration.harness import write_dead_letters
from tests.samples import GROUP, T0
from triage_cli.console.deadletters import BulkResult, DeadLetters
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.settings import Settings
from triage_proxy.kafka.producer import never_written
from triage_proxy.store.bulk import BULK_CHUNK, replay_matching
from triage_proxy.store.items import DeadLetterKey, dead_letter_table_key
from triage_proxy.store.provisioning import create_table
from triage_proxy.store.query import DeadLetterTable, Filters
from triage_proxy.store.replay import new_replay_id

pytestmark = pytest.mark.integration


class ExpiresBeforeReread(DeadLetterTable):
    """A real table in which the `doomed` items are deleted (as DynamoDB's TTL deletes
    them) after the listing named them and before their chunk is read again: the window
    an index that lags behind its table leaves open. The deletion is a real DeleteItem."""

    def __init__(self, *args: Any, doomed: set[DeadLetterKey], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.doomed = doomed
        self.deleted: list[DeadLetterKey] = []

    def get_many(self, keys: Sequence[DeadLetterKey]) -> list[dict[str, Any]]:
        for key in sorted(self.doomed & set(keys)):
            self.client.delete_item(
                TableName=self.table, Key=dead_letter_table_key(key, self.group)
            )
            self.doomed.discard(key)
            self.deleted.append(key)
        return super().get_many(keys)


def _settings(aws: EmbeddedAWS, broker: EmbeddedBroker, name: str) -> Settings:
    raw = {
        "kafka": {"bootstrap_servers": broker.bootstrap, "topic": name, "group_id": GROUP},
        "auth": {"token": "console-bulk-token-0123456789"},
        "dead_letters": {"table": name, "endpoint_url": aws.endpoint_url},
    }
    settings = settings_from_dict(raw, {})
    create_table(settings.dead_letters)
    return settings


def _write(settings: Settings, topic: str, n: int, reason: str, first: int = 0) -> None:
    write_dead_letters(
        settings.dead_letters,
        [
            samples.make_dl(first + i, topic=topic, reason=reason, at_ms=T0 + first + i)
            for i in range(n)
        ],
    )


def test_bulk_replay_counts_an_item_gone_since_the_count_as_skipped_as_the_cli_does(
    aws: EmbeddedAWS, broker: EmbeddedBroker, topic: str
) -> None:
    """Two chunks (progress moves between them, with the outcomes so far); one item of the
    second chunk leaves the table after the count and the listing: skipped, as
    `replay_matching` (what `triage dlq replay` runs) counts it on the same table."""
    settings = _settings(aws, broker, topic)
    n = BULK_CHUNK + 5
    _write(settings, topic, n, "console")
    _write(settings, topic, 3, "cli", first=n)
    gone = (topic, 0, BULK_CHUNK + 2)  # oldest first: in the second chunk
    gone_cli = (topic, 0, n + 1)
    table = ExpiresBeforeReread(settings.dead_letters, group=GROUP, doomed={gone, gone_cli})
    deadletters = DeadLetters(settings, table=table)
    seen: list[BulkResult] = []
    try:
        filters = deadletters.filters(reason="console")
        result = deadletters.bulk(
            "replay", filters, progress=lambda r: seen.append(BulkResult(**vars(r)))
        )
        assert table.deleted == [gone]
        assert (result.selected, result.done) == (n, n)
        assert (result.replayed, result.skipped) == (n - 1, 1)
        assert (result.failed, result.in_doubt, result.failures) == (0, 0, [])
        assert not result.interrupted
        assert result.replay_id is not None
        # Before any work, after the first chunk (its outcomes), and at the end.
        assert [(s.done, s.replayed) for s in seen] == [
            (0, 0),
            (BULK_CHUNK, BULK_CHUNK),
            (n, n - 1),
        ]
        assert all(s.selected == n for s in seen)
        for offset in range(n):
            if offset != gone[2]:
                assert table.get((topic, 0, offset))["status"]["S"] == "replayed"

        # The CLI's routine, the same window on the same table: the same counts.
        producer = deadletters._producer(topic)
        cli = replay_matching(
            table,
            producer,
            Filters(reason="cli"),
            replay_id=new_replay_id(),
            never_written=never_written,
        )
        assert table.deleted == [gone, gone_cli]
        assert (len(cli.replayed), len(cli.skipped)) == (2, 1)
        assert cli.skipped[0][0] == gone_cli
        assert [why for _, why in cli.skipped] == ["no longer in the table"]
    finally:
        deadletters.close()


def test_bulk_discard_moves_item_by_item_and_skips_what_is_no_longer_pending(
    aws: EmbeddedAWS, broker: EmbeddedBroker, topic: str
) -> None:
    """Progress after every item, with the counts so far; an item a single-item action
    replays after the count is not discarded (the pending listing no longer has it), and
    a second run finds nothing to do."""
    settings = _settings(aws, broker, topic)
    _write(settings, topic, 6, "discard me")
    deadletters = DeadLetters(settings)
    seen: list[BulkResult] = []
    replayed_first = (topic, 0, 4)

    def progress(result: BulkResult) -> None:
        seen.append(BulkResult(**vars(result)))
        if len(seen) == 1:  # after the count, before the first discard
            assert deadletters.replay_one(replayed_first)["outcome"] == "replayed"

    try:
        result = deadletters.bulk("discard", deadletters.filters(reason="discard me"),
                                  progress=progress)  # fmt: skip
        assert (result.selected, result.done, result.discarded) == (6, 5, 5)
        assert result.skipped == 0  # gone from the pending listing before it was walked
        assert [s.done for s in seen] == [0, 1, 2, 3, 4, 5, 5]
        assert [s.discarded for s in seen] == [0, 1, 2, 3, 4, 5, 5]
        assert deadletters.table.get(replayed_first)["status"]["S"] == "replayed"
        assert deadletters.count(deadletters.filters(reason="discard me")) == 0
        again = deadletters.bulk("discard", deadletters.filters(reason="discard me"))
        assert (again.selected, again.done, again.discarded) == (0, 0, 0)
    finally:
        deadletters.close()
