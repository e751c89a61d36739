"""`deploy_aws` / `destroy_aws` end to end against moto server, through AWS_ENDPOINT_URL.

moto's CloudFormation creates every ELBv2 load balancer as an application load balancer
(it ignores `Type: network`), which refuses TLS listeners; so these tests deploy with
`aws.tls_listeners = false`, which leaves out only the per-partition Listener resources.
Everything else in the template (cluster, task definitions, services, target groups,
NLB, security groups, roles, log group) is created by moto's CloudFormation.
"""

from __future__ import annotations

import ast
import asyncio
import io
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import grpc
import pytest
import tomli_w
from botocore.exceptions import ClientError
from rich.console import Console

from tests.integration.harness import RawConsumer, create_topic, produce
from triage_cli.aws import deploy_aws, destroy_aws, stack_name
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, wait_for_port
from triage_proxy.errors import ConfigError, DeployError
from triage_proxy.settings import load_settings, settings_from_dict

pytestmark = pytest.mark.integration

TOKENS = {"billing": "billing-token-0123456789abcdef", "audit": "audit-token-0123456789abcdef"}
REVOKED = "old-token-0123456789abcdef"
PASSWORD = "kafka-password-do-not-print"
REGION = "us-east-1"
ENTRYPOINT = Path(__file__).resolve().parents[2] / "infra" / "entrypoint.sh"


@pytest.fixture
def aws_env(aws: EmbeddedAWS, monkeypatch: pytest.MonkeyPatch) -> EmbeddedAWS:
    """Point the standard boto3 chain at moto server, as an operator would at AWS."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", aws.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("TEST_KAFKA_PASSWORD", PASSWORD)
    return aws


def client(service: str) -> Any:
    return boto3.client(service, region_name=REGION)  # type: ignore[call-overload]


@pytest.fixture
def config(aws_env: EmbeddedAWS, tmp_path: Path, unique_name: str) -> Iterator[Path]:
    """A two-partition config with named tokens (one revoked), a SASL password by env
    reference, an overflow bucket and TTL; no endpoint_url (AWS_ENDPOINT_URL decides)."""
    certificate = client("acm").request_certificate(DomainName="triage.example.com")
    path = tmp_path / "triage.toml"
    name = unique_name.lower()
    path.write_text(
        f"""
[kafka]
bootstrap_servers = "b-1.kafka.example.com:9096"
topic = "orders.{name}"
group_id = "billing"
partitions = 2
security_protocol = "SASL_SSL"
sasl_mechanism = "SCRAM-SHA-512"
sasl_username = "triage"
sasl_password = "env:TEST_KAFKA_PASSWORD"

[auth]
tokens = {{ billing = "{TOKENS["billing"]}", audit = "{TOKENS["audit"]}", old = "{REVOKED}" }}
revoked = ["old"]

[dead_letters]
table = "dlq-{name}"
region = "{REGION}"
overflow_bucket = "overflow-{name}"
ttl_days = 7

[aws]
image = "123456789012.dkr.ecr.{REGION}.amazonaws.com/triage:1"
certificate_arn = "{certificate["CertificateArn"]}"
tls_listeners = false
"""
    )
    yield path
    # leave moto clean even when a test failed half-way
    destroy_aws(path, delete_data=True, console=Console(file=io.StringIO()))


def recorded() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=200), out


def stack_status(stack: str) -> str | None:
    try:
        status = client("cloudformation").describe_stacks(StackName=stack)["Stacks"][0]
    except ClientError as exc:
        if "does not exist" not in str(exc):
            raise
        return None
    return None if status["StackStatus"] == "DELETE_COMPLETE" else str(status["StackStatus"])


def secret_names(stack: str) -> set[str]:
    found = client("secretsmanager").list_secrets()["SecretList"]
    return {s["Name"] for s in found if s["Name"].startswith(f"{stack}/")}


def test_deploy_creates_data_secrets_and_stack_then_destroy_keeps_data(
    config: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="triage_cli")
    caplog.set_level(logging.DEBUG, logger="triage_proxy")
    settings = load_settings(config)
    stack = stack_name(settings)
    table = settings.dead_letters.table
    bucket = settings.dead_letters.overflow_bucket
    console, out = recorded()

    outputs = deploy_aws(config, image=None, console=console)

    # the stack and its outputs
    assert stack.startswith(f"triage-orders-{settings.kafka.topic.split('.', 1)[1]}-billing")
    assert stack_status(stack) == "CREATE_COMPLETE"
    dns = outputs["LoadBalancerDns"]
    assert outputs["ConsumerEndpoint"] == f"{dns}:7700"
    assert outputs["Partition1Endpoint"] == f"{dns}:7701"
    assert outputs["ConsumerEndpoint"] in out.getvalue().replace("\n", "")
    services = client("ecs").list_services(cluster=outputs["ClusterName"])["serviceArns"]
    assert sorted(s.rsplit("/", 1)[1] for s in services) == ["partition-0", "partition-1"]

    # the table: PITR and TTL on
    ddb = client("dynamodb")
    backups = ddb.describe_continuous_backups(TableName=table)["ContinuousBackupsDescription"]
    assert backups["PointInTimeRecoveryDescription"]["PointInTimeRecoveryStatus"] == "ENABLED"
    ttl = ddb.describe_time_to_live(TableName=table)["TimeToLiveDescription"]
    assert (ttl["TimeToLiveStatus"], ttl["AttributeName"]) == ("ENABLED", "expires_at")

    # the bucket: encrypted, no public access
    s3 = client("s3")
    encryption = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]
    assert encryption["Rules"][0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    block = s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]
    assert all(block.values())
    assert len(block) == 4

    # the secrets: active tokens and the Kafka password, not the revoked token
    assert secret_names(stack) == {
        f"{stack}/token/audit",
        f"{stack}/token/billing",
        f"{stack}/kafka-sasl-password",
    }
    sm = client("secretsmanager")
    assert (
        sm.get_secret_value(SecretId=f"{stack}/token/billing")["SecretString"] == TOKENS["billing"]
    )
    assert sm.get_secret_value(SecretId=f"{stack}/kafka-sasl-password")["SecretString"] == PASSWORD

    # the containers' config: references only, and they resolve to the real values
    params = {
        p["ParameterKey"]: p["ParameterValue"]
        for p in client("cloudformation").describe_stacks(StackName=stack)["Stacks"][0][
            "Parameters"
        ]
    }
    container = params["TriageConfig"]
    for secret in [*TOKENS.values(), REVOKED, PASSWORD]:
        assert secret not in container
        assert secret not in out.getvalue()
        assert secret not in caplog.text
    loaded = settings_from_dict(tomllib.loads(container), env={})
    assert loaded.auth.active() == TOKENS
    assert loaded.server.host == "0.0.0.0"
    assert loaded.dead_letters.endpoint_url is None
    assert loaded.kafka.partitions == 2
    assert loaded.kafka.librdkafka_config()["sasl.password"] == PASSWORD

    # least privilege: the task role names exactly our table, bucket and secrets
    iam = client("iam")
    role = client("cloudformation").describe_stack_resource(
        StackName=stack, LogicalResourceId="TaskRole"
    )["StackResourceDetail"]["PhysicalResourceId"]
    policy = iam.get_role_policy(RoleName=role, PolicyName="triage-proxy")["PolicyDocument"]
    # moto keeps the document as a Python repr, with AWS::NoValue as None
    document = policy if isinstance(policy, dict) else ast.literal_eval(policy)
    granted = {}
    for statement in filter(None, document["Statement"]):
        resources = statement["Resource"]
        for resource in [resources] if isinstance(resources, str) else resources:
            granted.setdefault(resource, set()).update(
                [statement["Action"]]
                if isinstance(statement["Action"], str)
                else statement["Action"]
            )
    arns = {sm.describe_secret(SecretId=name)["ARN"] for name in secret_names(stack)}
    assert set(granted) == {
        f"arn:aws:dynamodb:{REGION}:123456789012:table/{table}",
        f"arn:aws:s3:::{bucket}/*",
        *arns,
    }
    assert all(granted[arn] == {"secretsmanager:GetSecretValue"} for arn in arns)

    # a second deploy is an update (or nothing to do), not an error
    again = deploy_aws(config, image=None, console=recorded()[0])
    assert again == outputs
    assert stack_status(stack) in ("CREATE_COMPLETE", "UPDATE_COMPLETE")

    # destroy keeps the data
    destroy_aws(config, delete_data=False, console=recorded()[0])
    assert stack_status(stack) is None
    assert ddb.describe_table(TableName=table)["Table"]["TableStatus"] == "ACTIVE"
    s3.head_bucket(Bucket=bucket)
    assert len(secret_names(stack)) == 3

    # a redeploy finds everything in place; destroy --delete-data removes it all
    deploy_aws(config, image="example/triage:2", console=recorded()[0])
    assert stack_status(stack) == "CREATE_COMPLETE"
    s3.put_object(Bucket=bucket, Key="payloads/x", Body=b"large payload")
    destroy_aws(config, delete_data=True, console=recorded()[0])
    assert stack_status(stack) is None
    with pytest.raises(ClientError, match="ResourceNotFound"):
        ddb.describe_table(TableName=table)
    with pytest.raises(ClientError, match=r"404|NoSuchBucket|Not Found"):
        s3.head_bucket(Bucket=bucket)
    assert secret_names(stack) == set()


def test_deploy_without_certificate_names_the_key(config: Path) -> None:
    text = config.read_text()
    config.write_text(
        "\n".join(line for line in text.splitlines() if not line.startswith("certificate_arn"))
    )
    with pytest.raises(ConfigError) as caught:
        deploy_aws(config, image=None, console=recorded()[0])
    assert caught.value.key == "aws.certificate_arn"
    assert stack_status(stack_name(load_settings(config))) is None


# --- through the CLI ------------------------------------------------------------------


def triage(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """The installed `triage` command in a child process (it inherits AWS_ENDPOINT_URL)."""
    return subprocess.run(
        [str(Path(sys.executable).parent / "triage"), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_cli_deploy_then_destroy_asks_keeps_data_and_deletes_it_on_request(config: Path) -> None:
    settings = load_settings(config)
    stack = stack_name(settings)
    table = settings.dead_letters.table

    deployed = triage("deploy", "--target", "aws", "--config", str(config))
    assert deployed.returncode == 0, deployed.stderr
    endpoint = client("cloudformation").describe_stacks(StackName=stack)["Stacks"][0]["Outputs"]
    consumer = next(o["OutputValue"] for o in endpoint if o["OutputKey"] == "ConsumerEndpoint")
    assert consumer in deployed.stdout
    for secret in [*TOKENS.values(), REVOKED, PASSWORD]:
        assert secret not in deployed.stdout + deployed.stderr

    refused = triage("destroy", "--target", "aws", "--config", str(config), stdin="n\n")
    assert refused.returncode != 0
    assert stack_status(stack) == "CREATE_COMPLETE"

    kept = triage("destroy", "--target", "aws", "--config", str(config), "--yes")
    assert kept.returncode == 0, kept.stderr
    assert stack_status(stack) is None
    assert client("dynamodb").describe_table(TableName=table)["Table"]["TableStatus"] == "ACTIVE"

    gone = triage("destroy", "--target", "aws", "--config", str(config), "--yes", "--delete-data")
    assert gone.returncode == 0, gone.stderr
    with pytest.raises(ClientError, match="ResourceNotFound"):
        client("dynamodb").describe_table(TableName=table)
    assert secret_names(stack) == set()


def test_cli_deploy_without_image_is_a_config_error(config: Path) -> None:
    text = config.read_text()
    config.write_text("\n".join(line for line in text.splitlines() if not line.startswith("image")))
    result = triage("deploy", "--target", "aws", "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert "aws.image" in result.stderr
    assert stack_status(stack_name(load_settings(config))) is None


# --- the container's side -------------------------------------------------------------


def test_container_entrypoint_runs_a_proxy_from_the_deployed_config(
    config: Path, broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """What a Fargate task does, minus Docker: infra/entrypoint.sh with the TriageConfig and
    TRIAGE_PARTITION the stack passes. The tokens are resolved from Secrets Manager (moto)
    at start. Only the network changes: the local broker instead of the SASL one, and
    loopback instead of 0.0.0.0."""
    settings = load_settings(config)
    deploy_aws(config, image=None, console=recorded()[0])
    params = client("cloudformation").describe_stacks(StackName=stack_name(settings))["Stacks"][0][
        "Parameters"
    ]
    container = tomllib.loads(
        next(p["ParameterValue"] for p in params if p["ParameterKey"] == "TriageConfig")
    )
    topic = container["kafka"]["topic"]
    create_topic(broker.bootstrap, topic)
    produce(broker.bootstrap, topic, [(b"k", b"hello", None)])
    kafka = container["kafka"]
    for key in ("security_protocol", "sasl_mechanism", "sasl_username", "sasl_password"):
        kafka.pop(key)
    kafka["bootstrap_servers"] = broker.bootstrap
    port, http_port = free_port(), free_port()
    assert "advertised_host" not in container["server"]  # the stack sets the NLB's name
    container["server"].update(host="127.0.0.1", port=port, http_port=http_port)
    env = {
        **os.environ,
        "TRIAGE_CONFIG": tomli_w.dumps(container),
        "TRIAGE_PARTITION": "0",
        "TRIAGE_ADVERTISED_HOST": "triage-nlb.example.com",
        "TMPDIR": str(tmp_path / "task"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    (tmp_path / "task").mkdir()
    proc = subprocess.Popen(["sh", str(ENTRYPOINT)], env=env, stderr=subprocess.PIPE)
    try:
        wait_for_port("127.0.0.1", port, 60, proc)  # type: ignore[arg-type]
        (written,) = (tmp_path / "task").glob("*/triage.toml")
        assert stat.S_IMODE(written.stat().st_mode) == 0o600
        assert stat.S_IMODE(written.parent.stat().st_mode) == 0o700

        async def scenario() -> None:
            async with RawConsumer(f"127.0.0.1:{port}", token=TOKENS["billing"]) as good:
                delivered = await good.receive(1, timeout=30)
                assert delivered[0].value == b"hello"
                good.settle(acks=[delivered[0].offset])
            async with RawConsumer(f"127.0.0.1:{port}", token=REVOKED) as revoked:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await revoked.read()
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        asyncio.run(scenario())
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as r:
            status = json.loads(r.read())
        assert status["advertised_endpoint"] == f"triage-nlb.example.com:{port}"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr.decode(errors="replace")[-2000:]
        for secret in TOKENS.values():
            assert secret.encode() not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_aws_refusal_raises_deploy_error_and_a_fixed_rerun_succeeds(config: Path) -> None:
    """A Kafka password referencing a secret that does not exist: Secrets Manager refuses,
    deploy stops before the stack with DeployError naming the step; fixed, it goes on."""
    stack = stack_name(load_settings(config))
    good = config.read_text()
    config.write_text(good.replace('"env:TEST_KAFKA_PASSWORD"', '"secret:no-such-secret"'))
    with pytest.raises(DeployError, match="reading secret no-such-secret failed"):
        deploy_aws(config, image=None, console=recorded()[0])
    assert stack_status(stack) is None
    config.write_text(good)
    outputs = deploy_aws(config, image=None, console=recorded()[0])
    assert stack_status(stack) == "CREATE_COMPLETE"
    assert outputs["ConsumerEndpoint"].endswith(":7700")


def test_deploy_asks_the_broker_for_the_partition_count_when_the_config_has_none(
    config: Path, broker: EmbeddedBroker
) -> None:
    settings = load_settings(config)
    create_topic(broker.bootstrap, settings.kafka.topic, partitions=3)
    text = config.read_text().replace("partitions = 2\n", "")
    text = text.replace('"b-1.kafka.example.com:9096"', f'"{broker.bootstrap}"')
    for key in ("security_protocol", "sasl_mechanism", "sasl_username", "sasl_password"):
        text = "\n".join(line for line in text.splitlines() if not line.startswith(key))
    config.write_text(text)
    outputs = deploy_aws(config, image=None, console=recorded()[0])
    assert {k for k in outputs if k.startswith("Partition")} == {
        "Partition0Endpoint",
        "Partition1Endpoint",
        "Partition2Endpoint",
    }
