"""Bulk replay and discard, running in the background while the page shows progress.

`Jobs` owns every job's task (a set that `stop()` signals and awaits) and what each
job reported last (`BulkResult`), which the page polls. A job runs
`DeadLetters.bulk` in a worker thread; its stop event ends it between chunks of a
replay (the chunk in hand is settled first, as `triage dlq replay` does on Ctrl-C) and
between items of a discard. Finished jobs are
kept (the last MAX_KEPT) so a page that reloads still finds its result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from triage_cli.console.deadletters import BulkResult, DeadLetters

if TYPE_CHECKING:
    from triage_proxy.store.query import Filters

logger = logging.getLogger(__name__)

MAX_KEPT = 50
"""Finished jobs remembered (the oldest is forgotten first)."""


class JobState(enum.Enum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class Job:
    """One bulk replay or discard, as the page sees it."""

    id: str
    action: str
    filters: dict[str, Any]
    state: JobState = JobState.RUNNING
    result: BulkResult | None = None
    error: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)

    def to_json(self) -> dict[str, Any]:
        result = dataclasses.asdict(self.result) if self.result is not None else None
        return {
            "id": self.id,
            "action": self.action,
            "filters": self.filters,
            "state": self.state.value,
            "result": result,
            "error": self.error,
        }


class Jobs:
    """The console's background bulk work (see the module docstring)."""

    def __init__(self, deadletters: DeadLetters) -> None:
        self._deadletters = deadletters
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def start(self, action: str, filters: Filters, shown: dict[str, Any]) -> Job:
        """Start replaying or discarding what `filters` selects; `shown` is the filter
        as the page describes it."""
        if self._closed:
            from triage_proxy.errors import ShuttingDown

            raise ShuttingDown("the console is stopping: no new job")
        job = Job(id=secrets.token_hex(8), action=action, filters=shown)
        self._jobs[job.id] = job
        self._forget_old()
        task = asyncio.create_task(self._run(job, filters), name=f"console-job-{job.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        logger.info("%s of %s started (job %s)", action, shown, job.id)
        return job

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    async def _run(self, job: Job, filters: Filters) -> None:
        from triage_proxy.errors import TriageError

        def progress(result: BulkResult) -> None:
            job.result = dataclasses.replace(result, failures=list(result.failures))

        try:
            job.result = await asyncio.to_thread(
                self._deadletters.bulk, job.action, filters, progress=progress, stop=job.stop
            )
        except TriageError as exc:
            job.state, job.error = JobState.FAILED, str(exc)
            logger.warning("job %s failed: %s", job.id, exc)
            return
        except Exception as exc:
            job.state, job.error = JobState.FAILED, f"internal error: {exc}"
            logger.exception("job %s failed", job.id)
            return
        job.state = JobState.STOPPED if job.result.interrupted else JobState.DONE
        logger.info("job %s %s: %s", job.id, job.state.value, job.result)

    def _forget_old(self) -> None:
        finished = [j for j in self._jobs.values() if j.state is not JobState.RUNNING]
        for job in finished[: max(0, len(self._jobs) - MAX_KEPT)]:
            del self._jobs[job.id]

    async def stop(self) -> None:
        """Signal every running job to stop after its chunk and wait for it; safe twice."""
        self._closed = True
        for job in self._jobs.values():
            job.stop.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
