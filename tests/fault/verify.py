"""Verification of a fault-suite run: every produced offset against the handlers' logs
and the dead-letter table, and a cause for every redelivery (see fault_suite.py).
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from tests.fault.instance import plan_for
from tests.fault.processes import Incarnation
from tests.fault.report import EXPECTED_CAUSES, FAULT_CAUSES, Report
from tests.fault.scenario import Workload
from triage_cli.devstack import DevStack

PROXY_KILL_SLACK_S = 1.0
"""An invocation that started up to this long after a proxy kill may still have been
delivered by the dead proxy (it sat in the instance's local queue)."""
SETTLE_SLACK_S = 1.0
"""An instance that died this long after a handler completed may not have sent the ack."""


@dataclass
class Invocation:
    offset: int
    attempt: int
    index: int
    plan: str
    t: float
    incarnation: Incarnation
    done_t: float | None = None
    ack_may_be_lost: bool = True
    """Completed, its ack may have died with the instance (`mark_acks_sent`)."""


def read_invocations(history: list[Incarnation]) -> tuple[list[Invocation], int]:
    """Every handler invocation from every instance log; also how many lines were torn."""
    invocations: list[Invocation] = []
    torn = 0
    for inc in history:
        if not inc.log.exists():
            continue
        open_: dict[tuple[int, int, int], Invocation] = {}
        # Keyed with the index too: in the fleet scenario one instance serves several
        # partitions, whose offsets repeat.
        for line in inc.log.read_text().splitlines():
            parts = line.split()
            try:
                offset, attempt, index, what, t = (
                    int(parts[0]),
                    int(parts[1]),
                    int(parts[2]),
                    parts[3],
                    float(parts[4]),
                )
            except (IndexError, ValueError):
                torn += 1
                continue
            if what == "done":
                if (inv := open_.get((offset, attempt, index))) is not None:
                    inv.done_t = t
                continue
            inv = Invocation(offset, attempt, index, what, t, inc)
            invocations.append(inv)
            open_[(offset, attempt, index)] = inv
        if inc.fate == "crashed" and inc.ended is not None:
            # The crash happened when the crash pill's line was written, not when the
            # supervisor noticed the exit.
            crash_times = [i.t for i in open_.values() if i.plan == "crash"]
            if crash_times:
                inc.ended = max(crash_times)
    return invocations, torn


def mark_acks_sent(invocations: list[Invocation], credits: int) -> None:
    """Clear `ack_may_be_lost` on every completed invocation but each instance's latest
    `credits` completions.

    Why: the proxy hands an instance no more than `credits` deliveries it has not acked,
    so when the instance dies at most that many die with it unacked, and they are the
    ones it completed last (or not at all). A fast handler completes thousands in the
    second before its instance crashes; counting them all as that crash's collateral
    charged a proxy kill's redeliveries to the crash that came before it (21,284 of
    22,003 'crash collateral' redeliveries of a run without the encoding had a proxy kill
    between their two invocations)."""
    done: dict[int, list[Invocation]] = defaultdict(list)
    for inv in invocations:
        if inv.done_t is not None:
            done[id(inv.incarnation)].append(inv)
    for completed in done.values():
        completed.sort(key=lambda i: i.done_t or 0.0)
        for inv in completed[: max(0, len(completed) - credits)]:
            inv.ack_may_be_lost = False


def scan_dead_letters(stack: DevStack) -> list[Any]:
    import boto3

    from triage_proxy.store.items import dead_letter_from_item

    client = boto3.client(
        "dynamodb",
        endpoint_url=stack.aws.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    try:
        items: list[Any] = []
        for page in client.get_paginator("scan").paginate(TableName=stack.table):
            items.extend(page["Items"])
        # The proxy keeps its settled-above checkpoint in the same table at offset -1.
        return [dead_letter_from_item(i) for i in items if int(i["offset"]["N"]) >= 0]
    finally:
        client.close()


def redelivery_cause(
    prev: Invocation,
    cur: Invocation,
    proxy_kills: list[float],
    proxy_exits: list[float],
    kill: int | None,
) -> str:
    """Why `cur` followed `prev` for the same offset (see the module docstring); `kill` is
    the proxy kill that can explain it (`kill_redelivering`), if any."""
    if prev.plan == "retry":
        return "retry"
    if prev.plan == "crash":
        return "own crash"
    candidates: list[tuple[float, str]] = []
    if kill is not None:
        candidates.append((proxy_kills[kill], "proxy kill"))
    exit_ = first_kill_between(proxy_exits, prev.t, cur.t)
    if exit_ is not None:
        candidates.append((proxy_exits[exit_], "proxy exit"))
    inc = prev.incarnation
    died = inc.killed_at if inc.fate == "killed" else inc.ended
    unsettled = prev.done_t is None or (
        prev.ack_may_be_lost and (died or 0.0) - prev.done_t < SETTLE_SLACK_S
    )
    if died is not None and died <= cur.t and unsettled:
        if inc.fate == "killed":
            candidates.append((died, "consumer kill"))
        elif inc.fate == "crashed":
            candidates.append((died, "crash collateral"))
    if candidates:
        return min(candidates)[1]
    if prev.plan == "slow" and (prev.done_t is None or prev.done_t > cur.t):
        return "deadline"
    return "other"


def kill_redelivering(
    proxy_kills: list[float],
    since: float,
    until: float,
    restarts: list[tuple[float, float]] | None = None,
    charged: Collection[int] = (),
) -> int | None:
    """Index of the proxy kill that can explain a redelivery of an invocation made at
    `since` seen again at `until`, or None: the first kill after the proxy run that
    delivered `since` (an invocation up to PROXY_KILL_SLACK_S after a kill may still be
    the killed proxy's, out of the instance's queue), by whose replacement `until` can
    have been delivered, and that is not in `charged` (the kills this offset was already
    charged to). `restarts`, if known, has for each kill (when its replacement was
    started, when that one listened): before the first nothing was the replacement's,
    from the second on nothing was the killed proxy's.

    Why: a kill redelivers a record once, by the proxy that replaces it, and the bound
    the tests check is on records. With only the slack, what the replacement delivered
    within PROXY_KILL_SLACK_S of the kill counted as the killed proxy's: its redelivery by
    the next kill was charged to the kill before, again (a short run between two kills, as
    in test_restart_bound, could put up to twice the window on one kill and none on the
    next), and so was a redelivery of it within the replacement's run (an instance starved
    past its lease); and a redelivery the killed proxy made itself (a lapsed lease) that
    an instance invoked after the kill paid the kill once more when the replacement
    delivered the record again."""
    i = bisect.bisect_right(proxy_kills, since - PROXY_KILL_SLACK_S)
    if restarts is not None and i < len(proxy_kills) and since >= restarts[i][1]:
        i = bisect.bisect_right(proxy_kills, since)  # the replacement's own delivery
    while i < len(proxy_kills) and proxy_kills[i] <= until:
        if restarts is not None and restarts[i][0] > until:
            return None  # the killed proxy's own redelivery (and no later kill is due)
        if i not in charged:
            return i
        i += 1
    return None


def first_kill_between(proxy_kills: list[float], since: float, until: float) -> int | None:
    """Index of the first proxy kill (or exit: any sorted times) that can explain a
    redelivery of an invocation made at `since` seen again at `until`, or None."""
    i = bisect.bisect_right(proxy_kills, since - PROXY_KILL_SLACK_S)
    return i if i < len(proxy_kills) and proxy_kills[i] <= until else None


def offset_causes(
    invs: list[Invocation],
    proxy_kills: list[float],
    proxy_exits: list[float],
    restarts: list[tuple[float, float]] | None = None,
) -> tuple[list[str], list[int]]:
    """The cause of each redelivery of one offset (`invs`: its invocations in time order)
    and the proxy kills it is charged to, each at most once (kill_redelivering)."""
    causes: list[str] = []
    charged: list[int] = []
    for a, b in itertools.pairwise(invs):
        kill = kill_redelivering(proxy_kills, a.t, b.t, restarts, charged)
        cause = redelivery_cause(a, b, proxy_kills, proxy_exits, kill)
        causes.append(cause)
        if cause == "proxy kill" and kill is not None:
            charged.append(kill)
    return causes, charged


def expected_budget(behaviour: str, max_attempts: int) -> dict[str, int]:
    """Redeliveries a behaviour asks for itself, by cause. A crash pill: up to
    `max_attempts` + 1 deliveries in one proxy run (its first crash, before it is a
    suspect, blames no one: docs/concepts/suspects-and-blame.md), so `max_attempts`
    redeliveries; one more after a proxy restart or partition move is that event's."""
    return {
        "retry": 1 if behaviour == "retry" else 0,
        "own crash": max_attempts if behaviour == "crash" else 0,
        "deadline": 1 if behaviour == "slow" else 0,
    }


def verify(
    report: Report,
    workload: Workload,
    offsets: dict[int, int],
    history: list[Incarnation],
    dead: list[Any],
    proxy_kill_times: list[float],
    proxy_restarts: list[tuple[float, float]] | None = None,
) -> None:
    """Fill in the verification half of `report` (see the module docstring).
    `proxy_restarts`, when known: for each kill, when its replacement was started and when
    it listened (kill_redelivering)."""
    options = report.options
    exits = sorted(report.proxy_exits)
    index_at = {offset: index for index, offset in offsets.items()}
    behaviour_at = {offset: workload.behaviours[i] for offset, i in index_at.items()}
    report.produced = len(offsets)
    if len(index_at) != len(offsets):
        report.mismatched.append("two indexes were reported at the same offset")
    missing = len(workload.behaviours) - len(offsets)
    if missing and not report.unfinished:
        report.mismatched.append(f"{missing} messages have no delivery report")

    invocations, report.torn_lines = read_invocations(history)
    mark_acks_sent(invocations, options.credits)
    by_offset: dict[int, list[Invocation]] = defaultdict(list)
    for inv in invocations:
        by_offset[inv.offset].append(inv)
        if index_at.get(inv.offset) != inv.index:
            report.mismatched.append(
                f"offset {inv.offset} delivered index {inv.index}, "
                f"produced index {index_at.get(inv.offset)}"
            )
        elif inv.plan != plan_for(behaviour_at[inv.offset], inv.attempt):
            report.mismatched.append(f"offset {inv.offset} attempt {inv.attempt}: {inv.plan}")
    report.invocations = len(invocations)
    report.unique_offsets = len(by_offset)
    acked = {inv.offset for inv in invocations if inv.done_t is not None}
    report.acked = len(acked & set(index_at))

    dead_at = {dl.record.offset: dl for dl in dead}
    report.dead_lettered = len(dead_at)
    report.dead_by_behaviour = dict(
        Counter(behaviour_at.get(o, "unknown") for o in dead_at).most_common()
    )
    for offset, dl in sorted(dead_at.items()):
        index = index_at.get(offset)
        if (
            index is None
            or dl.record.value != workload.value(index)
            or dl.record.key != str(index).encode()
        ):
            report.not_exact.append(offset)

    # Lost: the proxy committed past it, yet no handler completed it and it is not in the
    # table. (When the run finished, the committed offset is the end: every offset.)
    unsettled = set(index_at) - acked - set(dead_at)
    report.lost = sorted(o for o in unsettled if o < report.committed)
    report.unfinished_offsets = len(unsettled) - len(report.lost)
    report.collateral = [
        f"offset {o} ({behaviour_at[o]}, completed by a handler "
        f"{sum(1 for i in by_offset[o] if i.done_t)} times): attempts {dl.attempts}, {dl.reason}"
        for o, dl in sorted(dead_at.items())
        if behaviour_at.get(o) not in ("nack", "crash")
    ]
    for offset in report.lost[:10]:
        seen = ", ".join(
            f"#{i.attempt} {i.plan}{' done' if i.done_t else ''} ({i.incarnation.fate})"
            for i in sorted(by_offset.get(offset, []), key=lambda i: i.t)
        )
        report.lost_detail.append(
            f"offset {offset} ({behaviour_at[offset]}): {seen or 'never delivered'}"
        )

    for offset, behaviour in sorted(behaviour_at.items()):
        if behaviour != "crash":
            continue
        report.crash_pills += 1
        dl = dead_at.get(offset)
        if dl is not None and dl.attempts == options.max_attempts:
            report.crash_pills_ok += 1
        else:
            got = "not dead-lettered" if dl is None else f"attempts {dl.attempts}"
            if dl is None and offset >= report.committed:
                got += " (still unsettled when the run stopped)"
            report.crash_detail.append(f"offset {offset}: {got}")

    for offset, invs in by_offset.items():
        invs.sort(key=lambda i: i.t)
        causes, charged = offset_causes(invs, proxy_kill_times, exits, proxy_restarts)
        report.per_kill.update(charged)
        report.causes.update(causes)
        for cause in FAULT_CAUSES:
            report.duplicates_by_cause[cause] += causes.count(cause)
        budget = expected_budget(behaviour_at.get(offset, "ok"), options.max_attempts)
        excess = sum(max(0, causes.count(c) - budget[c]) for c in EXPECTED_CAUSES)
        if excess:
            # e.g. a crash pill starting over at attempt 1 on a restarted proxy
            reset = first_kill_between(proxy_kill_times, invs[0].t, invs[-1].t)
            exit_ = first_kill_between(exits, invs[0].t, invs[-1].t)
            if exit_ is not None and (reset is None or exits[exit_] < proxy_kill_times[reset]):
                report.duplicates_by_cause["proxy exit"] += excess
            elif reset is not None:
                report.duplicates_by_cause["proxy kill"] += excess
                report.per_kill[reset] += excess
            else:
                report.duplicates_by_cause["other"] += excess
