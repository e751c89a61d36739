"""Client-sent text is bounded and escaped: the consumer id at Hello, log lines showing a
consumer id or a nack reason, and dead letters whose metadata is as large as allowed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.samples import GROUP
from tests.unit.test_dispatcher import connect
from triage_protocol import triage_pb2 as pb
from triage_protocol.constants import MAX_CONSUMER_ID_CHARS, MAX_REASON_CHARS
from triage_proxy.clienttext import (
    LOG_MAX_CHARS,
    consumer_id_problem,
    for_log,
)
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.config.settings import Settings
from triage_proxy.deadletters.writer import DeadLetterWriter
from triage_proxy.errors import FrameError
from triage_proxy.pipeline.dispatch import Dispatcher
from triage_proxy.pipeline.tracker import CommitTracker
from triage_proxy.server.service import _hello
from triage_proxy.server.status import grpc_status
from triage_proxy.store.deadletter_store import MemoryStore
from triage_proxy.store.items import MAX_ITEM_BYTES, PAYLOAD_S3_ATTR, item_size
from triage_proxy.structs import DeadLetter, Record

FORGED = "boom\n2030-01-01 00:00:00 CRITICAL triage_proxy: forged line \x1b[31mred\x1b[0m\x00"
WIDE = "\U0001f600"
"""A printable character that takes 4 bytes of UTF-8: the worst case for an item's size."""


# --- the consumer id at Hello ---------------------------------------------------------


@pytest.mark.parametrize("consumer_id", ["", "worker-1", "x" * 1024, "ü" * MAX_CONSUMER_ID_CHARS])
def test_consumer_ids_within_the_bounds_are_accepted(consumer_id: str) -> None:
    assert consumer_id_problem(consumer_id) is None


@pytest.mark.parametrize("length", [MAX_CONSUMER_ID_CHARS + 1, 500_000])
def test_a_too_long_consumer_id_is_refused_naming_the_field_and_the_limit(length: int) -> None:
    problem = consumer_id_problem("x" * length)
    assert problem is not None
    assert "Hello.consumer_id" in problem
    assert f"{MAX_CONSUMER_ID_CHARS}" in problem
    assert str(length) in problem


@pytest.mark.parametrize("bad", ["\n", "\r", "\x1b[31m", "\x00", "\t", "\u202e", "\u2028", "\x7f"])
def test_a_consumer_id_with_a_non_printable_character_is_refused(bad: str) -> None:
    problem = consumer_id_problem(f"worker{bad}1")
    assert problem is not None
    assert "Hello.consumer_id" in problem
    assert "printable" in problem
    assert f"{MAX_CONSUMER_ID_CHARS}" in problem
    assert problem.isprintable()  # the message quotes the character escaped
    assert "at position 6" in problem


async def _frames(*frames: pb.ConsumerFrame) -> AsyncIterator[pb.ConsumerFrame]:
    for frame in frames:
        yield frame


def hello_of(consumer_id: str) -> pb.Hello:
    frame = pb.ConsumerFrame(hello=pb.Hello(consumer_id=consumer_id, credits=5))
    return asyncio.run(_hello(_frames(frame)))


def test_hello_refuses_a_bad_consumer_id_with_invalid_argument() -> None:
    assert hello_of("x" * 1024).consumer_id == "x" * 1024
    for bad in ("x" * 500_000, "a\nb", "\x1b[31mred"):
        with pytest.raises(FrameError) as info:
            hello_of(bad)
        assert grpc_status(info.value) is grpc.StatusCode.INVALID_ARGUMENT
        assert "Hello.consumer_id" in str(info.value)


# --- logs -------------------------------------------------------------------------------


def test_for_log_escapes_what_could_forge_a_line_or_drive_a_terminal() -> None:
    shown = for_log(FORGED)
    assert shown.isprintable()
    assert "\n" not in shown
    assert "\x1b" not in shown
    assert "\\n2030-01-01" in shown
    assert "\\x1b[31m" in shown
    assert shown.endswith("\\x00")
    assert for_log("a\\nb") == "a\\\\nb"  # a literal backslash-n is told apart from a newline
    assert for_log("wörker 😀 'x'") == "wörker 😀 'x'"  # printable text is left as it is


def test_for_log_cuts_long_text_and_says_how_much() -> None:
    shown = for_log("x" * 10_000)
    assert shown == "x" * LOG_MAX_CHARS + f"...(+{10_000 - LOG_MAX_CHARS} chars)"
    assert for_log("x" * LOG_MAX_CHARS) == "x" * LOG_MAX_CHARS


@given(st.text(max_size=600))
def test_for_log_is_always_one_printable_bounded_line(text: str) -> None:
    shown = for_log(text)
    assert shown.isprintable()
    # Each character escapes to at most 10 ("\U0010ffff"), plus the note of what was cut.
    assert len(shown) <= 10 * LOG_MAX_CHARS + 24


def make_settings() -> Settings:
    return settings_from_dict(
        {
            "kafka": {"bootstrap_servers": "127.0.0.1:1", "topic": "orders", "group_id": "g"},
            "auth": {"token": "0123456789abcdef"},
            "dead_letters": {"table": "dlq"},
        },
        {},
    )


def test_dispatcher_log_lines_show_a_consumer_id_escaped(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="triage_proxy.pipeline.dispatch")
    dispatcher = Dispatcher(make_settings(), 0, CommitTracker(0), lambda dl: None)
    session = connect(dispatcher, "evil\nforged line \x1b[2J", 1)
    dispatcher.settle(session, [99], [])  # rejected: it holds nothing
    dispatcher.close_session(session)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3
    for message in messages:
        assert message.isprintable(), message
        assert "evil\\nforged line \\x1b[2J" in message


def record(offset: int, value: bytes) -> Record:
    return Record("orders", 0, offset, b"k", value, (("h", b"v"),), 1_714_564_800_000)


# --- metadata cannot push an item over the limit ----------------------------------------


def largest_metadata(offset: int, value: bytes) -> DeadLetter:
    """A dead letter whose consumer id and reason are as long as allowed, in 4-byte chars;
    the reason as the dispatcher builds it for a retried nack that exhausted its attempts."""
    reason = f"delivery attempts exhausted ({2**32 - 1}): " + WIDE * MAX_REASON_CHARS
    return DeadLetter(record(offset, value), reason, 2**32 - 1, WIDE * MAX_CONSUMER_ID_CHARS, 0)


def write_all(store: MemoryStore, settings: DeadLetterSettings, dls: list[DeadLetter]) -> None:
    written: list[DeadLetter] = []

    async def main() -> None:
        async with DeadLetterWriter(store, settings, written.append) as writer:
            for dl in dls:
                writer.submit(dl)
            assert await writer.flush(10)
            assert writer.too_large == 0

    asyncio.run(asyncio.wait_for(main(), 20))
    assert written == dls


def test_largest_metadata_with_a_payload_that_fits_inline_is_written() -> None:
    small = largest_metadata(1, b"v" * 1000)
    metadata = item_size(small, GROUP) - 1000
    assert metadata < 40_000  # bounded: a tenth of the item limit at most
    fits = largest_metadata(2, b"v" * (MAX_ITEM_BYTES - metadata))
    assert item_size(fits, GROUP) == MAX_ITEM_BYTES
    store = MemoryStore()
    write_all(store, DeadLetterSettings(table="d", flush_interval_ms=1), [small, fits])
    assert store.dead_letters() == [small, fits]
    assert all(PAYLOAD_S3_ATTR not in item for item in store.items.values())


def test_largest_metadata_with_a_payload_in_s3_is_written() -> None:
    big = largest_metadata(1, b"v" * (4 * MAX_ITEM_BYTES))
    settings = DeadLetterSettings(table="d", flush_interval_ms=1, overflow_bucket="payloads")
    store = MemoryStore(table="d", overflow_bucket="payloads")
    write_all(store, settings, [big])
    assert store.dead_letters() == [big]
    (item,) = store.items.values()
    assert PAYLOAD_S3_ATTR in item
