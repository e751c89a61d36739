"""Which endpoint serves which partition now: the answer to the Topology RPC.

Any proxy of a deployment answers, so a consumer needs one endpoint to find them all.
Each part of the answer comes from where it is true:

- the partitions this process serves: its own state (`serve`, `withdraw`), never the
  table, so they are right even when the table cannot be read;
- the partition count: `kafka.partitions` when configured, else the broker's metadata
  (asked on a pipeline's query thread, cached COUNT_TTL_S); when the broker does not
  answer (or no partition is open yet, at start), the last count read (or this process's
  partitions), with `complete = false`, and the count is asked again after
  COUNT_RETRY_S;
- every other partition, with `ownership.enabled`: its lease item, which carries the
  holder's advertised endpoint (store/leases.py). One BatchGetItem reads them all; the
  answer is cached LEASES_TTL_S, so a burst of consumers costs one read. A table that
  cannot be read leaves them NONE with `complete = false`: never a guessed endpoint.
- with ownership off: the configured layout, `server.advertised_endpoint(p)` (host
  `server.advertised_host`, port `server.advertised_port` or `server.port`, plus p). A
  layout whose ports are picked at start (port 0) is unknown: NONE, `complete = false`.

A standby waits without writing anything to the table, so it cannot be seen; what the
states say with ownership on is what the lease item shows (`plan_routes`):

    SERVING       a live lease that names its holder's endpoint
    STANDBY_ONLY  a live lease without an endpoint (its holder is starting and has not
                  bound its port yet, or is a proxy that predates `endpoint` and writes none:
                  `complete = false` then says which), or a lease that lapsed less than
                  `ownership.lease_s` ago (its holder is gone; a waiting standby takes
                  over within that time): try again soon
    NONE          no lease item (never held, or released by a graceful stop; a waiting
                  standby takes a released lease within a second), or one that lapsed
                  longer ago than `lease_s` (no standby took it over, so none waits)

This process's own partition while it stops (`withdraw`) is STANDBY_ONLY with ownership
on (its release hands it to a waiting standby at once) and NONE with it off.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from triage_proxy.config.settings import Settings
from triage_proxy.errors import BrokerUnavailable, TableUnavailable
from triage_proxy.observe.logthrottle import LogThrottle
from triage_proxy.pipeline.ownership import wall_ms
from triage_proxy.store.leases import Lease, LeaseReader

logger = logging.getLogger(__name__)
_count_failures = LogThrottle(logger)
"""A failed count read is retried every COUNT_RETRY_S while clients ask: one line per
cause per interval."""

LEASES_TTL_S = 1.0
"""How long one read of the lease items answers Topology calls."""
COUNT_TTL_S = 5.0
"""How long one read of the topic's partition count from the broker is used."""
COUNT_RETRY_S = 0.5
"""How long a failed read of the partition count answers before it is tried again. Short:
a proxy asked before its first partition opens fails the read, and holding that for
COUNT_TTL_S made its answer incomplete for up to 5 s after it started serving."""
TABLE_UNREADABLE = "the lease table could not be read: only this proxy's partitions are known"
"""The problem an answer gives when the lease items could not be read (no details: the
table's address and AWS's words stay in this proxy's log)."""
PROBLEMS_SHOWN = 3
"""Most problems spelled out in `TopologyAnswer.problem` (the rest are counted)."""


class RouteState(enum.Enum):
    """PartitionRoute.State, see the module docstring for what each means here."""

    SERVING = "serving"
    STANDBY_ONLY = "standby_only"
    NONE = "none"


@dataclass(frozen=True)
class Route:
    """Where one partition is served now."""

    partition: int
    """The partition."""
    state: RouteState
    """Serving, standby only or none."""
    endpoint: str = ""
    """host:port a consumer dials; set exactly when SERVING."""
    owner: str = ""
    """The serving proxy's id (its lease owner id); "" unless SERVING and known."""


@dataclass(frozen=True)
class TopologyAnswer:
    """What a Topology call answers."""

    topic: str
    """The topic."""
    partition_count: int
    """Partitions of the topic (0 .. partition_count - 1)."""
    routes: tuple[Route, ...]
    """One per partition, in partition order."""
    problem: str = ""
    """Why the answer is incomplete; "" when it is complete."""

    @property
    def complete(self) -> bool:
        return not self.problem

    def route(self, partition: int) -> Route | None:
        """The route of `partition`, or None when the topic has no such partition."""
        return self.routes[partition] if 0 <= partition < len(self.routes) else None


def plan_routes(
    count: int,
    *,
    owner: str,
    served: Mapping[int, str],
    withdrawn: Collection[int] = (),
    ownership: bool,
    leases: Mapping[int, Lease] | None,
    layout: Callable[[int], str | None],
    now_ms: int,
    lease_ms: int,
) -> tuple[list[Route], list[str]]:
    """The route of every partition 0..count-1, and what could not be known (pure).

    `served`: this process's serving partitions -> its endpoint; `withdrawn`: its
    partitions that are stopping. With `ownership`, `leases` holds the lease items read
    (None: the table could not be read); without it, `layout(p)` is the configured
    endpoint (None: not known before its proxy binds).
    """
    routes: list[Route] = []
    problems: list[str] = []
    for p in range(count):
        if p in served:
            routes.append(Route(p, RouteState.SERVING, served[p], owner))
        elif not ownership:
            endpoint = None if p in withdrawn else layout(p)
            if endpoint is None and p not in withdrawn:
                problems.append(f"partition {p}: endpoint unknown (server.port is 0)")
            if endpoint is None:
                routes.append(Route(p, RouteState.NONE))
            else:
                routes.append(Route(p, RouteState.SERVING, endpoint))
        elif leases is None:
            routes.append(Route(p, RouteState.NONE))
        else:
            routes.append(_from_lease(p, leases.get(p), owner, now_ms, lease_ms, problems))
    return routes, problems


def _from_lease(
    p: int, lease: Lease | None, owner: str, now_ms: int, lease_ms: int, problems: list[str]
) -> Route:
    if lease is None:
        return Route(p, RouteState.NONE)
    if lease.owner == owner:  # ours, but not served: we are stopping
        return Route(p, RouteState.STANDBY_ONLY)
    if lease.until_ms >= now_ms:
        if lease.endpoint:
            return Route(p, RouteState.SERVING, lease.endpoint, lease.owner)
        problems.append(
            f"partition {p}: its holder advertises no endpoint (starting, or its version has none)"
        )
        return Route(p, RouteState.STANDBY_ONLY)
    if now_ms - lease.until_ms <= lease_ms:
        return Route(p, RouteState.STANDBY_ONLY)
    return Route(p, RouteState.NONE)


def describe_problems(problems: Sequence[str]) -> str:
    """The problems as one bounded line ("" for none)."""
    shown = "; ".join(problems[:PROBLEMS_SHOWN])
    if len(problems) > PROBLEMS_SHOWN:
        shown += f"; and {len(problems) - PROBLEMS_SHOWN} more"
    return shown


class Topology:
    """Answers Topology calls for a process that serves some partitions of the topic
    (a pinned partition, or what a fleet process is assigned; the set is what it tracks).
    Reads are cached and made by one caller at a time, so a burst of calls costs one read
    of each source."""

    def __init__(
        self,
        settings: Settings,
        owner: str,
        *,
        leases: LeaseReader | None = None,
        partition_count: Callable[[], Awaitable[int]] | None = None,
        wall_clock_ms: Callable[[], int] = wall_ms,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self.owner = owner
        """This process's id (its lease owner id)."""
        self._reader = leases
        """The lease items (with ownership on; None: not readable here)."""
        self._count_source = partition_count
        """Asks the broker (a pipeline's query thread); None: only `kafka.partitions` is known."""
        self._wall_ms = wall_clock_ms
        self._monotonic = monotonic
        self._served: dict[int, str] = {}
        self._withdrawn: set[int] = set()
        self._lock = asyncio.Lock()
        self._count: int | None = None
        self._count_problem = ""
        self._count_due = -float("inf")
        """When the partition count is next read (monotonic)."""
        self._leases: dict[int, Lease] | None = None
        self._leases_at = -float("inf")
        self._table_failing = False

    @property
    def served(self) -> Mapping[int, str]:
        """Partitions this process serves now -> the endpoint it advertises for each."""
        return dict(self._served)

    def serve(self, partition: int, endpoint: str) -> None:
        """From now on this process serves `partition` at `endpoint`."""
        self._served[partition] = endpoint
        self._withdrawn.discard(partition)

    def withdraw(self, partition: int) -> None:
        """This process stops serving `partition` (shutdown, or a lost lease)."""
        if self._served.pop(partition, None) is not None:
            self._withdrawn.add(partition)

    async def answer(self) -> TopologyAnswer:
        """The topology as this process knows it now (see the module docstring)."""
        settings = self._settings
        ownership = settings.ownership.enabled
        async with self._lock:
            now = self._monotonic()
            if now >= self._count_due:
                await self._read_count()
            count = self._count or 0
            if ownership and now - self._leases_at >= LEASES_TTL_S:
                await self._read_leases(count)
            leases = self._leases
        problems: list[str] = []
        if self._count_problem:
            problems.append(self._count_problem)
        count = max([count, *(p + 1 for p in (*self._served, *self._withdrawn))])
        if ownership and leases is None:
            problems.append(TABLE_UNREADABLE)
        routes, unknown = plan_routes(
            count,
            owner=self.owner,
            served=self._served,
            withdrawn=self._withdrawn,
            ownership=ownership,
            leases=leases,
            layout=settings.server.advertised_endpoint,
            now_ms=self._wall_ms(),
            lease_ms=round(settings.ownership.lease_s * 1000),
        )
        return TopologyAnswer(
            topic=settings.kafka.topic,
            partition_count=count,
            routes=tuple(routes),
            problem=describe_problems(problems + unknown),
        )

    async def _read_count(self) -> None:
        read = False
        try:
            read = await self._ask_count()
        finally:
            # From when the answer came: a slow failure must not make every caller
            # queued behind it try again.
            self._count_due = self._monotonic() + (COUNT_TTL_S if read else COUNT_RETRY_S)

    async def _ask_count(self) -> bool:
        """Reads the count; False if the broker did not answer (try again sooner)."""
        configured = self._settings.kafka.partitions
        if configured is not None:
            self._count, self._count_problem = configured, ""
            return True
        if self._count_source is None:
            self._count_problem = "" if self._count else "the topic's partition count is unknown"
            return True
        try:
            self._count, self._count_problem = await self._count_source(), ""
        except BrokerUnavailable as exc:
            _count_failures.warning(
                str(exc), "topology: the partition count could not be read: %s", exc
            )
            known = "the last count read" if self._count else "this proxy's partitions only"
            self._count_problem = f"the broker did not report the partition count ({known})"
            return False
        return True

    async def _read_leases(self, count: int) -> None:
        try:
            await self._ask_leases(count)
        finally:
            self._leases_at = self._monotonic()  # from when the answer came, see above

    async def _ask_leases(self, count: int) -> None:
        reader = self._reader
        wanted = sorted({*range(count), *self._served, *self._withdrawn})
        try:
            if reader is None:
                self._leases = None
                return
            self._leases = await asyncio.to_thread(reader.get_many, wanted)
        except TableUnavailable as exc:
            self._leases = None
            if not self._table_failing:
                logger.warning("topology: %s; answering with this proxy's own partitions", exc)
            self._table_failing = True
            return
        if self._table_failing:
            logger.info("topology: the lease table answers again")
        self._table_failing = False
