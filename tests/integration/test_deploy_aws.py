"""`deploy_aws` / `destroy_aws` end to end against moto server, through AWS_ENDPOINT_URL.

moto's CloudFormation creates every ELBv2 load balancer as an application load balancer
(it ignores `Type: network`), which refuses TCP listeners; so these tests deploy with
`aws.listener = false`, which leaves out only the Listener resource. Everything else in
the template (cluster, task definition, the fleet service, target group, NLB, security
groups, roles, log group) is created by moto's CloudFormation.
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
import threading
import tomllib
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

import boto3
import grpc
import pytest
import tomli_w
import trustme
from botocore.exceptions import ClientError
from rich.console import Console

from tests.integration.harness import RawConsumer, create_topic, produce
from triage_cli.aws import deploy_aws, destroy_aws, fleet_hosts, stack_name
from triage_cli.awsstack import SERVICE_NAME
from triage_cli.embedded import EmbeddedAWS, EmbeddedBroker, free_port, wait_for_port
from triage_client import Consumer, Message
from triage_protocol import triage_pb2 as pb
from triage_protocol import triage_pb2_grpc as pb_grpc
from triage_proxy.config.ecs import METADATA_ENV
from triage_proxy.config.loader import load_settings, settings_from_dict
from triage_proxy.errors import ConfigError, DeployError
from triage_proxy.store.aws import read_secret

# On one worker (--dist loadgroup): that worker's moto server alone loads its CloudFormation
# backend (which imports most of moto: 2 s of CPU), not every worker's.
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("aws-stack")]

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


def client(
    service: Literal["cloudformation", "dynamodb", "ecs", "iam", "s3", "secretsmanager"],
) -> Any:
    return boto3.client(service, region_name=REGION)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Any]:
    """A throwaway CA, a server certificate for the names the tests dial (127.0.0.1, and
    localhost, what the stand-in task metadata advertises) and a client certificate."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    files = {name: tmp_path / f"{name}.pem" for name in ("cert", "key", "ca")}
    files["cert"].write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(files["key"]))
    ca.cert_pem.write_to_path(str(files["ca"]))
    return {"ca": ca, "files": files, "client": ca.issue_cert("orders-consumer")}


@pytest.fixture
def config(
    aws_env: EmbeddedAWS, tmp_path: Path, unique_name: str, pki: dict[str, Any]
) -> Iterator[Path]:
    """A two-partition config with named tokens (one revoked), a SASL password by env
    reference, an overflow bucket and TTL, TLS with client certificates (mTLS); no
    endpoint_url (AWS_ENDPOINT_URL decides)."""
    files = pki["files"]
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

[tls]
cert_file = "{files["cert"]}"
key_file = "{files["key"]}"
client_ca_file = "{files["ca"]}"

[aws]
image = "123456789012.dkr.ecr.{REGION}.amazonaws.com/triage:1"
listener = false
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

    # the stack and its outputs: one fleet service of min(partitions, 2) tasks
    assert stack.startswith(f"triage-orders-{settings.kafka.topic.split('.', 1)[1]}-billing")
    assert stack_status(stack) == "CREATE_COMPLETE"
    dns = outputs["LoadBalancerDns"]
    assert outputs["BootstrapEndpoint"] == outputs["ConsumerEndpoint"] == f"{dns}:7700"
    assert not any(key.startswith("Partition") for key in outputs)
    assert outputs["BootstrapEndpoint"] in out.getvalue().replace("\n", "")
    ecs = client("ecs")
    services = ecs.list_services(cluster=outputs["ClusterName"])["serviceArns"]
    assert [s.rsplit("/", 1)[1] for s in services] == [SERVICE_NAME] == [outputs["ServiceName"]]
    (service,) = ecs.describe_services(cluster=outputs["ClusterName"], services=services)[
        "services"
    ]
    assert service["desiredCount"] == 2
    definition = ecs.describe_task_definition(taskDefinition=service["taskDefinition"])
    container = definition["taskDefinition"]["containerDefinitions"][0]
    assert [e["name"] for e in container["environment"]] == ["TRIAGE_CONFIG"]
    tls_secrets = {e["name"]: e["valueFrom"] for e in container["secrets"]}
    assert set(tls_secrets) == {"TRIAGE_TLS_CERT", "TRIAGE_TLS_KEY", "TRIAGE_TLS_CLIENT_CA"}

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

    # the secrets: active tokens, the Kafka password and the TLS files, not the revoked token
    assert secret_names(stack) == {
        f"{stack}/token/audit",
        f"{stack}/token/billing",
        f"{stack}/kafka-sasl-password",
        f"{stack}/tls/cert",
        f"{stack}/tls/key",
        f"{stack}/tls/client-ca",
    }
    sm = client("secretsmanager")
    assert (
        sm.get_secret_value(SecretId=f"{stack}/token/billing")["SecretString"] == TOKENS["billing"]
    )
    assert sm.get_secret_value(SecretId=f"{stack}/kafka-sasl-password")["SecretString"] == PASSWORD
    # the task definition's secrets are those entries, holding the [tls] files
    files = {"TRIAGE_TLS_CERT": "cert", "TRIAGE_TLS_KEY": "key", "TRIAGE_TLS_CLIENT_CA": "ca"}
    for variable, arn in tls_secrets.items():
        held = sm.get_secret_value(SecretId=arn)["SecretString"]
        assert held == (config.parent / f"{files[variable]}.pem").read_text()
    key_pem = (config.parent / "key.pem").read_text()
    assert key_pem not in out.getvalue()
    assert key_pem not in caplog.text

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
    loaded = settings_from_dict(tomllib.loads(container), env={}, fetch_secret=read_secret)
    assert loaded.auth.active() == TOKENS
    assert loaded.server.host == "0.0.0.0"
    assert loaded.server.http_host == "0.0.0.0"  # `triage status --target aws`, VPC only
    assert loaded.server.advertised_host == "ecs-task-dns"  # each task's own, at start
    assert not loaded.tls.enabled  # the entrypoint adds [tls] with the injected files
    assert "tls" not in tomllib.loads(container)
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
    granted: dict[str, set[str]] = {}
    for statement in filter(None, document["Statement"]):
        resources = statement["Resource"]
        for resource in [resources] if isinstance(resources, str) else resources:
            granted.setdefault(resource, set()).update(
                [statement["Action"]]
                if isinstance(statement["Action"], str)
                else statement["Action"]
            )
    arns = {
        sm.describe_secret(SecretId=name)["ARN"]
        for name in secret_names(stack)
        if "/tls/" not in name  # the task role never reads the TLS key: ECS injects it
    }
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
    assert len(secret_names(stack)) == 6

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


def test_deploy_without_tls_names_the_key(config: Path) -> None:
    """TLS runs to each task now: no [tls] files, no deployment (and nothing created)."""
    text = config.read_text()
    config.write_text(
        "\n".join(
            line
            for line in text.splitlines()
            if line != "[tls]" and not line.startswith(("cert_file", "key_file", "client_ca"))
        )
    )
    with pytest.raises(ConfigError) as caught:
        deploy_aws(config, image=None, console=recorded()[0])
    assert caught.value.key == "tls.cert_file"
    assert stack_status(stack_name(load_settings(config))) is None


def test_a_bad_tls_key_and_a_deprecated_certificate_arn(config: Path, tmp_path: Path) -> None:
    """The [tls] files are checked as the proxy would before anything is stored; an
    aws.certificate_arn (deprecated) still loads and is said to be ignored."""
    good = config.read_text()
    (tmp_path / "other.key").write_bytes(trustme.CA().issue_cert("x").private_key_pem.bytes())
    config.write_text(good.replace(str(tmp_path / "key.pem"), str(tmp_path / "other.key")))
    with pytest.raises(ConfigError) as caught:
        deploy_aws(config, image=None, console=recorded()[0])
    assert caught.value.key == "tls.key_file"
    assert secret_names(stack_name(load_settings(config))) == set()
    config.write_text(good + 'certificate_arn = "arn:aws:acm:us-east-1:1:certificate/x"\n')
    console, out = recorded()
    deploy_aws(config, image=None, console=console)
    assert "aws.certificate_arn is ignored" in out.getvalue().replace("\n", " ")


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
    consumer = next(o["OutputValue"] for o in endpoint if o["OutputKey"] == "BootstrapEndpoint")
    assert consumer in deployed.stdout.replace("\n", "")
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


class TaskMetadata:
    """A stand-in for the ECS task metadata endpoint v4: the container document, whose
    network names this task "localhost" (the private DNS name it advertises)."""

    DOCUMENT = {  # noqa: RUF012
        "Name": "triage",
        "Networks": [
            {
                "NetworkMode": "awsvpc",
                "IPv4Addresses": ["127.0.0.1"],
                "PrivateDNSName": "localhost",
            }
        ],
    }

    def __init__(self) -> None:
        body = json.dumps(self.DOCUMENT).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}/v4/task-1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_container_entrypoint_runs_a_fleet_member_with_tls_from_the_deployed_stack(
    config: Path, broker: EmbeddedBroker, tmp_path: Path, pki: dict[str, Any]
) -> None:
    """What a Fargate task does, minus Docker: infra/entrypoint.sh with the TriageConfig the
    stack passes and the TLS secrets ECS injects (read back from Secrets Manager through
    the task definition's ARNs). The task joins the fleet (no partition), advertises the
    private DNS name its metadata gives, serves TLS with client certificates, and resolves
    the tokens from Secrets Manager (moto) at start. Only the network changes: the local
    broker instead of the SASL one, and loopback instead of 0.0.0.0."""
    settings = load_settings(config)
    outputs = deploy_aws(config, image=None, console=recorded()[0])
    stack = client("cloudformation").describe_stacks(StackName=stack_name(settings))["Stacks"][0]
    container = tomllib.loads(
        next(
            p["ParameterValue"] for p in stack["Parameters"] if p["ParameterKey"] == "TriageConfig"
        )
    )
    ecs = client("ecs")
    (service,) = ecs.describe_services(
        cluster=outputs["ClusterName"], services=[outputs["ServiceName"]]
    )["services"]
    definition = ecs.describe_task_definition(taskDefinition=service["taskDefinition"])
    injected = {
        e["name"]: client("secretsmanager").get_secret_value(SecretId=e["valueFrom"])[
            "SecretString"
        ]
        for e in definition["taskDefinition"]["containerDefinitions"][0]["secrets"]
    }
    topic = container["kafka"]["topic"]
    create_topic(broker.bootstrap, topic, partitions=2)
    for partition in (0, 1):
        produce(broker.bootstrap, topic, [(b"k", b"hello %d" % partition, None)], partition)
    kafka = container["kafka"]
    for key in ("security_protocol", "sasl_mechanism", "sasl_username", "sasl_password"):
        kafka.pop(key)
    kafka["bootstrap_servers"] = broker.bootstrap
    port, http_port = free_port(), free_port()
    container["server"].update(host="127.0.0.1", http_host="127.0.0.1", port=port)
    container["server"]["http_port"] = http_port
    metadata = TaskMetadata()
    env = {
        **os.environ,
        **injected,
        "TRIAGE_CONFIG": tomli_w.dumps(container),
        METADATA_ENV: metadata.uri,
        "TMPDIR": str(tmp_path / "task"),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    (tmp_path / "task").mkdir()
    proc = subprocess.Popen(["sh", str(ENTRYPOINT)], env=env, stderr=subprocess.PIPE)
    try:
        wait_for_port("127.0.0.1", port, 60, proc)
        (written,) = (tmp_path / "task").glob("*/triage.toml")
        assert stat.S_IMODE(written.stat().st_mode) == 0o600
        assert stat.S_IMODE(written.parent.stat().st_mode) == 0o700
        for pem in written.parent.glob("tls-*.pem"):
            assert stat.S_IMODE(pem.stat().st_mode) == 0o600
        assert {p.name for p in written.parent.glob("tls-*.pem")} == {
            "tls-cert.pem",
            "tls-key.pem",
            "tls-client-ca.pem",
        }
        ca = pki["ca"].cert_pem.bytes()
        client_cert = pki["client"]
        mtls = grpc.ssl_channel_credentials(
            ca,
            client_cert.private_key_pem.bytes(),
            b"".join(blob.bytes() for blob in client_cert.cert_chain_pems),
        )

        async def scenario() -> None:
            # TLS with a client certificate, bootstrapped at 127.0.0.1, each partition then
            # reached at the advertised localhost:port: the certificate names both
            seen: list[bytes] = []

            async def handle(message: Message) -> None:
                seen.append(message.value or b"")
                if len(seen) == 2:
                    consumer.stop()

            consumer = Consumer(
                f"127.0.0.1:{port}",
                TOKENS["billing"],
                handle,
                root_certificates=ca,
                private_key=client_cert.private_key_pem.bytes(),
                certificate_chain=b"".join(b.bytes() for b in client_cert.cert_chain_pems),
                max_backoff=0.5,
            )
            async with asyncio.timeout(90):
                await consumer.run_async()
            assert sorted(seen) == [b"hello 0", b"hello 1"]
            # mTLS holds: without a client certificate the handshake is refused
            no_cert = grpc.ssl_channel_credentials(ca)
            async with RawConsumer(
                f"127.0.0.1:{port}", token=TOKENS["billing"], credentials=no_cert
            ) as refused:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await refused.read()
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            # A revoked token is refused. Asked with the unary Topology: on a stream, the
            # client's Hello write can race the refusal and end the call INTERNAL
            # ("Failed execute_batch"), a client-side artefact, not the proxy's answer.
            async with grpc.aio.secure_channel(f"127.0.0.1:{port}", mtls) as channel:
                stub = pb_grpc.TriageStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.Topology(
                        pb.TopologyRequest(), metadata=[("authorization", f"Bearer {REVOKED}")]
                    )
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

        asyncio.run(scenario())
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as r:
            status = json.loads(r.read())
        assert status["mode"] == "fleet"
        assert status["advertised_endpoint"] == f"localhost:{port}"
        assert sorted(part["partition"] for part in status["partitions"]) == [0, 1]
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr.decode(errors="replace")[-2000:]
        for secret in [*TOKENS.values(), injected["TRIAGE_TLS_KEY"]]:
            assert secret.encode() not in stderr
    finally:
        metadata.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_fleet_hosts_are_the_running_tasks_private_ips(config: Path) -> None:
    """`triage status --target aws` asks the tasks moto's ECS reports for the service
    (moto places none from CloudFormation: none, not an error), and the addresses come
    from each task's network interface."""
    from triage_cli.aws import task_hosts

    deploy_aws(config, image=None, console=recorded()[0])
    assert fleet_hosts(config) == []
    eni = {"type": "ElasticNetworkInterface", "details": []}
    described = [
        {"attachments": [{**eni, "details": [{"name": "privateIPv4Address", "value": ip}]}]}
        for ip in ("10.0.1.9", "10.0.0.7")
    ]
    assert task_hosts([*described, {"attachments": [eni]}, {}]) == ["10.0.0.7", "10.0.1.9"]


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
    console, out = recorded()
    deploy_aws(config, image=None, console=console)
    assert "2 fleet task(s) for 3 partition(s)" in out.getvalue()
    params = client("cloudformation").describe_stacks(StackName=stack_name(settings))["Stacks"][0][
        "Parameters"
    ]
    found = {p["ParameterKey"]: p["ParameterValue"] for p in params}
    assert found["Proxies"] == "2"
    assert tomllib.loads(found["TriageConfig"])["kafka"]["partitions"] == 3


def test_aws_proxies_set_the_service_size(config: Path) -> None:
    config.write_text(config.read_text() + "proxies = 3\n")  # [aws] is the last table
    console, out = recorded()
    outputs = deploy_aws(config, image=None, console=console)
    assert "1 will hold no partition" in out.getvalue()
    (service,) = client("ecs").describe_services(
        cluster=outputs["ClusterName"], services=[outputs["ServiceName"]]
    )["services"]
    assert service["desiredCount"] == 3
