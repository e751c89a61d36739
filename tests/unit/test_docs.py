"""The documentation site: `mkdocs build --strict` passes (a broken link, a missing
anchor, a snippet that is not there or a page left out of the navigation fails it). The
build is offline: mkdocs.yml enables no plugin that fetches from the internet."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
