"""kafka.records_of: the column-by-column build of the common batch gives the same Records
as the per-message one (which takes batches with headers or errors). Errors are left out
here: a confluent-kafka Message built by hand with an error breaks its own error() (a
SystemError), unlike one that librdkafka made."""

from __future__ import annotations

from confluent_kafka import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from triage_proxy.kafka import records_of
from triage_proxy.structs import Record

BLOB = st.none() | st.binary(max_size=50)
ROW = st.tuples(
    BLOB,
    BLOB,
    st.none() | st.lists(st.tuples(st.text(max_size=5), BLOB), max_size=2),
    st.integers(min_value=0, max_value=2**41),
)


def expected(topic: str, messages: list[Message]) -> list[Record]:
    return [
        Record(
            topic,
            m.partition(),
            m.offset(),
            m.key(),
            m.value(),
            tuple(m.headers() or ()),
            m.timestamp()[1],
        )
        for m in messages
        if m.error() is None
    ]


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(ROW, max_size=10), plain=st.booleans())
def test_records_of_matches_one_by_one(
    rows: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]] | None, int]],
    plain: bool,
) -> None:
    messages = [
        Message(
            topic="t",
            partition=3,
            offset=offset,
            key=key,
            value=value,
            headers=None if plain else headers,
            error=None,
            timestamp=(1, timestamp),
        )
        for offset, (key, value, headers, timestamp) in enumerate(rows)
    ]
    got = records_of("t", messages)
    assert got == expected("t", messages)
    assert all(type(record) is Record for record in got)
