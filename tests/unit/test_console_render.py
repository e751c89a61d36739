"""How the console shows a key, value or header, and how it names a dead letter (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from triage_cli.console.deadletters import HEX_LIMIT, blob, key_text, parse_key


def test_text_json_and_hex_views() -> None:
    doc = blob(b'{"a": [1, 2]}')
    assert doc["auto"] == "json"
    assert doc["json"] == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    assert doc["text"] == '{"a": [1, 2]}'
    assert doc["hex"].startswith("00000000  7b 22 61 22")

    binary = blob(b"\x00\x01\xff\xfe")
    assert binary["auto"] == "hex"
    assert binary["utf8"] is False
    assert binary["json"] is None
    assert "00 01 ff fe" in binary["hex"]

    text = blob(b"plain words")
    assert (text["auto"], text["json"]) == ("text", None)


def test_control_characters_are_escaped_in_the_text_view() -> None:
    doc = blob("bidi \u202e override \x1b[31m".encode())
    assert "\u202e" not in doc["text"]
    assert "\x1b" not in doc["text"]
    assert "\\u202e" in doc["text"]


def test_null_and_large_values() -> None:
    assert blob(None)["null"] is True
    big = blob(b"\x00" * (HEX_LIMIT + 10))
    assert big["truncated"] is True
    assert big["size"] == HEX_LIMIT + 10
    assert big["hex"].count("\n") == HEX_LIMIT // 16 - 1


def test_dead_letter_ids() -> None:
    assert parse_key("orders.v1/3/1234") == ("orders.v1", 3, 1234)
    assert parse_key("a/b/0/1") == ("a/b", 0, 1)  # only the last two parts are numbers
    for bad in ("orders/3", "orders/x/1", "orders/1/-1", "/1/2", "orders/1/99999999999999999999"):
        with pytest.raises(ValueError, match=r"dead letter id|whole number"):
            parse_key(bad)


@given(st.text(min_size=1).filter(lambda t: "/" not in t), st.integers(0, 2**31),
       st.integers(0, 2**62))  # fmt: skip
def test_ids_round_trip(topic: str, partition: int, offset: int) -> None:
    assert parse_key(key_text((topic, partition, offset))) == (topic, partition, offset)
