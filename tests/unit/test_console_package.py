"""The console's assets ship in the wheel and come from nowhere else."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "cli" / "triage_cli" / "console"
STATIC = PACKAGE / "static"


def test_package_data_covers_every_asset() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["triage_cli.console"]
    shipped = {path for pattern in patterns for path in PACKAGE.glob(pattern) if path.is_file()}
    assets = {path for path in STATIC.rglob("*") if path.is_file()}
    assert sorted(p.relative_to(PACKAGE).as_posix() for p in assets - shipped) == []


def test_the_chart_library_is_vendored_with_its_licence() -> None:
    vendor = STATIC / "vendor" / "uplot"
    assert (vendor / "uplot.iife.min.js").stat().st_size > 10_000
    assert (vendor / "uplot.min.css").exists()
    assert "MIT License" in (vendor / "LICENSE").read_text()


def test_no_page_or_script_loads_from_elsewhere_or_writes_markup() -> None:
    for path in STATIC.glob("*.*"):
        text = path.read_text()
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), path
        if path.suffix == ".js":
            assert "innerHTML" not in text, path
            assert "outerHTML" not in text, path
            assert "insertAdjacentHTML" not in text, path
            assert "document.write" not in text, path
            assert "eval(" not in text, path
        if path.suffix == ".html":
            assert "<script" not in text, f"{path}: scripts come from the shell, as files"
            assert "style=" not in text, path
