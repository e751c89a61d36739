"""Unit tests of rendering dead letters for people: never a crash, never a control
character on the terminal (triage_cli.render)."""

from __future__ import annotations

import base64
import json

from hypothesis import given
from hypothesis import strategies as st

from tests.samples import item
from triage_cli.dlq.render import dead_letter_table
from triage_cli.render import (
    hex_dump,
    item_summary,
    one_line,
    render_bytes,
    safe_text,
    short_text,
)
from triage_proxy.store.items import item_key


def test_render_text_json_and_binary() -> None:
    assert render_bytes(None).kind == "null"
    assert render_bytes(b"").kind == "empty"
    assert render_bytes("héllo\nworld".encode()) == render_bytes("héllo\nworld".encode())
    assert render_bytes("héllo\nworld".encode()).kind == "text"
    pretty = render_bytes(b'{"a":[1,2],"b":"\xc3\xa9"}')
    assert pretty.kind == "json"
    assert json.loads(pretty.text) == {"a": [1, 2], "b": "é"}
    assert "\n  " in pretty.text
    assert render_bytes(b"123").kind == "text"  # a bare number is text, not JSON
    dump = render_bytes(bytes(range(20)))
    assert dump.kind == "hex"
    assert dump.text.splitlines()[0].startswith("00000000  00 01 02")
    big = bytes(range(256)) * 20
    assert render_bytes(big) == render_bytes(big)
    assert render_bytes(big).kind == "base64"
    assert base64.b64decode(render_bytes(big).text) == big


def test_json_with_duplicate_keys_stays_text() -> None:
    assert render_bytes(b'{"a": 1, "a": 2}').kind == "text"


def test_terminal_control_characters_are_never_printed() -> None:
    hostile = "ok\x1b[2J\u202eevil\rover".encode()
    shown = render_bytes(hostile)
    assert shown.kind == "hex"  # ESC is a C0 control: not text
    assert "\x1b" not in shown.text
    formatted = render_bytes("plain \u202e bidi\rcr".encode())
    assert formatted.kind == "text"
    assert formatted.text == "plain \\u202e bidi\\rcr"
    assert safe_text("a\tb\nc\x00\x7f\x9b") == "a\tb\nc\\x00\\x7f\\x9b"


@given(st.binary(max_size=600))
def test_rendering_never_crashes_and_never_emits_controls(data: bytes) -> None:
    shown = render_bytes(data, hex_limit=300)
    assert all(c in "\n\t" or ord(c) >= 0x20 for c in shown.text)
    assert not any(0x7F <= ord(c) <= 0x9F for c in shown.text)


def test_hex_dump_layout() -> None:
    lines = hex_dump(b"ABCDEFGHIJKLMNOPQR\x00").splitlines()
    assert lines[0] == "00000000  41 42 43 44 45 46 47 48 49 4a 4b 4c 4d 4e 4f 50  ABCDEFGHIJKLMNOP"
    assert lines[1].startswith("00000010  51 52 00")
    assert lines[1].endswith("QR.")


def test_short_text_for_tables() -> None:
    assert short_text(None) == "(null)"
    assert short_text(b"a\nb") == "a\\nb"
    assert short_text(b"x" * 50, 10) == "x" * 9 + "…"
    assert short_text(b"\x00\x01\xff", 10) == "0x0001ff"


def test_item_summary_is_json_ready() -> None:
    summary = item_summary(item(7, key=b"\x00k", topic="orders", partition=2))
    json.dumps(summary)
    assert summary["topic"] == "orders"
    assert summary["partition"] == 2
    assert summary["offset"] == 7
    assert summary["status"] == "pending"
    assert base64.b64decode(summary["key_b64"]) == b"\x00k"
    assert summary["replayed_at"] is None
    assert item_key(item(7, partition=2)) == ("orders", 2, 7)


def test_one_line_escapes_newlines_tabs_and_controls_visibly() -> None:
    assert one_line("boom\nat line 2\tx\x1b[31m\r") == "boom\\nat line 2\\tx\\x1b[31m\\r"


def _table_text(width: int, *, full: bool, reason: str) -> str:
    from rich.console import Console

    console = Console(width=width, record=True, color_system=None)
    console.print(dead_letter_table([item(7, reason=reason)], "1 dead letter", full=full))
    return console.export_text()


def test_dlq_list_table_is_one_line_per_dead_letter_and_whole_when_not_a_terminal() -> None:
    reason = "ValueError: first line\nsecond line " + "y" * 200 + " END"
    whole = _table_text(1_000_000, full=True, reason=reason)
    row = [line for line in whole.splitlines() if "ValueError" in line]
    assert len(row) == 1  # the newline did not make a second line
    assert "first line\\nsecond line" in row[0]
    assert row[0].rstrip().endswith("END")  # the whole reason, not 80 columns of it
    cut = _table_text(80, full=False, reason=reason)
    assert "END" not in cut
    assert "…" in cut
    assert max(len(line) for line in cut.splitlines()) <= 80
