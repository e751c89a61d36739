"""The AWS clients of one process share one botocore Session (store/aws.py).

Why: each Session keeps its own copy of botocore's service models, about 10 MB per
client; a fleet process made two clients per partition, and 16 idle partitions cost
3.1x the memory of one (bench_fleet_memory). Made from one Session, clients share the
loaded models; each is still separate (its own timeouts) and its caller's to close.
"""

from __future__ import annotations

from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.store.aws import aws_client, dynamodb_client, s3_client

LOCAL = DeadLetterSettings(table="t", endpoint_url="http://127.0.0.1:1")


def test_clients_share_one_loader_but_keep_their_own_options() -> None:
    fast = dynamodb_client(LOCAL, connect_timeout_s=1.0, read_timeout_s=1.0, max_attempts=1)
    slow = dynamodb_client(LOCAL)
    s3 = s3_client(LOCAL)
    sns = aws_client("sns", LOCAL)
    try:
        assert fast is not slow
        assert fast._loader is slow._loader is s3._loader is sns._loader  # type: ignore[attr-defined]
        # botocore sets each option as an attribute of the Config; its stubs declare none
        assert vars(fast.meta.config)["read_timeout"] == 1.0
        assert vars(slow.meta.config)["read_timeout"] != 1.0
    finally:
        for client in (fast, slow, s3, sns):
            client.close()


def test_closing_one_client_leaves_the_others_working() -> None:
    first = dynamodb_client(LOCAL)
    first.close()
    second = dynamodb_client(LOCAL)
    try:
        assert second.meta.service_model.service_name == "dynamodb"
    finally:
        second.close()
