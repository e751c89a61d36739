"""Help text as `triage --help` prints it: plain text, each paragraph one line.

typer prints help through rich, which reads it as markup and prints a docstring's line
breaks as they are. So a docstring wrapped at 90 columns came out ragged on an 80-column
terminal and summaries were cut mid-sentence, and rich took `[partition]`, `[auth]` or
`[[push]]` for style tags and dropped them from the help.
"""

from __future__ import annotations

import inspect
import re

import typer

VERBATIM = re.compile(r"^(\s|[-*] |\d+[.)] |\x08)", re.MULTILINE)
"""A paragraph with a line like these (indented, a list item, click's \\b) keeps its line
breaks in `--help`."""


def plain(text: str) -> str:
    """`text` shown as written by rich's markup (each `[` escaped). An option's help is
    written `help=plain(...)`: typer builds options afresh from their annotations, so
    `reflow_help` cannot reach them."""
    return text.replace("[", "\\[")


def reflowed(doc: str) -> str:
    """`doc` with each paragraph's line breaks made spaces (but VERBATIM paragraphs')."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(p if VERBATIM.search(p) else " ".join(p.split()) for p in paragraphs)


def reflow_help(typer_app: typer.Typer) -> None:
    """Every command's `--help`, and its summary in the commands list, is its docstring
    reflowed (each paragraph on one line, which rich wraps to the terminal) and `plain`.
    Sub-apps (`dlq`, `config`) too."""
    for info in typer_app.registered_commands:
        doc = info.help or (info.callback.__doc__ if info.callback is not None else None)
        if doc:
            info.help = plain(reflowed(doc))
            if info.short_help is None:
                info.short_help = info.help.split("\n\n")[0]
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            reflow_help(group.typer_instance)
