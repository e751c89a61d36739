"""`triage --help` (and `triage dlq --help`, `triage config --help`) list every command
with its whole summary on one row when the terminal is wide enough, and a command's own
`--help` prints each paragraph of its docstring as one, wrapped to the terminal: typer's
rich help prints a docstring's line breaks as they are, which cut summaries mid-sentence
and left long help ragged."""

from __future__ import annotations

import pytest
import typer.rich_utils
from typer.testing import CliRunner

from triage_cli.main import app, reflowed


def help_lines(args: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`triage ARGS --help` on a 400-column terminal, by line."""
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 400)
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def command_rows(args: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The rows of the Commands panel of `triage ARGS --help` on a 400-column terminal."""
    lines = help_lines(args, monkeypatch)
    start = next(i for i, line in enumerate(lines) if "Commands" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("╰"))
    return [line.removeprefix("│").rstrip("│ ") for line in lines[start + 1 : end]]


@pytest.mark.parametrize(
    ("args", "commands"),
    [
        (
            [],
            {"proxy", "dev", "init", "deploy", "destroy", "status", "produce", "console"}
            | {"dlq", "config"},
        ),
        (["dlq"], {"list", "show", "replay", "discard", "migrate"}),
        (["config"], {"check"}),
    ],
)
def test_each_command_is_one_row(
    args: list[str], commands: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = command_rows(args, monkeypatch)
    # a row that continues the one above has a blank name column
    assert [row for row in rows if not row[1:2].strip()] == []
    assert {row.split()[0] for row in rows} == commands


def test_a_summary_wrapped_in_its_docstring_prints_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = command_rows([], monkeypatch)
    (dev,) = [row for row in rows if row.split()[0] == "dev"]
    assert dev.split(None, 1)[1] == (
        "Start a broker, a DynamoDB endpoint and one proxy per partition on this machine; "
        "with --push, the proxies deliver to a URL themselves (no client needed)."
    )


def test_a_commands_help_prints_each_paragraph_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [line.strip() for line in help_lines(["proxy"], monkeypatch)]
    assert (
        "With --partition (repeatable) it serves those partitions; without, it joins the "
        "topic's fleet: the deployment's consumer group assigns it partitions, and it serves "
        "each one once it holds that partition's lease."
    ) in lines


def test_lists_and_indented_paragraphs_keep_their_line_breaks() -> None:
    doc = """Summary
    wrapped.

    - one item
    - another

        indented
        code

    Prose that
    wraps."""
    assert reflowed(doc) == (
        "Summary wrapped.\n\n- one item\n- another\n\n    indented\n    code\n\nProse that wraps."
    )
