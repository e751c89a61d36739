"""Tansu's binary, resolved by several processes at once on a machine that never ran it.

The test run's workers each start a broker as the run begins; on a fresh machine each
found no binary in ~/.calfkit/bin and copied it there, and a copy renamed in after
another worker had been handed the path left that worker a file it could not execute
(CI on a fresh machine: 58 errors, "Permission denied"). Real processes, a real wheel,
a home folder of the test's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROCESSES = 6
"""As many as the test run's workers."""

RESOLVE = """
import json, os, sys
from triage_cli.embedded import broker_binary
path = broker_binary()
print(json.dumps({"path": path, "inode": os.stat(path).st_ino}))
"""


def test_processes_resolving_at_once_are_all_handed_the_one_executable_file(
    tmp_path: Path,
) -> None:
    env = {key: value for key, value in os.environ.items() if key != "CALF_TANSU_BIN"}
    env["HOME"] = str(tmp_path)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", RESOLVE], env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(PROCESSES)
    ]
    handed = []
    for child in children:
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        handed.append(json.loads(out))

    paths = {entry["path"] for entry in handed}
    assert len(paths) == 1
    path = Path(paths.pop())
    assert path.is_relative_to(tmp_path)
    # Every process holds the file that stays: none was replaced after it was handed out.
    assert {entry["inode"] for entry in handed} == {path.stat().st_ino}
    assert os.access(path, os.X_OK)
    assert not [name for name in os.listdir(path.parent) if name.endswith(".tmp")]
