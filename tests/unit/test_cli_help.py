"""`triage --help` (and `triage dlq --help`, `triage config --help`) list every command
with its whole summary on one row when the terminal is wide enough: typer's rich help
prints a docstring's line breaks as they are, which cut summaries mid-sentence."""

from __future__ import annotations

import pytest
import typer.rich_utils
from typer.testing import CliRunner

from triage_cli.main import app


def command_rows(args: list[str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The rows of the Commands panel of `triage ARGS --help` on a 400-column terminal."""
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 400)
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
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
