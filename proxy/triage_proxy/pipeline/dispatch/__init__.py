"""Dispatch: one partition's records handed to consumer instances and settled.

`Dispatcher` (dispatcher.py) is the coordinator the fetcher, the committer and the
service talk to; its docstring names the parts and what each one owns.
"""

from triage_proxy.pipeline.dispatch.dispatcher import FRAME_OVERHEAD_BYTES, TICK_S, Dispatcher
from triage_proxy.pipeline.dispatch.sessions import Outlet, Session
from triage_proxy.pipeline.dispatch.window import Counters, Entry, EntryState

__all__ = [
    "FRAME_OVERHEAD_BYTES",
    "TICK_S",
    "Counters",
    "Dispatcher",
    "Entry",
    "EntryState",
    "Outlet",
    "Session",
]
