"""Exclusive ownership of a partition: a lease item in DynamoDB, renewed by its holder.

Why: two proxies configured for the same (topic, partition) (a rolling restart, a
supervisor that restarted a process it wrongly thought dead, two deployments by
mistake) would both deliver every message. With `ownership.enabled`, a proxy delivers
only while it holds the partition's lease; the other one waits as a standby and takes
over when the lease lapses (the holder died) or is released (the holder stopped).

The lease item and its three conditional writes (acquire, renew, release) are the
store package's (`store/leases.py`); this module decides when to make them. Acquire and
renew also write `endpoint`, where the holder serves consumers (`server.advertised_*`),
which the Topology RPC of every proxy reads (topology.py).

Fencing. The standby compares `lease_until_ms` (the holder's wall clock when it SENT the
write, plus lease_s) with its own wall clock. The holder, in turn, counts its lease as
valid only until monotonic(sent) + lease_s - margin (margin = lease_s / 5), however long
the write took to answer and whether DynamoDB answers at all. When that passes without a
successful renewal it stops delivering at once (`on_lost`) and the proxy exits with
OwnershipLost. So the two never deliver at once as long as the hosts' wall clocks differ
by less than the margin minus the holder's event-loop stalls (NTP keeps clocks within
milliseconds; the margin is 2 s with the default 10 s lease).

The group fence. The lease item lives in the deployment's own table, so it fences only
the processes that share it. A pinned proxy, which is no member of the consumer group,
is also given a `fence` (kafka/groups.py `GroupFence.busy`): while it names a reason (the
group has live members: a fleet, of whatever table, runs the partitions by the group
protocol), the standby does not take the lease (it logs why, once, and asks again every
renew_every_s), and a holder asks it after every renewal and stops delivering at once
when it answers (`on_lost`, then OwnershipLost naming the reason). A fleet's process is
a member: the coordinator gives each partition to one member, whatever its table, so it
gets no fence. The bound: a pinned holder stops at most renew_every_s after the group
gains a live member (its commits are refused from then on, so nothing is lost; what it
delivered in that interval may be delivered again).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from triage_proxy.config.sections import OwnershipSettings
from triage_proxy.errors import OwnershipLost, StateError, TableUnavailable
from triage_proxy.pipeline.policies import backoff
from triage_proxy.store.items import format_iso_ms
from triage_proxy.store.leases import Lease, LeaseStore
from triage_proxy.waiting import wait_any

logger = logging.getLogger(__name__)

MARGIN_FRACTION = 0.2
"""The holder gives its lease up this share of lease_s before the standby may take it."""
STANDBY_POLL_S = 1.0
"""Longest wait between a standby's attempts (a released lease is noticed this fast)."""
RETRY_INITIAL_S = 0.1
"""First wait after a failed DynamoDB call; doubles up to renew_every_s / 2."""
RELEASE_TIMEOUT_S = 2.0
LEASE_THREADS = 2
"""Threads of one lease's calls: one at a time, plus one while a call that missed its
deadline still finishes (bounded by the client's timeouts)."""

T = TypeVar("T")


def new_owner_id() -> str:
    """Unique per process: a restarted process never mistakes its predecessor's lease."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class OwnershipState(enum.Enum):
    NEW = "new"
    STANDBY = "standby"
    HOLDING = "holding"
    LOST = "lost"
    RELEASED = "released"


class Ownership:
    """Waits for, holds and gives up the partition's lease (see the module docstring).

    `acquire` (standby) -> `keep` (a task in the proxy's TaskGroup) -> `release`.
    """

    def __init__(
        self,
        store: LeaseStore,
        settings: OwnershipSettings,
        *,
        owner: str | None = None,
        endpoint: str = "",
        fence: Callable[[], str | None] | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall_clock_ms: Callable[[], int] = wall_ms,
    ) -> None:
        self.store = store
        self._fence = fence
        """Why this process must not deliver now, beyond the lease (the group fence, see
        the module docstring); None: no fence."""
        self.lost_reason = ""
        """Why the lease was given up while held ("" while it was not)."""
        self._fence_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fence")
        """The fence's own thread: a broker that does not answer holds it, never a
        renewal's (the lease threads below)."""
        self._fence_call: asyncio.Future[str | None] | None = None
        self.owner = owner or new_owner_id()
        self.endpoint = endpoint
        """host:port this process serves consumers at, written with every acquire and
        renewal; "" until known (an ephemeral port is known once bound: set it, renew)."""
        self.state = OwnershipState.NEW
        self.lost = asyncio.Event()
        """Set when the lease lapsed or was taken while held."""
        self.holder: Lease | None = None
        """The other holder a standby last saw (None: none seen)."""
        self._lease_s = settings.lease_s
        self._renew_every_s = settings.renew_every_s
        self.margin_s = settings.lease_s * MARGIN_FRACTION
        self._monotonic = monotonic
        self._wall_ms = wall_clock_ms
        self._valid_until = -math.inf
        self._sent = -math.inf
        self._pool = ThreadPoolExecutor(max_workers=LEASE_THREADS, thread_name_prefix="lease")
        """The lease's own threads. Why not the loop's default executor: a fleet process
        shares that among every pipeline's checkpoint, dead-letter and topology calls, and a
        renewal queued behind slow ones lapses the lease of a healthy partition (seen with
        three proxies in one loaded test process)."""

    async def _call(self, call: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, call, *args)

    async def _fenced(self) -> str | None:
        """The fence's answer (None: no fence, no reason, or no answer within half a
        renewal interval: asked again next time, a slow broker never costs the lease)."""
        if self._fence is None:
            return None
        if self._fence_call is None:
            loop = asyncio.get_running_loop()
            self._fence_call = loop.run_in_executor(self._fence_pool, self._fence)
        call = self._fence_call
        timeout = max(0.0, min(self._renew_every_s / 2, self.valid_for))
        if self.state is OwnershipState.STANDBY:
            timeout = self._renew_every_s / 2
        done, _ = await asyncio.wait({call}, timeout=timeout)
        if not done:
            return None
        self._fence_call = None
        return call.result()

    @property
    def valid_for(self) -> float:
        """Seconds the lease is still ours by the local (monotonic) reckoning; <= 0: lapsed."""
        return self._valid_until - self._monotonic()

    @property
    def holding(self) -> bool:
        """Whether this process may deliver and commit: held, not lost, not lapsed."""
        return self.state is OwnershipState.HOLDING and self.valid_for > 0

    def _times(self) -> tuple[float, int, int]:
        now = self._wall_ms()
        return self._monotonic(), now, now + round(self._lease_s * 1000)

    def _held_since(self, sent: float) -> None:
        self._sent = sent
        self._valid_until = sent + self._lease_s - self.margin_s

    async def _bounded(self, timeout: float, call: Callable[..., T], *args: Any) -> T | None:  # noqa: ASYNC109
        """`call(*args)` in a thread; None when it did not answer within `timeout` (the
        thread finishes on its own, bounded by the client's timeouts)."""
        task = asyncio.ensure_future(self._call(call, *args))
        done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout))
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
        return task.result()

    # --- standby ----------------------------------------------------------------------

    async def acquire(self, closing: asyncio.Event) -> bool:
        """Wait as a standby until the lease is ours (True) or `closing` is set (False)."""
        if self.state is not OwnershipState.NEW:
            raise StateError(f"ownership already {self.state.value}")
        self.state = OwnershipState.STANDBY
        failures = 0
        fenced = ""
        while not closing.is_set():
            if self._fence is not None:
                reason = await self._fenced() or ""
                if reason != fenced:
                    if reason:
                        logger.warning(
                            "standby: %s; waiting, asking again every %.1fs",
                            reason,
                            self._renew_every_s,
                        )
                    else:
                        logger.info("standby: the group fence is clear; taking the lease")
                    fenced = reason
                if reason:
                    await wait_any(closing, timeout=self._renew_every_s)
                    continue
            sent, now_ms, until_ms = self._times()
            try:
                lease = await self._call(
                    self.store.acquire, self.owner, now_ms, until_ms, self.endpoint
                )
            except TableUnavailable as exc:
                if not failures:
                    logger.warning("standby: the lease table did not answer (%s); retrying", exc)
                failures += 1
                await wait_any(closing, timeout=self._retry_s(failures))
                continue
            failures = 0
            if lease.owner == self.owner:
                self._held_since(sent)
                self.state = OwnershipState.HOLDING
                self.holder = None
                logger.info("lease acquired by %s for %.1fs", self.owner, self._lease_s)
                return True
            if self.holder is None or self.holder.owner != lease.owner:
                logger.info(
                    "standby: lease held by %s until %s; waiting",
                    lease.owner,
                    format_iso_ms(lease.until_ms),
                )
            self.holder = lease
            # Try again just after it lapses, and at least every STANDBY_POLL_S in case
            # it is released first.
            lapse_s = (lease.until_ms - now_ms) / 1000 + 0.01
            poll_s = min(STANDBY_POLL_S, self._lease_s / 4)
            await wait_any(closing, timeout=min(poll_s, max(0.01, lapse_s)))
        self.state = OwnershipState.RELEASED
        self._pool.shutdown(wait=False)
        self._fence_pool.shutdown(wait=False)
        return False

    def _retry_s(self, failures: int) -> float:
        return backoff(failures, initial=RETRY_INITIAL_S, cap=self._renew_every_s / 2)

    # --- holder -----------------------------------------------------------------------

    async def renew(self) -> None:
        """Renew once now; OwnershipLost if the lease is no longer ours.

        Call it after a slow start, before delivering: a renewal that succeeds proves no
        one acquired the lease since we did, even if it lapsed meanwhile.
        """
        sent, now_ms, until_ms = self._times()
        try:
            ok = await self._call(self.store.renew, self.owner, now_ms, until_ms, self.endpoint)
        except TableUnavailable as exc:
            if self.valid_for > 0:
                return  # still ours for a while; keep() retries
            raise OwnershipLost("the lease lapsed while the lease table did not answer") from exc
        if not ok:
            self.state = OwnershipState.LOST
            self.lost.set()
            raise OwnershipLost("the lease was taken over by another proxy")
        self._held_since(sent)

    async def keep(self, closing: asyncio.Event, on_lost: Callable[[], None]) -> None:
        """Renew every renew_every_s until `closing` is set. When the lease lapses (no
        renewal succeeded in time) or is taken, call `on_lost` at once and return."""
        if self.state is not OwnershipState.HOLDING:
            raise StateError(f"cannot keep a lease that is {self.state.value}")
        failures = 0
        next_at = self._sent + self._renew_every_s
        while True:
            now = self._monotonic()
            if now >= self._valid_until:
                return self._lose(on_lost, "no renewal succeeded in time")
            if await wait_any(closing, timeout=min(next_at, self._valid_until) - now):
                return None
            if self._monotonic() < next_at:
                continue  # woke at the local deadline: the top of the loop decides
            sent, now_ms, until_ms = self._times()
            try:
                ok = await self._bounded(
                    self._valid_until - sent,
                    self.store.renew,
                    self.owner,
                    now_ms,
                    until_ms,
                    self.endpoint,
                )
            except TableUnavailable as exc:
                failures += 1
                if failures == 1:
                    logger.warning(
                        "lease renewal failed (%s); retrying for %.1fs", exc, self.valid_for
                    )
                next_at = self._monotonic() + self._retry_s(failures)
                continue
            if ok is None:
                continue  # did not answer before the deadline: the top of the loop decides
            if not ok:
                return self._lose(on_lost, "another proxy took it over")
            if failures:
                logger.info("lease renewed again after %d failed attempts", failures)
            failures = 0
            self._held_since(sent)
            next_at = sent + self._renew_every_s
            reason = await self._fenced()
            if reason:
                return self._lose(on_lost, reason)

    def _lose(self, on_lost: Callable[[], None], why: str) -> None:
        self.lost_reason = why
        self.state = OwnershipState.LOST
        self.lost.set()
        logger.error("lease lost (%s): delivering stops now", why)
        on_lost()

    async def release(self) -> None:
        """Give the lease up so a standby takes over at once; best effort (it lapses
        anyway). Safe in any state, and twice."""
        if self.state not in (OwnershipState.HOLDING, OwnershipState.LOST):
            return
        self.state = OwnershipState.RELEASED
        self._valid_until = -math.inf
        try:
            done = await self._bounded(RELEASE_TIMEOUT_S, self.store.release, self.owner)
        except TableUnavailable as exc:
            logger.warning("lease not released (%s); it lapses in %.1fs", exc, self._lease_s)
            return
        finally:
            self._pool.shutdown(wait=False)  # what still runs finishes on its own
            self._fence_pool.shutdown(wait=False)
        logger.debug("lease %s", "released" if done else "was no longer ours to release")

    def lost_error(self) -> OwnershipLost:
        """What ends the pipeline. True in both modes: a pinned process then exits 3 and
        its supervisor restarts it as a standby; a fleet process goes on, and serves the
        partition again once assigned it and holding its lease."""
        why = f": {self.lost_reason}" if self.lost_reason else ""
        return OwnershipLost(
            f"lost the partition lease (owner {self.owner}){why}; it stops delivering the "
            "partition until it holds the lease again"
        )
