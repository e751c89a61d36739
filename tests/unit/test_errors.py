"""The error tree drawn in `triage_proxy/errors.py`'s docstring names every error class
built on it, wherever the class lives (the proxy, the CLI, the replay job): the drawing is
where a reader looks for what a caller does next, so a class left out of it is hidden."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from triage_proxy import errors

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("proxy/triage_proxy", "cli/triage_cli", "replay/triage_replay")


def subclasses_of_the_tree() -> dict[str, str]:
    """Class name -> its file, for every class whose bases lead to TriageError (read from
    the source by base name, so nothing is imported)."""
    bases: dict[str, tuple[set[str], str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = {ast.unparse(b) for b in node.bases}
                    bases[node.name] = (names, str(path.relative_to(ROOT)))
    found: dict[str, str] = {}
    tree = {"TriageError"}
    grew = True
    while grew:
        grew = False
        for name, (parents, where) in bases.items():
            if name not in tree and parents & tree:
                tree.add(name)
                found[name] = where
                grew = True
    return found


def test_the_drawn_error_tree_names_every_error_class() -> None:
    drawn = errors.__doc__ or ""
    found = subclasses_of_the_tree()
    assert "OwnershipLost" in found  # the walk finds the tree's own classes
    missing = {n: w for n, w in found.items() if not re.search(rf"\b{n}\b", drawn)}
    assert not missing, f"errors.py's drawn tree lacks {missing}"
