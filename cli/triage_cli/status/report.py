"""The model of `triage status` (pure): what each source said (`BrokerView`, `ProxyView`,
`LocalDeployment`) and the `Report` with a row per partition, per process and per push
target, joined from them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triage_proxy.exitcodes import ExitCode

if TYPE_CHECKING:
    from triage_proxy.config.settings import Settings


@dataclass(frozen=True)
class BrokerView:
    """What the broker says about the group's partitions (None: could not be read)."""

    committed: Mapping[int, int | None] = field(default_factory=dict)
    """Committed offset per partition (None: the group committed nothing there)."""
    low: Mapping[int, int] = field(default_factory=dict)
    """Low watermark per partition (where an uncommitted group would start)."""
    high: Mapping[int, int] = field(default_factory=dict)
    """High watermark per partition."""
    error: str | None = None
    """Why the broker could not be read."""


@dataclass(frozen=True)
class ProxyView:
    """One proxy's /status answer, or why there was none."""

    url: str | None
    """Where it was asked (None: `server.http_enabled` is false)."""
    doc: Mapping[str, Any] | None = None
    """The /status document."""
    error: str | None = None
    """Why it did not answer."""
    foreign: str | None = None
    """Set when a process answered but belongs to another deployment (another topic,
    group or table): what it serves. Its answer is not this deployment's and is dropped."""


@dataclass(frozen=True)
class LocalDeployment:
    """What the supervisor's state.json records of this config's local deployment."""

    fleet: bool
    """N fleet processes share the partitions (else one pinned process per partition)."""
    slots: int
    """Process slots the supervisor keeps running: each should answer at its port."""
    topic_partitions: int | None
    """The topic's partition count when it was deployed."""
    supervisor_pid: int
    """The supervisor's pid (it runs the processes, restarting those that die)."""


def local_deployment(state: Mapping[str, Any] | None, config: Path) -> LocalDeployment | None:
    """The deployment `state` (state.json) records, if it is `config`'s (pure); None when
    there is no record, or it is another config's (a shared or wrong state folder)."""
    if not state or not isinstance(state.get("config"), str):
        return None
    if Path(state["config"]) != config:
        return None
    fleet = state.get("mode") == "fleet"
    entries = state.get("proxies" if fleet else "partitions")
    pid = state.get("supervisor_pid")
    if not isinstance(entries, list) or not entries or not isinstance(pid, int):
        return None
    partitions = state.get("topic_partitions")
    return LocalDeployment(
        fleet=fleet,
        slots=len(entries),
        topic_partitions=partitions if isinstance(partitions, int) else None,
        supervisor_pid=pid,
    )


def process_slots(deployment: LocalDeployment | None, partitions: int) -> int:
    """How many process slots to ask (pure): a recorded fleet's slots (a slot past them is
    no process: asking it showed a phantom down process); otherwise one per partition,
    the most either layout runs."""
    if deployment is not None and deployment.fleet:
        return deployment.slots
    return partitions


def is_fleet(views: Sequence[ProxyView], deployment: LocalDeployment | None) -> bool:
    """Whether the processes are a fleet (pure): the record says so, or one answers so."""
    if deployment is not None:
        return deployment.fleet
    return any(v.doc is not None and v.doc.get("mode") == "fleet" for v in views)


def unrecorded_slots(views: Sequence[ProxyView]) -> list[ProxyView]:
    """A fleet's views without a record of its size (pure): the slots above the last one
    that answers are dropped, since nothing says a process should run there; a slot below
    it that does not answer is a gap in the fleet, so a process that is down. (With a
    record, `process_slots` asks exactly the recorded slots and keeps every one.)"""
    answered = [k for k, v in enumerate(views) if v.doc is not None or v.foreign]
    return list(views[: answered[-1] + 1]) if answered else list(views)


@dataclass(frozen=True)
class Report:
    """Everything `triage status` prints, for every partition."""

    topic: str
    group_id: str
    partitions: Sequence[dict[str, Any]]
    broker_error: str | None = None
    dead_letters_error: str | None = None
    generated_at: str = ""
    legacy_partitions: Sequence[int] = ()
    """Partitions still holding dead letters written before deployment keys (invisible
    to every command until `triage dlq migrate` moves them)."""
    config: str = "<config>"
    """The config file, as the migrate hint names it."""
    push: Sequence[dict[str, Any]] = ()
    """One row per push target per process (`push_rows`)."""
    dead_letters_missing: bool = False
    """The dead-letter table does not exist (exit 4: nothing was deployed, or the name is
    wrong)."""
    foreign: Sequence[str] = ()
    """Processes that answered at this config's ports for another deployment."""
    table: str = ""
    """This config's dead-letter table."""
    processes: Sequence[dict[str, Any]] = ()
    """One row per proxy process asked (`process_rows`)."""
    supervisor_pid: int | None = None
    """The live supervisor of this config's local deployment (None: none runs)."""

    @property
    def proxies_down(self) -> list[int]:
        return [row["partition"] for row in self.partitions if row["proxy"] == "down"]

    @property
    def processes_down(self) -> list[str]:
        """The URLs of the process slots asked that did not answer as this deployment's:
        with a record, every one is a process that should run (a killed fleet process is
        down even while the others serve its partitions)."""
        return [row["url"] for row in self.processes if row["state"] == "down"]

    @property
    def answering(self) -> list[dict[str, Any]]:
        """The processes of this deployment that answered /status."""
        return [row for row in self.processes if row["state"] != "down"]

    @property
    def exit_code(self) -> ExitCode:
        """What `triage status` exits with (pure, see the package doc): a source that could
        not be read first (the broker, then the dead-letter table: the report is partial),
        then a table that does not exist, then a proxy or process that is down."""
        if self.broker_error:
            return ExitCode.UNAVAILABLE
        if self.dead_letters_missing:
            return ExitCode.NOT_FOUND
        if self.dead_letters_error:
            return ExitCode.UNAVAILABLE
        if self.proxies_down or self.processes_down:
            return ExitCode.FAILURE
        return ExitCode.OK

    @property
    def deployed(self) -> bool:
        """Some process of this deployment answered, or its supervisor is alive (or none
        could be asked: HTTP off). Not whether partitions are served: during a broker
        outage a fleet's processes answer yet serve nothing, and are still deployed."""
        return (
            not self.partitions
            or any(row["proxy"] != "down" for row in self.partitions)
            or bool(self.answering)
            or self.supervisor_pid is not None
        )

    def to_json(self) -> dict[str, Any]:
        def total(key: str) -> int | None:
            values = [row[key] for row in self.partitions]
            return None if any(v is None for v in values) else sum(values)

        return {
            "topic": self.topic,
            "group_id": self.group_id,
            "generated_at": self.generated_at,
            "broker_error": self.broker_error,
            "dead_letters_error": self.dead_letters_error,
            "legacy_dead_letters": list(self.legacy_partitions),
            "deployed": self.deployed,
            "supervisor_pid": self.supervisor_pid,
            "dead_letters_missing": self.dead_letters_missing,
            "other_deployments": list(self.foreign),
            "totals": {
                "lag": total("lag"),
                "in_flight": total("in_flight"),
                "dead_letters_pending": total("dead_letters_pending"),
                "proxies_down": len(self.proxies_down),
                "processes_down": len(self.processes_down),
            },
            "partitions": list(self.partitions),
            "push": list(self.push),
            "processes": list(self.processes),
        }


def partition_row(
    partition: int, broker: BrokerView, proxy: ProxyView, dead_letters_pending: int | None
) -> dict[str, Any]:
    """One partition's row from the three sources (pure)."""
    doc = proxy.doc or {}
    committed = broker.committed.get(partition)
    high = broker.high.get(partition)
    proxy_end = doc.get("log_end_offset")
    log_end = max((v for v in (high, proxy_end) if v is not None), default=None)
    lag: int | None = None
    if log_end is not None:
        if committed is not None:
            lag = max(0, log_end - committed)
        elif partition in broker.low:
            lag = max(0, log_end - broker.low[partition])
    if proxy.url is None and proxy.error is None:
        state = "unobserved"
    elif proxy.doc is None:
        state = "down"
    else:
        state = str(doc.get("state", "unknown"))
    return {
        "partition": partition,
        "committed_offset": committed,
        "log_end_offset": log_end,
        "lag": lag,
        "proxy": state,
        "proxy_url": proxy.url,
        "proxy_error": proxy.error,
        "endpoint": doc.get("advertised_endpoint") or None,
        "in_flight": doc.get("in_flight"),
        "in_window": doc.get("in_window"),
        "connected_instances": doc.get("connected_instances"),
        "instances": [i["consumer_id"] for i in doc.get("instances", [])],
        "oldest_unsettled_age_s": doc.get("oldest_unsettled_age_s"),
        "dead_letters_pending": dead_letters_pending,
        "dead_letters_writing": doc.get("dead_letters_pending"),
        "degraded": list(doc.get("degraded", [])),
        "dead_letters_unwritable": doc.get("dead_letters_unwritable"),
        "unwritable_dead_letters": list(doc.get("unwritable_dead_letters", [])),
        "served_by": doc.get("served_by"),
        "blocking": doc.get("blocking"),
        "queued": doc.get("queued"),
        "fetch_paused": doc.get("fetch_paused"),
        "instances_detail": [dict(i) for i in doc.get("instances", [])],
        "counters": dict(doc.get("counters") or {}),
    }


def process_rows(views: Sequence[ProxyView]) -> list[dict[str, Any]]:
    """Each proxy process asked, as the fleet view shows it (pure): its pid, owner id,
    mode, endpoint, the partitions it was assigned and serves, or why it did not answer."""
    rows: list[dict[str, Any]] = []
    for view in views:
        if view.url is None:
            continue
        doc = view.doc
        if doc is None:
            rows.append({"url": view.url, "state": "down", "error": view.error})
            continue
        parts = doc.get("partitions")
        pipelines = (
            [
                {"partition": p.get("partition"), "state": p.get("state"), "ready": p.get("ready")}
                for p in parts
                if isinstance(p, dict)
            ]
            if isinstance(parts, list)
            else []
        )
        rows.append(
            {
                "url": view.url,
                "state": doc.get("state"),
                "error": None,
                "pid": doc.get("pid"),
                "owner": doc.get("owner"),
                "mode": doc.get("mode"),
                "member": doc.get("member"),
                "ready": doc.get("ready"),
                "endpoint": doc.get("advertised_endpoint") or None,
                "assigned": list(doc.get("assigned") or []),
                "served": list(doc.get("served") or []),
                "pipelines": pipelines,
            }
        )
    return rows


def push_rows(views: Sequence[ProxyView]) -> list[dict[str, Any]]:
    """Each process's push targets, as its /status lists them, with the process that
    delivers (pure). A process delivers a target's records of its own partitions, so one
    target shows once per process that serves some."""
    rows: list[dict[str, Any]] = []
    for view in views:
        doc = view.doc or {}
        for target in doc.get("push") or []:
            if isinstance(target, dict):
                rows.append({**target, "pid": doc.get("pid"), "proxy_url": view.url})
    return sorted(rows, key=lambda r: (str(r.get("name")), list(r.get("partitions") or [])))


def mine_only(view: ProxyView, settings: Settings) -> ProxyView:
    """`view` as this deployment sees it (pure): a process that answers for another topic,
    group or dead-letter table is not one of ours, so it counts as down, with the reason.
    An older proxy that does not say its group or table is judged by what it says."""
    doc = view.doc
    if doc is None:
        return view
    mine = {
        "topic": settings.kafka.topic,
        "group": settings.kafka.group_id,
        "table": settings.dead_letters.table,
    }
    theirs = {
        "topic": doc.get("topic"),
        "group": doc.get("group_id"),
        "table": doc.get("dead_letter_table"),
    }
    if all(not theirs[k] or theirs[k] == mine[k] for k in mine):
        return view
    what = ", ".join(f"{k} {theirs[k]!r}" for k in mine if theirs[k])
    pid = f"pid {doc['pid']} " if doc.get("pid") else ""
    return ProxyView(
        url=view.url,
        error=f"the process there ({pid}{what}) belongs to another deployment",
        foreign=f"{view.url}: {pid}{what}",
    )


def missing_table_hint(error: str, config: str) -> str:
    """What to do when the dead-letter table does not exist (pure)."""
    return (
        f"{error}: nothing was deployed with this config, or dead_letters.table names "
        f"another table. `triage deploy --config {config}` creates it; otherwise set "
        f"dead_letters.table (and dead_letters.region / endpoint_url) to the table the "
        f"proxies write"
    )


def partition_views(
    views: Sequence[ProxyView], partitions: int, *, fleet: bool = False
) -> list[ProxyView]:
    """Each partition's view, from the process that runs it (pure). A process document
    lists its partitions (`partitions`); an older one-partition proxy's document is its
    partition's. A partition no process lists is down: pinned, with its own slot's view
    (down, or a process serving other partitions: then with that reason); in a `fleet`
    slots are not partitions, so with no url, only the reason."""
    found: dict[int, ProxyView] = {}
    for view in views:
        doc = view.doc
        if doc is None or not isinstance(doc.get("partitions"), list):
            continue
        process = {
            "pid": doc.get("pid"),
            "owner": doc.get("owner"),
            "endpoint": doc.get("advertised_endpoint") or None,
            "url": view.url,
        }
        for part in doc["partitions"]:
            p = int(part.get("partition", -1))
            if p in found and not part.get("ready"):
                continue  # a standby or a draining one: the serving process wins
            found[p] = ProxyView(url=view.url, doc={**part, "served_by": process})
    out: list[ProxyView] = []
    for p in range(partitions):
        if p in found:
            out.append(found[p])
            continue
        if fleet and any(v.url is not None for v in views):  # HTTP off: unobserved
            out.append(ProxyView(url=None, error=f"no proxy process serves partition {p}"))
            continue
        own = views[p] if p < len(views) else ProxyView(url=None)
        if own.doc is not None and isinstance(own.doc.get("partitions"), list):
            own = ProxyView(url=own.url, error=f"no proxy process serves partition {p}")
        out.append(own)
    return out
