"""One edge per dependency: each external library is reached through one module, and code
that never needs a library does not load it.

These checks read the source (and import modules in a fresh interpreter), so a new
caller that goes past an edge fails here rather than in a review.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

REPLAY_EXECUTOR_MODULES = ("triage_replay.segment", "triage_replay.options", "triage_replay.job")
"""What a Spark executor imports to run a segment (the partition function and its job)."""


def loaded_after_import(*modules: str) -> set[str]:
    """Top-level package names in sys.modules of a fresh interpreter that imported `modules`."""
    code = (
        f"import sys\nfor m in {modules!r}:\n    __import__(m)\n"
        "print(' '.join(sorted({name.split('.')[0] for name in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return set(out.stdout.split())


def test_the_replay_executors_load_neither_grpc_nor_kafka_on_import() -> None:
    """The executors produce with confluent-kafka (imported by the segment that produces,
    not at import) and never serve or call gRPC."""
    loaded = loaded_after_import(*REPLAY_EXECUTOR_MODULES)
    assert "grpc" not in loaded
    assert "confluent_kafka" not in loaded


def test_the_error_tree_loads_no_client_library() -> None:
    loaded = loaded_after_import("triage_proxy.errors")
    assert {"grpc", "confluent_kafka", "boto3", "botocore"} & loaded == set()
