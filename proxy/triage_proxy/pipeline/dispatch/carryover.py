"""What crosses a restart: what the previous run left the window, and what this run leaves.

A previous run recorded the offsets it settled above its committed offset (commit
metadata) and the failed-delivery counts of its unsettled records (checkpoint item). When
the window fetches such an offset again, a settled one is skipped and a failed one's entry
continues from that count (`Window.add`). This run's own failed-delivery counts are kept
here too, for the committer to persist (`failures`, `failures_version`).

Settling costs nothing here: the counts of offsets settled since are dropped only when the
counts are read or grow past a cap.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from triage_proxy.pipeline.tracker import CommitTracker

if TYPE_CHECKING:
    from triage_proxy.pipeline.dispatch.window import Entry

FAILURES_CAP_MIN = 1024
"""Counts kept before the ones of settled offsets are dropped (the cap doubles with use)."""


class Carryover:
    """The previous run's settled-above offsets and failure counts, and this run's counts."""

    def __init__(
        self,
        tracker: CommitTracker,
        entries: Mapping[int, Entry],
        already_settled: Collection[int] = (),
        prior_failures: Mapping[int, int] | None = None,
    ) -> None:
        self._tracker = tracker
        self._entries = entries
        """The window's unsettled entries (read only, to drop the counts of settled ones)."""
        self.skip = set(already_settled)
        """Offsets a previous run settled above its committed offset (the window removes
        each as it fetches it)."""
        self._skip_sorted = sorted(self.skip)
        """The same, in order, for `settled_ahead` (the part not fetched yet)."""
        self.prior = {o: n for o, n in (prior_failures or {}).items() if o not in self.skip}
        """Failed deliveries a previous run counted, by offset, until the offset is fetched
        again (the window pops each into `counts` and its entry's attempt)."""
        self.counts: dict[int, int] = {}
        """Failed deliveries by offset, of entries that failed at least once."""
        self._cap = FAILURES_CAP_MIN
        self.failures_version = 0
        """Moves whenever a count in `failures` went up (the committer's cue to write it)."""

    @property
    def resuming(self) -> bool:
        """A previous run's failure counts wait for offsets not fetched again yet."""
        return bool(self.prior)

    def count_failure(self, entry: Entry) -> None:
        """A delivery of `entry` failed: its count (`attempt`) is what the committer keeps."""
        counts = self.counts
        counts[entry.record.offset] = entry.attempt  # every counted delivery failed
        self.failures_version += 1
        if len(counts) > self._cap:
            self._prune()

    def failures(self) -> dict[int, int]:
        """Failed deliveries by offset of the unsettled records that failed at least once,
        including a previous run's counts for offsets not fetched again yet (what the
        committer persists)."""
        self._prune()
        return {**self.prior, **self.counts}

    def settled_ahead(self) -> list[int]:
        """Offsets a previous run settled that this run has not fetched yet (sorted, all at
        or above where fetching continues): still settled, so the committer keeps them in
        what it records. Without them a restarted proxy's first commits would record only
        the part of that run's set its fetch had reached (the window may hold it back for
        long), and a kill then would redeliver the rest."""
        ahead = self._skip_sorted
        if not ahead:
            return []
        start = bisect.bisect_left(ahead, self._tracker.next_offset)
        if start == len(ahead):
            self._skip_sorted = []  # all fetched: nothing to look at again
            return []
        return ahead[start:]

    def _prune(self) -> None:
        entries = self._entries
        self.counts = {o: n for o, n in self.counts.items() if o in entries}
        self._cap = max(FAILURES_CAP_MIN, 2 * len(self.counts))
