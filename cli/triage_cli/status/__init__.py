"""`triage status`: is every partition keeping up? One row per partition.

    triage status --config F [--watch [--interval S]] [--json] [--host H] [--target aws]

Each row joins three sources, so one that is down costs only its own columns:

- the broker (a confluent-kafka client): the group's committed offset and the log end
  (high watermark); lag = log end - committed (log end - low watermark when nothing is
  committed yet). The partition count is `kafka.partitions`, else the topic's metadata.
- each proxy process's `/status` (`server.http_host`, or `--host`, at `server.http_port + k`
  for each process slot k; `process_slots` says which). A local deployment's record
  (`.triage/state.json` next to the config, written by its supervisor) names its slots:
  a fleet's N processes, or one per partition; each recorded slot is a process that
  should run, so one that does not answer is down. Without a record (processes started
  by hand, or on another host) slots 0..partitions-1 are asked, and in a fleet a slot
  above the last one answering is no process of it. A process lists the partitions it
  runs (`partitions`); a partition's row comes from the process that serves it
  (`served_by`: its pid, owner id and endpoint), so a fleet shows which process serves
  which partition. A partition no process lists is down. With
  `--target aws` the processes are the deployment's running ECS tasks (`aws.fleet_hosts`),
  each asked at `server.http_port` on its private IP. Per row:
  state, the endpoint it advertises to consumers (`server.advertised_*`, what the lease
  item and Topology carry), in-flight, connected instances, oldest unsettled age, dead
  letters still being
  written, and what is degraded: a dead letter that can never be written is named with
  its offset (where the commit waits) and the fix. A proxy that does not answer is shown
  as down. Its log end also raises the
  broker's (Tansu's high watermark can trail what was fetched, see DESIGN.md).
- the dead-letter table: this deployment's (`kafka.group_id`) items of the partition
  with `status = pending`; another app's dead letters on the same topic are not counted.

Push targets (`[[push]]`) get a second table, only when a process lists any: one row per
target per process (a process delivers the records of its own partitions), from its
/status `push` list: limit, in flight, p50/p99 latency, responses by class, errors, and
state ("ok", or why delivery waits, e.g. an outage). `--json` has them under `push`.

Only this config's processes count: a process that answers at one of its ports for
another topic, group or dead-letter table (`/status` names them) is another deployment's,
and its partition is down; when no process of this deployment answers and no supervisor
of it is alive, the report says plainly that nothing is deployed for it (and which
deployment answers instead). Processes that answer but serve no partition (during a
broker outage a fleet's processes lose their group session and drain everything) are
said to be so, with the broker's error, not taken for an absent deployment.

Exit codes (`exitcodes.ExitCode`): 0 every proxy answered; 1 some proxy (or recorded
process) is down, or nothing is deployed (the report is still printed); 2 bad config or
flags; 3 the broker could not be read (what could be read is printed: without
`kafka.partitions` the partitions are then the proxies that answer, 0, 1, ... up to the
first that does not; when none answers, no report), or the dead-letter table could not be
read (the report is printed, its pending counts unknown); 4 the dead-letter table does not
exist (the report is printed, then what to do: deploy, or fix `dead_letters.table`);
`--watch` runs until Ctrl-C or SIGTERM and exits 0 (both end it the same way:
`exit_on_errors` turns SIGTERM into KeyboardInterrupt).

Heavy modules (confluent-kafka, boto3, rich) are imported inside the functions.

The package, by role: `report.py` the model (the views of each source and the `Report`
rows, pure), `sources.py` what reads the broker, the proxies and the table, and `gather`,
which joins them, `render.py` the report in tables and words, `command.py` the typer
command and `--watch`.
"""
