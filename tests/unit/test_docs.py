"""The documentation site: the generated reference pages are what the code says now
(docs/generate.py), and `mkdocs build --strict` passes (a broken link, a missing
anchor, a snippet that is not there or a page left out of the navigation fails it). The
build is offline: mkdocs.yml enables no plugin that fetches from the internet."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_pages_are_current() -> None:
    gen = generator()
    stale = gen.stale()
    assert not stale, (
        f"docs/reference/{', '.join(stale)} differ from the code: run `python docs/generate.py`\n"
        + "\n".join(gen._diff(name) for name in stale)
    )


def test_the_reference_names_every_setting_command_and_metric() -> None:
    """Not a copy of the generator: what the pages must hold, asked of the code directly."""
    from triage_proxy.config.settings import numeric_settings

    config = (DOCS / "reference" / "configuration.md").read_text()
    for key, (_, bounds) in numeric_settings().items():
        row = next((line for line in config.splitlines() if line.startswith(f"| `{key}` ")), "")
        assert row, f"configuration.md lacks {key}"
        assert bounds.why in row, f"configuration.md's {key} row lacks its bound ({bounds.why})"
    for key in ("auth.token_env", "tls.client_ca_file", "delivery.ordering"):
        assert f"| `{key}` " in config
    cli = (DOCS / "reference" / "cli.md").read_text()
    for command in ("proxy", "dev", "produce", "dlq replay", "deploy", "status", "init"):
        assert f"`triage {command}`" in cli
    assert "supervise" not in cli  # hidden
    metrics = (DOCS / "reference" / "metrics.md").read_text()
    for name in ("triage_lag", "triage_dead_letters_unwritable", "triage_push_limit"):
        assert f"`{name}`" in metrics


def test_the_module_overviews_name_every_key_and_family() -> None:
    """config/sections.py's and observe/metrics.py's docstrings list every key and metric
    family by hand, as an overview for a reader of the module; the reference pages are
    generated, so only this catches a key or family added without its line there."""
    import dataclasses

    from triage_proxy.config import sections
    from triage_proxy.observe import metrics

    assert sections.__doc__ is not None
    for section, cls in sections.SECTIONS.items():
        block = re.search(rf"(?s)\[{section}\](.*?)(?=\n    \[|\n\n)", sections.__doc__)
        assert block is not None, f"sections.py's docstring lacks [{section}]"
        for f in dataclasses.fields(cls):
            if f.metadata.get("config_key", True):
                assert re.search(rf"\b{f.name}\b", block.group(1)), (
                    f"sections.py's docstring lacks {section}.{f.name}"
                )
    assert metrics.__doc__ is not None
    page = (DOCS / "reference" / "metrics.md").read_text()
    for name in re.findall(r"(?m)^\| `(triage_\w+)` ", page):
        assert re.search(rf"\b{name.removesuffix('_total')}", metrics.__doc__), (
            f"metrics.py's docstring lacks {name}"
        )


def test_a_stale_page_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = generator()
    for name in gen.PAGES:
        (tmp_path / name).write_text((DOCS / "reference" / name).read_text())
    (tmp_path / "metrics.md").write_text("# Metrics\n")
    monkeypatch.setattr(gen, "REFERENCE", tmp_path)
    assert gen.stale() == ["metrics.md"]
    assert gen.main(["--check"]) == 1


def test_mkdocs_builds_strict_and_offline(tmp_path: Path) -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    plugins = re.search(r"(?ms)^plugins:\n(.*?)^\S", config)
    assert plugins is not None
    assert re.findall(r"- (\w+)", plugins.group(1)) == ["search"], "a plugin that may fetch"
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "getting-started" / "index.html").is_file()
    assert (tmp_path / "reference" / "configuration" / "index.html").is_file()


def test_the_distributions_share_one_version_and_the_changelog_follows_the_scheme() -> None:
    """docs/releases.md: one version for the four distributions; `## Unreleased` first,
    then `## X.Y.Z - YYYY-MM-DD` sections, newest first."""
    import json
    import tomllib

    versions = {
        path: tomllib.loads((ROOT / path).read_text())["project"]["version"]
        for path in ("pyproject.toml", "proto/pyproject.toml", "client_lib/pyproject.toml")
    }
    package = ROOT / "clients" / "typescript" / "package.json"
    versions["clients/typescript/package.json"] = json.loads(package.read_text())["version"]
    assert len(set(versions.values())) == 1, versions
    headings = re.findall(r"(?m)^## (.*)$", (ROOT / "CHANGELOG.md").read_text())
    assert headings[0] == "Unreleased"
    released = headings[1:]
    bad = [h for h in released if not re.fullmatch(r"\d+\.\d+\.\d+ - \d{4}-\d{2}-\d{2}", h)]
    assert bad == [], f"CHANGELOG headings not `X.Y.Z - YYYY-MM-DD`: {bad}"
    numbers = [tuple(int(n) for n in h.split(" ")[0].split(".")) for h in released]
    assert numbers == sorted(numbers, reverse=True), "releases not newest first"


def fenced(text: str, tag: str) -> list[str]:
    return re.findall(rf"```{tag}\n(.*?)```", text, re.DOTALL)


def test_the_readme_is_short_and_runs_what_the_tests_run() -> None:
    """README.md stays a front page (under 150 lines). Its code blocks are the snippets
    tests/integration/test_getting_started.py runs against the embedded stack (the same
    files docs/getting-started.md includes), and its commands are the set-up commands or
    ones getting-started shows (and that test runs), so none of them can go stale."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 150
    snippets = DOCS / "snippets"
    assert fenced(readme, "python") == [
        (snippets / "consumer.py").read_text(),
        (snippets / "receiver.py").read_text(),
    ]
    assert fenced(readme, "ts") == [(snippets / "consumer.mts").read_text()]
    started = {
        line.strip()
        for block in fenced((DOCS / "getting-started.md").read_text(), "sh")
        for line in block.splitlines()
    }
    setup = [line for block in fenced(readme, "sh") for line in block.splitlines()]
    assert setup[:2] == [
        "python3 -m venv .venv && .venv/bin/pip install -q -e ./proto -e ./client_lib "
        "-e '.[local]' && .venv/bin/triage dev --demo",
        "python3 -m venv .venv && .venv/bin/pip install -q uv && .venv/bin/uv pip install -q "
        "--python .venv/bin/python -e ./proto -e ./client_lib -e '.[dev]' && "
        "scripts/ensure-chromium && .venv/bin/pytest",
    ]
    assert [line for line in setup[2:] if line.strip() not in started] == []
    for inline in re.findall(r"`(\.venv/bin/triage dev[^`]*)`", readme):
        assert inline in started, inline
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert [link for link in links if not (ROOT / link).exists()] == []
