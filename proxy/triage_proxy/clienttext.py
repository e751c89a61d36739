"""Text a consumer instance sends (its consumer id, nack reasons): how much of it is kept,
and how a log line shows it.

Why one home: a client is authenticated, not trusted, and its text lands in two places.
In a dead-letter item it is data: kept byte-exact but bounded, so that metadata alone can
never push an item over DynamoDB's item limit (store/items.py). In a log line it is
escaped and cut, so that it cannot forge lines (a newline), drive the terminal of whoever
reads the log (ANSI escapes) or flood it.

    Hello.consumer_id   at most MAX_CONSUMER_ID_CHARS characters, all printable; checked
                        at Hello (service.py), which refuses the stream otherwise
                        (FrameError: INVALID_ARGUMENT)
    Nack.reason         cut to MAX_REASON_CHARS characters (dispatcher.py) before it
                        becomes a dead letter's reason
    in a log line       `for_log`: non-printable characters and backslashes escaped the
                        way `repr` does, cut to LOG_MAX_CHARS characters

"Printable" is `str.isprintable`: no control characters (newline, tab, ESC, NUL ...), no
format characters (bidirectional overrides, zero-width ...), no separators but the space.
"""

from __future__ import annotations

from triage_protocol.constants import MAX_CONSUMER_ID_CHARS

__all__ = [
    "LOG_MAX_CHARS",
    "consumer_id_problem",
    "for_log",
]

LOG_MAX_CHARS = 256
"""Most characters of one client-sent value a log line shows; the rest is counted."""


def consumer_id_problem(consumer_id: str) -> str | None:
    """Why `consumer_id` is refused at Hello (names the field and the limit), or None."""
    if len(consumer_id) > MAX_CONSUMER_ID_CHARS:
        return (
            f"Hello.consumer_id has {len(consumer_id)} characters, over the limit of "
            f"{MAX_CONSUMER_ID_CHARS}"
        )
    if not consumer_id.isprintable():
        at, char = next((i, c) for i, c in enumerate(consumer_id) if not c.isprintable())
        return (
            f"Hello.consumer_id must be at most {MAX_CONSUMER_ID_CHARS} printable characters: "
            f"{_escape(char)} at position {at} is not printable"
        )
    return None


def for_log(text: str, limit: int = LOG_MAX_CHARS) -> str:
    """`text` as a log line may show it: every non-printable character and backslash
    escaped as `repr` would (a newline becomes the two characters backslash-n), and cut to
    `limit` characters with a note of how many more there were."""
    shown = text[:limit]
    if not shown.isprintable() or "\\" in shown:
        shown = "".join(c if c.isprintable() and c != "\\" else _escape(c) for c in shown)
    if len(text) > limit:
        shown += f"...(+{len(text) - limit} chars)"
    return shown


def _escape(char: str) -> str:
    """One character as `repr` spells it inside quotes: \\n, \\x1b, \\u202e, \\\\."""
    return repr(char)[1:-1]
