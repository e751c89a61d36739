"""The Spark dead-letter job: parallel scan -> filters -> replay to Kafka, or export to Parquet.

Why Spark: one person replays a handful of dead letters with `triage dlq replay`; after
an outage there can be millions. DynamoDB's parallel scan splits a table into
`TotalSegments` disjoint segments that can be read at once, so the job makes one Spark
partition per segment (`parallelize(range(N), N)` + `mapPartitions`): reading,
producing and marking scale out with the cluster's cores, and each executor builds its
own boto3 client and Kafka producer (`segment.py`). DynamoDB keeps an item collection
(one partition key) in one segment, and the key is `<topic>#<partition>#dead#<group>`,
so the parallelism is also bounded by the number of source partitions (times
deployments) in the table. The job acts on one deployment's dead letters: the config's
`kafka.group_id`, or `--group`.

Replay protocol: claim -> produce -> mark. The promise is "marked `replayed` only after
the broker acknowledged the produce, and never replayed twice" (by a rerun, a retried
Spark task or a failed one). The two ways to order it:
- produce, then mark (one conditional write per item): a task that dies between the
  broker's ack and its mark leaves items `pending` that are already in Kafka, and the
  rerun (or Spark's retry of the task) silently produces them again.
- claim, produce, mark (two conditional writes per item; chosen, and the protocol of
  `triage_proxy.store.replay`, which both tools use). Each selected item is first claimed
  (pending and unclaimed -> `replay_claim = <run id>`, `replay_claim_until = now +
  lease`). Only claimed items are produced. After the delivery reports, a delivered item
  becomes `replayed` (condition: the claim is still ours) with `replay_id`,
  `replayed_at`, `replayed_to` (topic/partition/offset of the copy), `replay_count` and,
  with TTL on, `expires_at`; a claim whose message certainly never reached the broker
  is released (pending again, counted `failed`); any other outcome (a timeout, an error
  librdkafka does not name as "not sent", no report) keeps the claim (`in_doubt`). A
  rerun or a retried task never produces an item claimed by someone else, or by an
  earlier attempt of the same run; it counts it `in_doubt`.
The window that is left: a hard crash (worker SIGKILLed, executor lost) after a chunk
was claimed and before it was marked leaves that chunk (at most `chunk_size` items per
task) claimed, and the table cannot say whether those messages reached Kafka. This job
never replays them on its own (for them it is at-most-once, never a duplicate): every
run reports them as `in_doubt` until an operator checks the target topic for their
`triage-replay-of` headers and reruns with `retry_in_doubt` (which takes over claims
whose lease expired) for what is missing. (`triage dlq replay` runs the same routine
with `take_over_stale` on, so it replays such an item again once the lease is over.)
Exceptions are no window at all: the task marks what was delivered and releases what
was not before it gives up, so the rerun replays exactly the rest. Two writes per item
is the price.

Task failures: claims belong to the run, so two attempts of one task running at once
could both produce an item: the job refuses to replay with `spark.speculation` on. (A
zombie attempt on an executor Spark gave up for lost is the remaining, narrow case.)
A segment that raises reports the error in the Summary rather than
failing its Spark task. A failed task aborts the job (at once in local mode) and Spark
SIGKILLs the sibling tasks mid-chunk, which would turn one error into in-doubt chunks
everywhere. A worker that really dies still fails the job: `run_replay` raises
`ReplayFailed`, naming the cause Spark reported (`spark_cause`), and a rerun is safe.

Export writes the selected items to Parquet (columns in `segment.EXPORT_COLUMNS`) and
changes nothing in the table.

Entry points: `run_replay(options, spark=None) -> Summary` (tests, `triage dlq replay
--spark`), and `python -m triage_replay.job (--config FILE [--group G] | --table T
--group G --endpoint-url URL --bootstrap B) [filters] [--to-topic T | --export PATH]
[--master M]`, which also runs
under plain `spark-submit replay/triage_replay/job.py ...` (then the master is
spark-submit's). The options travel to the executors as `options.ReplayOptions`.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from triage_proxy.config.loader import load_settings
from triage_proxy.config.sections import DEFAULT_REGION, DeadLetterSettings
from triage_proxy.errors import ConfigError, NotFoundError, TriageError, UnavailableError
from triage_proxy.exitcodes import ExitCode, exit_code_for
from triage_proxy.store.aws import read_secret
from triage_proxy.store.items import STATUSES
from triage_proxy.store.query import DeadLetterTable, Filters, parse_time
from triage_proxy.store.replay import new_replay_id
from triage_replay.options import DEFAULT_CHUNK, MAX_SEGMENTS, Fault, ReplayOptions
from triage_replay.segment import (
    EXPORT_COLUMNS,
    Counts,
    SegmentCounts,
    SegmentJob,
    export_partition,
    producer_config,
    replay_partition,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

__all__ = ["Fault", "ReplayFailed", "ReplayOptions", "Summary", "run_replay"]

logger = logging.getLogger(__name__)

APP_NAME = "triage-replay"
DEFAULT_MASTER = "local[*]"
"""Where the job runs when neither --master nor spark-submit says."""
SEGMENTS_PER_CORE = 2
"""Default scan segments per Spark core: small segments even out uneven ones."""


class ReplayFailed(UnavailableError):
    """The Spark job failed as a whole (e.g. a worker died); items it claimed stay
    claimed, a rerun is safe."""

    retriable = True


class ExportExists(ConfigError):
    """The export path exists: a finished export, or one a failed run left half-written.
    Spark refuses to write into it unless told to replace it."""

    def __init__(self, path: str) -> None:
        problem = (
            f"{path} exists (an earlier export, maybe left half-written by a failed run): "
            "rerun with --overwrite to replace it, or export to another path"
        )
        TriageError.__init__(self, problem)  # a flag's value, not a config key: no prefix
        self.key = "export"
        self.problem = problem
        self.path = path


@dataclass(kw_only=True)
class Summary(Counts):
    """What one run did: its counts (`Counts`, summed over its segments) and more."""

    mode: str
    """"replay" or "export"."""
    replay_id: str
    """The run's id (the `triage-replay-id` header and the claim owner)."""
    segments: int
    """Scan segments (= Spark partitions)."""
    exported: int = 0
    """Rows written to Parquet."""
    errors: tuple[str, ...] = ()
    """One line per segment that stopped early."""
    elapsed_s: float = 0.0
    """Wall time of run_replay (Spark's start included when it made the session)."""

    @property
    def ok(self) -> bool:
        """Nothing failed, nothing is in doubt, every segment ran to the end."""
        return not self.errors and self.failed == 0 and self.in_doubt == 0

    def __str__(self) -> str:
        counts = (
            f"exported={self.exported}"
            if self.mode == "export"
            else f"replayed={self.replayed} skipped={self.skipped} failed={self.failed} "
            f"in_doubt={self.in_doubt}"
        )
        lines = [
            f"{self.mode} {self.replay_id}: read={self.read} selected={self.selected} "
            f"{counts} segments={self.segments} in {self.elapsed_s:.1f}s"
        ]
        lines.extend(f"  error: {error}" for error in self.errors)
        return "\n".join(lines)


def local_session(
    master: str = DEFAULT_MASTER, conf: Mapping[str, str] | None = None
) -> SparkSession:
    """A SparkSession on `master` (local or a cluster) whose Python workers run this
    interpreter (the venv) unless the caller chose one (`python_for_workers`)."""
    from pyspark.sql import SparkSession

    python_for_workers(default=sys.executable)
    builder = (
        SparkSession.builder.master(master)
        .appName(APP_NAME)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "true")  # progress on stderr (off by default)
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def python_for_workers(default: str | None = None) -> None:
    """Make $PYSPARK_PYTHON (the interpreter every executor starts for its Python
    workers) one an executor can start, before a SparkContext reads it.

    Unset, PySpark would start whatever `python3` is on the executor's PATH, which lacks
    boto3, confluent-kafka and triage: `default` (when given) is used instead. A relative
    path would be looked up from each executor's own work directory, where it does not
    exist: it is made absolute from this process's directory, where the user meant it.
    PYSPARK_DRIVER_PYTHON follows, so a driver started from here runs the same one.
    """
    chosen = os.environ.get("PYSPARK_PYTHON") or default
    if not chosen:
        return
    if os.sep in chosen and not os.path.isabs(chosen):
        absolute = os.path.abspath(chosen)
        logger.info("PYSPARK_PYTHON %s is relative; executors start %s", chosen, absolute)
        chosen = absolute
    os.environ["PYSPARK_PYTHON"] = chosen
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", chosen)


def stop_session(session: SparkSession, timeout_s: float = 30.0) -> None:
    """Stop `session` and, when this process launched the JVM, the JVM too.

    `SparkSession.stop()` leaves the driver JVM running until the Python process exits;
    a test run or a CLI call that starts Spark more than once would pile them up. The
    JVM exits when its stdin closes; it is waited for (killed after `timeout_s`) so
    nothing is left behind, and the next session launches a fresh one. Under
    spark-submit the JVM is our parent and is left alone.
    """
    import subprocess

    from pyspark import SparkContext

    session.stop()
    gateway = SparkContext._gateway
    proc: subprocess.Popen[bytes] | None = getattr(gateway, "proc", None)
    if gateway is None or proc is None:
        return
    gateway.shutdown()
    SparkContext._gateway = None
    SparkContext._jvm = None
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("the Spark JVM (pid %d) did not exit in %.0fs; killed", proc.pid, timeout_s)
        proc.kill()
        proc.wait()


def run_replay(options: ReplayOptions, *, spark: SparkSession | None = None) -> Summary:
    """Replay (or export) the selected dead letters; return the summary.

    Uses `spark` if given (left running), else creates a session (stopped at the end).
    Checks the table from the driver first: TableNotFound or DeadLetterUnavailable
    before any Spark work. Raises ReplayFailed when the Spark job itself fails; a
    segment that stops early does not raise but shows in `Summary.errors`.
    """
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    started = time.monotonic()
    with DeadLetterTable(options.dead_letters, group=options.group) as table:
        table.check()
    check_target(options)
    session, owned = (spark, False) if spark is not None else _session(options.master)
    try:
        sc = session.sparkContext
        if options.mode == "replay" and sc.getConf().get("spark.speculation", "false") == "true":
            raise ConfigError(
                "spark.speculation",
                "must be off to replay: two attempts of one task would share the run's claims",
            )
        total = options.segments or min(MAX_SEGMENTS, SEGMENTS_PER_CORE * sc.defaultParallelism)
        job = SegmentJob(options, total, new_replay_id())
        what = (
            f"{options.mode} {job.replay_id} of {options.dead_letters.table} "
            f"(group {options.group!r})"
        )
        logger.info("%s started: %d segments, %s", what, total, options.filters)
        try:
            if options.export_path is not None:
                summary = _export(session, job, options.export_path, options.overwrite)
            else:
                summary = _replay(session, job)
        except (Py4JError, PySparkException) as exc:
            if _condition(exc) == "PATH_ALREADY_EXISTS" and options.export_path is not None:
                raise ExportExists(options.export_path) from exc
            if options.export_path is not None:
                after = (
                    f"{options.export_path} may hold part of it: rerun with --overwrite "
                    "to replace it"
                )
            else:
                after = "its claimed items stay claimed and a rerun is safe"
            raise ReplayFailed(
                f"the Spark job of {options.mode} {job.replay_id} failed: {spark_cause(exc)} "
                f"({after}; Spark's log has the details)"
            ) from exc
    finally:
        if owned:
            stop_session(session)
    summary = replace(summary, elapsed_s=time.monotonic() - started)
    logger.info("%s", summary)
    return summary


def check_target(options: ReplayOptions) -> None:
    """From the driver, before any Spark work: the broker answers and the topic a replay
    writes to exists (`to_topic`, else the filter's source topic when it names one), as
    `triage dlq replay` checks without --spark. A producer writing to a missing topic
    creates it wherever the broker creates topics on demand (Kafka's default, Tansu), so
    a mistyped --to-topic made a topic and marked the dead letters replayed into it.
    Raises NotFoundError (exit 4) or BrokerUnavailable (exit 3)."""
    target = options.to_topic or options.filters.topic
    if options.mode != "replay" or target is None:
        return
    from confluent_kafka import Producer

    from triage_proxy.kafka.errors import kafka_errors

    producer = Producer(producer_config(options))
    with kafka_errors(f"cannot reach Kafka at {options.bootstrap}"):
        topics = producer.list_topics(timeout=10).topics  # all of them: creates none
    if target not in topics:
        raise NotFoundError(f"topic {target} does not exist on {options.bootstrap}")


def _session(master: str | None) -> tuple[SparkSession, bool]:
    """The session to run on, and whether run_replay made it (and so stops it): the
    process's active one (a notebook's, a caller's) if there is one, else a new one."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    if master is None and "PYSPARK_GATEWAY_PORT" in os.environ:  # under spark-submit
        # spark-submit's python (or the user's PYSPARK_PYTHON) stays the executors' choice:
        # on a cluster this interpreter's path may not exist on other hosts.
        python_for_workers()
        return SparkSession.builder.appName(APP_NAME).getOrCreate(), True
    return local_session(master or DEFAULT_MASTER), True


def _replay(session: SparkSession, job: SegmentJob) -> Summary:
    sc = session.sparkContext
    sc.setJobDescription(f"triage replay {job.replay_id}")
    segments = sc.parallelize(range(job.total_segments), job.total_segments)
    results: list[SegmentCounts] = segments.mapPartitions(
        functools.partial(replay_partition, job)
    ).collect()
    total = Counts()
    for result in results:
        total.add(result)
    errors = tuple(r.error for r in sorted(results, key=lambda r: r.segment) if r.error)
    return Summary(
        mode="replay",
        replay_id=job.replay_id,
        segments=job.total_segments,
        errors=errors,
        **total.totals(),
    )


def export_schema() -> StructType:
    """Spark schema of the Parquet export (EXPORT_COLUMNS, in order)."""
    from pyspark.sql.types import (
        ArrayType,
        BinaryType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
        TimestampType,
    )

    header = StructType(
        [StructField("key", StringType(), False), StructField("value", BinaryType(), True)]
    )
    types = {
        "topic": (StringType(), False),
        "partition": (IntegerType(), False),
        "offset": (LongType(), False),
        "key": (BinaryType(), True),
        "value": (BinaryType(), True),
        "headers": (ArrayType(header, False), False),
        "timestamp": (TimestampType(), False),
        "reason": (StringType(), False),
        "attempts": (IntegerType(), False),
        "consumer_id": (StringType(), False),
        "dead_lettered_at": (TimestampType(), False),
        "status": (StringType(), False),
        "replay_id": (StringType(), True),
        "replayed_at": (StringType(), True),
        "replayed_to": (StringType(), True),
        "replay_count": (IntegerType(), True),
        "payload_s3": (StringType(), True),
    }
    return StructType([StructField(name, *types[name]) for name in EXPORT_COLUMNS])


def _export(session: SparkSession, job: SegmentJob, path: str, overwrite: bool) -> Summary:
    sc = session.sparkContext
    sc.setJobDescription(f"triage export {job.replay_id}")
    read = sc.accumulator(0)
    selected = sc.accumulator(0)
    segments = sc.parallelize(range(job.total_segments), job.total_segments)
    rows = segments.mapPartitions(functools.partial(export_partition, job, read, selected))
    frame = session.createDataFrame(rows, export_schema(), verifySchema=False)
    frame.write.mode("overwrite" if overwrite else "errorifexists").parquet(path)
    # Accumulators may count a retried task twice; the Parquet files never hold it twice.
    return Summary(
        mode="export",
        replay_id=job.replay_id,
        segments=job.total_segments,
        read=read.value,
        selected=selected.value,
        exported=selected.value,
    )


TRACEBACK = "Traceback (most recent call last):"


def spark_cause(exc: BaseException) -> str:
    """The one line of a failed Spark job's exception that says why it failed.

    py4j's own first line only names the JVM method that was called ("An error occurred
    while calling o61.collectAndServe."), so the Java exception's first line is taken
    (e.g. "Job aborted due to stage failure: ... (executor 1): java.io.IOException:
    Cannot run program ..."). Where that, or a PythonException, goes on with a Python
    traceback, the traceback's exception line is the cause and replaces it.
    """
    java = getattr(exc, "java_exception", None)
    text = str(java.toString()) if java is not None else str(exc)
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    marked = [n for n, line in enumerate(lines) if line.endswith(TRACEBACK)]
    if not marked:
        return lines[0]
    start = marked[-1]  # the last traceback: the exception that was finally raised
    raised = next((line for line in lines[start + 1 :] if not line[0].isspace()), None)
    prefix = lines[start][: -len(TRACEBACK)].strip()
    if raised is None:
        return lines[0]
    return f"{prefix} {raised}" if prefix else raised


def _condition(exc: BaseException) -> str | None:
    """Spark's error condition (e.g. PATH_ALREADY_EXISTS) of a PySpark exception."""
    from pyspark.errors import PySparkException

    if not isinstance(exc, PySparkException):
        return None
    get = getattr(exc, "getCondition", None) or exc.getErrorClass  # the former from Spark 4
    condition: str | None = get()
    return condition


# --- command line -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m triage_replay.job",
        description="Replay dead letters from DynamoDB to Kafka, or export them to Parquet.",
    )
    where = parser.add_argument_group("table and broker: a proxy's config file, or flags")
    where.add_argument("--config", "-c", help="the proxy's TOML config (kafka.*, dead_letters.*)")
    where.add_argument("--table", help="DynamoDB dead-letter table")
    where.add_argument("--endpoint-url", help="DynamoDB/S3 endpoint (local moto server)")
    where.add_argument("--region", default=DEFAULT_REGION)
    where.add_argument("--bootstrap", help="Kafka bootstrap servers (replay)")
    where.add_argument(
        "--group",
        help="the deployment: the proxies' kafka.group_id (required with --table; "
        "overrides the config's)",
    )
    where.add_argument("--ttl-days", type=float, help="replayed items expire after this")
    pick = parser.add_argument_group("filters")
    pick.add_argument("--topic", help="source topic")
    pick.add_argument("--partition", type=int, help="source partition")
    pick.add_argument("--status", choices=STATUSES)
    pick.add_argument("--reason", help="substring of the reason (case-insensitive)")
    pick.add_argument("--offset", type=int, help="source offset")
    pick.add_argument("--since", help="dead-lettered at or after (ISO-8601, or an age: 30m, 2d)")
    pick.add_argument("--until", help="dead-lettered before (ISO-8601, or an age: 30m, 2d)")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--to-topic", help="replay to this topic instead of the source topic")
    out.add_argument("--export", metavar="PATH", help="write Parquet here instead of replaying")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="export: replace PATH (an earlier export, or one a failed run left half-written)",
    )
    parser.add_argument("--master", help="Spark master (default: spark-submit's, else local[*])")
    parser.add_argument("--segments", type=int, help="scan segments (default: 2 per core)")
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK)
    parser.add_argument(
        "--retry-in-doubt",
        action="store_true",
        help="also replay items an earlier run claimed and never finished (may duplicate)",
    )
    parser.add_argument(
        "-X",
        dest="kafka_config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra librdkafka producer property (repeatable)",
    )
    return parser


_PASSED_AS_IS = ("to_topic", "overwrite", "master", "segments", "chunk_size", "retry_in_doubt")
"""Command-line arguments that are ReplayOptions fields of the same name."""


def options_from_args(args: argparse.Namespace) -> ReplayOptions:
    """ReplayOptions from parsed arguments; ValueError/ConfigError name the bad one."""
    extra: dict[str, str] = {}
    for pair in args.kafka_config:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"-X takes KEY=VALUE, got {pair!r}")
        extra[key] = value
    now_ms = int(time.time() * 1000)
    filters = Filters(
        **{name: getattr(args, name) for name in ("topic", "partition", "offset", "status")},
        reason=args.reason,
        since_ms=parse_time(args.since, now_ms) if args.since else None,
        until_ms=parse_time(args.until, now_ms) if args.until else None,
    )
    fields = {name: getattr(args, name) for name in _PASSED_AS_IS}
    fields.update(filters=filters, export_path=args.export)
    if args.config is not None:
        if args.table or args.endpoint_url or args.ttl_days is not None:
            raise ValueError("--config names the table: drop --table/--endpoint-url/--ttl-days")
        if args.bootstrap:
            fields["bootstrap"] = args.bootstrap
        if args.group:
            fields["group"] = args.group
        options = ReplayOptions.from_settings(
            load_settings(args.config, fetch_secret=read_secret), **fields
        )
        return replace(options, kafka_config={**options.kafka_config, **extra})
    if not args.table:
        raise ValueError("give --config FILE or --table")
    if not args.group:
        raise ValueError("--table needs --group (the deployment's kafka.group_id)")
    table = DeadLetterSettings(
        table=args.table,
        region=args.region,
        endpoint_url=args.endpoint_url,
        ttl_days=args.ttl_days,
    )
    return ReplayOptions(
        table, group=args.group, bootstrap=args.bootstrap, kafka_config=extra, **fields
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job from the command line; returns an exit code (`ExitCode`, as `triage`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    for name in ("triage_replay", __name__):  # __name__ is "__main__" under -m
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        options = options_from_args(args)
    except (ValueError, ConfigError) as exc:  # a malformed argument, as argparse's own: 2
        parser.print_usage(sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        summary = run_replay(options)
    except KeyboardInterrupt as exc:
        print("interrupted: claimed items stay claimed; a rerun is safe", file=sys.stderr)
        return exit_code_for(exc)
    except TriageError as exc:  # e.g. TableNotFound, ReplayFailed, DeadLetterUnavailable
        print(f"error: {exc}", file=sys.stderr)
        return exit_code_for(exc)  # the mapping every `triage` command uses
    print(summary)
    return ExitCode.OK if summary.ok else ExitCode.FAILURE


if __name__ == "__main__":
    sys.exit(main())
