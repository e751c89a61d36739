"""Key locks: with `delivery.ordering = "key"`, one record per key in the consumers' hands.

A key is owned by one entry at a time, from the moment it enters the queue until it is
acked or handed to the dead-letter writer; later records with that key wait behind it
(WAITING), so they are never in flight together and go in offset order. Null keys are
unordered. Retries and redeliveries keep the key: only a settlement releases it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from triage_proxy.pipeline.dispatch.window import Entry, EntryState


class KeyLocks:
    """Which entry owns each key, and who waits behind it."""

    def __init__(self) -> None:
        self._owner: dict[bytes, Entry] = {}
        self._waiting: dict[bytes, deque[Entry]] = {}

    def admit(self, entries: list[Entry]) -> list[Entry]:
        """Freshly fetched `entries` (in offset order): those whose key is free (or null)
        own it now and are returned; the others wait (WAITING) behind its owner."""
        owner = self._owner
        free: list[Entry] = []
        for entry in entries:
            key = entry.record.key
            if key is None:
                free.append(entry)
            elif key in owner:
                entry.state = EntryState.WAITING
                self._waiting.setdefault(key, deque()).append(entry)
            else:
                owner[key] = entry
                free.append(entry)
        return free

    def release(self, entries: Iterable[Entry]) -> list[Entry]:
        """`entries` are done (acked or dead-lettering): the next record with each one's
        key owns it now. Returns those successors, still WAITING, in release order."""
        owner = self._owner
        successors: list[Entry] = []
        for entry in entries:
            key = entry.record.key
            if key is None or owner.get(key) is not entry:
                continue
            waiting = self._waiting.get(key)
            if not waiting:
                del owner[key]
                continue
            successor = waiting.popleft()
            if not waiting:
                del self._waiting[key]
            owner[key] = successor
            successors.append(successor)
        return successors
