"""The DynamoDB table (and its S3 overflow bucket): every item kind, store and tool on it.

One table per deployment holds three kinds of item, told apart by their key. Kafka topic
names cannot contain `#`, so the three `source` formats never collide, and every tool
that lists dead letters skips the negative offsets:

    kind          source (partition key)                   offset (sort key)   owner
    ------------  ---------------------------------------  ------------------  --------------
    dead letter   <topic>#<partition>                      the message's (>=0) deadletters.py
    checkpoint    <topic>#<partition>#checkpoint#<group>   -1                  checkpoints.py
    lease         <topic>#<partition>#lease                -2                  leases.py

    overflow bucket object  <table>/<topic>/<partition>/<offset>   (payload.py) holds
    the key, value and headers of a dead letter too large for one item; its item keeps
    `payload_s3` = s3://<bucket>/<that key> instead.

Modules, by role:

    items.py         key formats of all three kinds, attribute names, the dead-letter codec
    payload.py       the S3 payload object's byte format
    aws.py           boto3 clients, and `aws_errors`: the one place botocore errors are caught
    provisioning.py  create the table (key schema, TTL, point-in-time recovery) and bucket
    deadletters.py   the dead-letter store the proxy's writer uses (+ in-memory twin)
    checkpoints.py   the commit checkpoint store (+ in-memory twin)
    leases.py        the partition lease store (+ in-memory twin)
    query.py         the tools' view: filters, scans, reads, claims, marks, discards
    replay.py        the one replay routine (claim -> produce -> confirm -> mark)

The proxy writes (deadletters, checkpoints, leases); the tools (`triage dlq`, `triage
status`, the Spark job) read and change status (query, replay).
"""
