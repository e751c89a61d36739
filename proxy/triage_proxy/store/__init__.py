"""The DynamoDB table (and its S3 overflow bucket): every item kind, store and tool on it.

The table holds three kinds of item, told apart by their key, and every item belongs to
one deployment: the Kafka group id its proxies commit with (`kafka.group_id`). Several
apps reading one topic (billing and shipping on `orders`) may share one table; none
touches another's items. The group comes last in the key, after fields that cannot hold
a `#` (Kafka topic names cannot; the partition is digits; the kind is a fixed word), so
a group id may hold anything, `#` included; every tool that lists dead letters skips the
negative offsets:

    kind          source (partition key)                   offset (sort key)   owner
    ------------  ---------------------------------------  ------------------  --------------
    dead letter   <topic>#<partition>#dead#<group>         the message's (>=0) deadletters.py
    checkpoint    <topic>#<partition>#checkpoint#<group>   -1                  checkpoints.py
    lease         <topic>#<partition>#lease#<group>        -2                  leases.py
    index marker  triage#index#by-state                    -3                  provisioning.py

    overflow bucket object  <table>/<topic>/<partition>/<offset>/<group>   (payload.py)
    holds the key, value and headers of a dead letter too large for one item; its item
    keeps `payload_s3` = s3://<bucket>/<that key> instead.

Legacy keys, from before deployments were keyed: dead letters `<topic>#<partition>`
(no `group` attribute; moved to a deployment by `triage dlq migrate`, migrate.py) and
leases `<topic>#<partition>#lease` (honoured while live by leases.py). The checkpoint
key has not changed.

Modules, by role:

    items.py         key formats of all three kinds, attribute names, the dead-letter codec
    payload.py       the S3 payload object's byte format
    aws.py           boto3 clients, and `aws_errors`: the one place botocore errors are caught
    provisioning.py  create the table (key schema, `by-state` index, TTL, point-in-time
                     recovery) and bucket
    deadletters.py   the dead-letter store the proxy's writer uses (+ in-memory twin)
    checkpoints.py   the commit checkpoint store (+ in-memory twin)
    leases.py        the partition lease store (+ in-memory twin)
    query.py         the tools' view of one deployment: filters, scans, reads, claims, marks,
                     discards
    pages.py         bounded paged reads with an opaque cursor, and counts by reason
    replay.py        the one replay routine (claim -> produce -> confirm -> mark)
    bulk.py          count, replay or discard every pending item a filter selects, with
                     progress (`triage dlq replay/discard`, the console)
    migrate.py       moves legacy dead letters to a deployment and indexes old tables
                     (`triage dlq migrate`)

The proxy writes (deadletters, checkpoints, leases); the tools (`triage dlq`, `triage
status`, the Spark job) read and change status (query, replay, migrate).
"""
