"""`triage --help` (and `triage dlq --help`, `triage config --help`) list every command
with its whole summary on one row when the terminal is wide enough, and a command's own
`--help` prints each paragraph of its docstring as one, wrapped to the terminal: typer's
rich help prints a docstring's line breaks as they are, which cut summaries mid-sentence
and left long help ragged."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main
import typer.rich_utils
from typer.testing import CliRunner

from triage_cli.helptext import reflowed
from triage_cli.main import app


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


def commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every command below `group` (hidden ones too; a click command of
    typer's own click)."""
    for name, command in getattr(group, "commands", {}).items():
        yield (*path, name)
        yield from commands(command, (*path, name))


def test_help_text_prints_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """Brackets in a command's docstring or an option's help (`topic[partition]@offset`,
    `[[push]]`, `[auth]`, `[default: ...]`) print as they are: rich reads help as markup
    and dropped what looked like a style tag, unless it was written through `plain`."""
    root: Any = typer.main.get_command(app)
    checked = 0
    for path in commands(root):
        command = root
        for name in path:
            command = command.commands[name]
        texts = [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]
        shown = " ".join(
            " ".join(line.strip("│ ").split()) for line in help_lines(list(path), monkeypatch)
        )
        for text in texts:
            for bracketed in re.findall(r"\[[^\]]*\]+", text.replace("\\[", "[")):
                assert " ".join(bracketed.split()) in shown, (path, bracketed)
                checked += 1
    assert checked >= 4  # produce, proxy, init --push and the dlq commands' --group at least
