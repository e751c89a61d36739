"""triage_replay: the PySpark job that replays dead letters at scale, or exports them.

`run_replay(ReplayOptions(...)) -> Summary` is the API (`triage dlq replay --spark`
calls it); `python -m triage_replay.job` and `spark-submit replay/triage_replay/job.py`
are the command line. The names below load on first use, so importing this package
imports neither pyspark nor the job module (which `python -m triage_replay.job` runs
as __main__ and must not find imported already).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from triage_proxy.store.query import Filters
    from triage_replay.job import ReplayFailed, Summary, run_replay
    from triage_replay.options import Fault, ReplayOptions

__all__ = ["Fault", "Filters", "ReplayFailed", "ReplayOptions", "Summary", "run_replay"]

_HOMES = {
    "Fault": "triage_replay.options",
    "Filters": "triage_proxy.store.query",
    "ReplayFailed": "triage_replay.job",
    "ReplayOptions": "triage_replay.options",
    "Summary": "triage_replay.job",
    "run_replay": "triage_replay.job",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
