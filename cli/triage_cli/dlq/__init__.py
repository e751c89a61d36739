"""`triage dlq`: find out why messages died, then put them back or let them go.

Why a CLI next to the Spark job: most incidents are a handful of dead letters that a
person wants to read, fix the cause of, and replay, using the same config file the
proxy runs from (the one `triage dev` writes works as is). The selection, rendering
and replay protocol live in the `triage_proxy.store` package (`query.py`, `replay.py`;
`pages.py` and `bulk.py` for paged reads and bulk actions; the console uses them too),
shared with the Spark job, so the two never disagree about which items a filter selects
or whether an item was replayed; how a dead letter's bytes are shown to people is
`triage_cli/render.py` (the console's too), which this package's `render.py` uses.

    triage dlq list    --config F [filters] [--json] [--limit N] [--cursor C]
    triage dlq show    --config F TOPIC PARTITION OFFSET [--json]
    triage dlq replay  --config F (filters | --offset N | --all) [--to-topic T] [--dry-run]
    triage dlq discard --config F (filters | --offset N | --all) [--dry-run]
    triage dlq migrate --config F [--dry-run] [--json]

Every command acts on one deployment's dead letters: those of the config's
`kafka.group_id`, or of `--group G` (another app reading the same topic into the same
table has its own, which these commands never touch). `migrate` moves the dead letters
written before deployment keys (no group) of the config's topic to that deployment
(`triage_proxy.store.migrate`).

Filters: --topic, --partition, --status (list only; replay and discard act on
pending items), --reason SUBSTRING (case-insensitive), --since/--until (ISO-8601 or an
age like 30m, 1h, 2d; on dead_lettered_at, since inclusive, until exclusive).

Exit codes (`exitcodes.ExitCode`): 0 ok; 1 some items failed to replay or are in doubt
(maybe delivered, still claimed); 2 bad config or bad arguments (malformed time range,
a cursor this listing did not hand out ...); 3 DynamoDB, S3 or Kafka unreachable; 4 the
table or the item does not exist; 130 interrupted (SIGINT or SIGTERM: a replay finishes
and marks the chunk in flight, then stops).

Heavy modules (boto3, confluent-kafka, rich) are imported inside the functions.

The package, by role: `command.py` the typer app, its options and the five commands;
`selection.py` which dead letters a command acts on (the config's table, the filters
from the options, the pending items replay and discard act on); `render.py` what the
commands print (the table, one dead letter, the summaries, --json lines); `broker.py`
what they ask Kafka (the replay producer, the topic's partition count).
"""
