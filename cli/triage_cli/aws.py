"""`triage deploy --target aws` and `triage destroy --target aws`.

deploy_aws, in order (each step is idempotent, so a rerun continues a failed one):

1. the DynamoDB dead-letter table (`table.provisioning.create_table`: the proxy's key
   schema, TTL when `ttl_days`) with point-in-time recovery on;
2. the S3 overflow bucket (`table.provisioning.create_bucket`) with default encryption
   and every public-access block on;
3. Secrets Manager entries `<stack>/token/<name>` for each active token,
   `<stack>/kafka-sasl-password` for a password given as "env:VAR" (a "secret:NAME"
   password is used where it is) and `<stack>/tls/{cert,key,client-ca}` holding the
   `[tls]` files (checked first as the proxy would). The values are never printed or
   logged; the containers' config holds only "secret:NAME" references, read with the
   task role; the TLS secrets reach the container through ECS (the execution role);
4. the CloudFormation stack (`awsstack.render`: one service of `aws.proxies` fleet tasks
   behind one TCP listener) created or updated, followed with a progress display until
   it settles; returns its outputs.

destroy_aws deletes the stack and waits. The table, bucket and secrets stay unless
`delete_data`. Every client uses boto3's standard credential chain and honours
`AWS_ENDPOINT_URL` (boto3 >= 1.28 reads it itself), which is how the tests point it at
moto server; the region is `dead_letters.region`, where the proxies look for the table.
Failures of AWS calls raise `DeployError` (through `table.aws.aws_errors`, the one place
botocore's errors are caught); config problems raise `ConfigError`; the table and bucket
steps raise what `table.provisioning` raises.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import tomli_w
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from triage_cli.awsstack import LOG_RETENTION_DAYS, SERVICE_NAME, render
from triage_proxy.config.checks import check_tls
from triage_proxy.config.ecs import ECS_ADDRESS_KINDS, ECS_TASK_DNS
from triage_proxy.config.loader import load_settings, settings_from_dict
from triage_proxy.config.secrets import secret_reference
from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.config.settings import Settings
from triage_proxy.errors import ConfigError, DeployError, TriageError
from triage_proxy.store.aws import (
    ANY_CODE,
    TABLE_MISSING,
    aws_client,
    aws_errors,
    dynamodb_client,
    read_secret,
    s3_client,
)
from triage_proxy.store.provisioning import (
    create_bucket,
    create_table,
    enable_point_in_time_recovery,
)

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

logger = logging.getLogger(__name__)

DEPLOY_TIMEOUT_S = 60.0
"""Connect and read timeout of deploy's AWS calls (botocore's default)."""
DEPLOY_ATTEMPTS = 5
"""Attempts per deploy AWS call (botocore's default)."""
STACK_TIMEOUT_S = 3600.0
"""Longest a create/update/delete may take before deploy gives up waiting (not the stack)."""
POLL_INTERVAL_S = 2.0
PARAMETER_LIMIT = 4096
"""CloudFormation's limit on one parameter value (the container config travels in one)."""
CAPABILITIES = ["CAPABILITY_IAM"]
_OK = {"CREATE_COMPLETE", "UPDATE_COMPLETE", "IMPORT_COMPLETE"}
_GONE = {"DELETE_COMPLETE"}
_NO_UPDATES = "No updates are to be performed"
_ECR_IMAGE = re.compile(
    r"^(?P<account>\d{12})\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?P<cn>\.cn)?"
    r"/(?P<repo>[^:@]+)"
)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _Deployment:
    """What a config deploys, as names in AWS."""

    settings: Settings
    """The validated config."""
    raw: dict[str, Any]
    """The TOML as written (references unresolved), the base of the containers' config."""
    stack: str
    """CloudFormation stack name; prefixes the secret names too."""
    region: str
    """Where everything lives (the table's region)."""
    dead_letters: DeadLetterSettings
    """`dead_letters` without endpoint_url, so clients follow AWS_ENDPOINT_URL instead."""

    def aws_client(self, service: str) -> Any:
        """A boto3 client from the AWS edge: standard credentials, AWS_ENDPOINT_URL, the
        deployment's region, and botocore's own timeouts and attempts (a stack call may
        take long)."""
        return aws_client(
            service,
            self.dead_letters,
            connect_timeout_s=DEPLOY_TIMEOUT_S,
            read_timeout_s=DEPLOY_TIMEOUT_S,
            max_attempts=DEPLOY_ATTEMPTS,
        )

    @property
    def token_prefix(self) -> str:
        return f"{self.stack}/token/"

    @property
    def kafka_secret_name(self) -> str:
        return f"{self.stack}/kafka-sasl-password"

    @property
    def tls_prefix(self) -> str:
        return f"{self.stack}/tls/"


@dataclasses.dataclass(frozen=True)
class _Secrets:
    """What `_store_secrets` put where (ARNs and references, never values)."""

    token_refs: dict[str, str]
    """Token name -> "secret:NAME" for the containers' config."""
    kafka_ref: str | None
    """The Kafka password's reference, or None."""
    task_arns: list[str]
    """What the task role may read (tokens, the Kafka password)."""
    tls_arns: dict[str, str]
    """"cert", "key" and, with mTLS, "client-ca" -> ARN: injected by ECS."""


def stack_name(settings: Settings) -> str:
    """`aws.stack_name`, else "triage-<topic>-<group>" made CloudFormation-safe; a short
    hash of the originals keeps topics that sanitize alike ("a.b", "a_b") apart."""
    if settings.aws.stack_name:
        return settings.aws.stack_name
    raw = f"{settings.kafka.topic}-{settings.kafka.group_id}"
    clean = re.sub(r"[^A-Za-z0-9]+", "-", raw).strip("-")
    name = f"triage-{clean}"[:100]
    if clean != raw or len(f"triage-{clean}") > 100:
        name += "-" + hashlib.sha256(raw.encode()).hexdigest()[:8]
    return name


def _load(config: Path) -> _Deployment:
    settings = load_settings(config, fetch_secret=read_secret)
    raw = tomllib.loads(config.read_text())
    name = stack_name(settings)
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]{0,127}", name):
        raise ConfigError("aws.stack_name", f"not a CloudFormation stack name: {name!r}")
    dead_letters = dataclasses.replace(settings.dead_letters, endpoint_url=None)
    return _Deployment(settings, raw, name, dead_letters.region, dead_letters)


def _aws_call(what: str, call: Callable[[], T]) -> T:
    """Run one AWS call; its errors become DeployError saying which step failed."""
    with aws_errors(what, DeployError):
        result = call()
    return result


# --- deploy ---------------------------------------------------------------------------


def deploy_aws(config: Path, *, image: str | None, console: Console) -> dict[str, str]:
    """Create or update the AWS deployment of `config`; returns the stack's outputs
    (BootstrapEndpoint, LoadBalancerDns, ClusterName, ServiceName, LogGroupName,
    and ConsumerEndpoint: deprecated, the same as BootstrapEndpoint)."""
    dep = _load(config)
    settings = dep.settings
    aws = settings.aws
    image = image or aws.image
    if not image:
        raise ConfigError("aws.image", "no container image: pass --image or set aws.image")
    if not settings.tls.enabled:
        raise ConfigError(
            "tls.cert_file",
            "an AWS deployment serves TLS from each task (the load balancer passes TCP "
            "through): set tls.cert_file and tls.key_file; deploy stores them in Secrets "
            "Manager",
        )
    check_tls(settings.tls)  # a bad file fails here, not in every task at start
    if not settings.server.port:
        raise ConfigError("server.port", "the load balancer needs a fixed port, not 0")
    if aws.log_retention_days not in LOG_RETENTION_DAYS:
        raise ConfigError(
            "aws.log_retention_days",
            f"CloudWatch keeps logs {', '.join(map(str, LOG_RETENTION_DAYS))} days",
        )
    if aws.certificate_arn:
        console.print(
            "[yellow]note:[/] aws.certificate_arn is ignored (deprecated: a future version "
            "refuses it): TLS runs from each consumer to the task that serves it, with the "
            "[tls] files"
        )
    partitions = settings.kafka.partitions
    if partitions is None:
        from triage_cli.init import discover_partitions

        partitions = discover_partitions(dict(dep.raw["kafka"]))
    proxies = aws.fleet_size(partitions)
    if proxies > partitions:
        console.print(
            f"[yellow]note:[/] {proxies} tasks for {partitions} partition(s): "
            f"{proxies - partitions} will hold no partition until another task goes"
        )
    http_port = _monitoring_port(settings)
    with _steps(console, 5) as step:
        step("dead-letter table")
        create_table(dep.dead_letters)
        enable_point_in_time_recovery(dep.dead_letters)
        step("overflow bucket")
        _create_bucket(dep)
        step("secrets")
        stored = _store_secrets(dep)
        step("container config")
        container_config = _container_config(dep, partitions, stored.token_refs, stored.kafka_ref)
        vpc_id, vpc_cidr, subnets = _network(dep)
        step(f"stack {dep.stack}")
    bucket = dep.dead_letters.overflow_bucket
    count = len(stored.task_arns) + len(stored.tls_arns)
    console.print(
        f"[green]ready:[/] table {dep.dead_letters.table} (point-in-time recovery on)"
        + (f", bucket {bucket} (encrypted, not public)" if bucket else "")
        + f", {count} secret(s)"
    )
    parameters = {
        "Image": image,
        "Proxies": str(proxies),
        "VpcId": vpc_id,
        "SubnetIds": ",".join(subnets),
        "Scheme": aws.scheme,
        "ClientCidr": aws.client_cidr,
        "AssignPublicIp": "ENABLED" if aws.assign_public_ip else "DISABLED",
        "Cpu": str(aws.cpu),
        "Memory": str(aws.memory_mb),
        "LogRetentionDays": str(aws.log_retention_days),
        "TriageConfig": container_config,
        "TableName": dep.dead_letters.table,
        "OverflowBucket": dep.dead_letters.overflow_bucket or "",
        "NotifyTopicArn": dep.dead_letters.notify_sns_topic_arn or "",
        "SecretArns": ",".join(stored.task_arns),
        "TlsCertSecretArn": stored.tls_arns["cert"],
        "TlsKeySecretArn": stored.tls_arns["key"],
        "TlsClientCaSecretArn": stored.tls_arns.get("client-ca", ""),
        "CreateListener": "true" if aws.listener else "false",
        "ImageRepositoryArn": _repository_arn(image),
    }
    if http_port is not None:
        parameters["VpcCidr"] = vpc_cidr
    body = render(settings.server.port, http_port)
    outputs = _apply_stack(dep, body, parameters, console)
    endpoint = outputs.get("BootstrapEndpoint", "?")
    console.print(
        f"[green]deployed[/] {dep.stack}: {proxies} fleet task(s) for {partitions} "
        f"partition(s); consumers bootstrap with TLS at [bold]{endpoint}[/] and then reach "
        "each task at its own address inside the VPC"
    )
    return outputs


def _monitoring_port(settings: Settings) -> int | None:
    """The tasks' HTTP port (/status, /metrics), or None when it is off or picked at start."""
    address = settings.server.http_address(0)
    return address[1] if address is not None and address[1] else None


@contextmanager
def _steps(console: Console, total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar over the preparation steps; `step(name)` starts the next one."""
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("preparing", total=total)
        started = [False]

        def step(name: str) -> None:
            if started[0]:
                progress.advance(task)
            started[0] = True
            progress.update(task, description=name)

        yield step
        progress.advance(task)


def _create_bucket(dep: _Deployment) -> None:
    bucket = dep.dead_letters.overflow_bucket
    if bucket is None:
        return
    create_bucket(dep.dead_letters)
    client = s3_client(dep.dead_letters)
    try:
        _aws_call(
            f"encrypting bucket {bucket}",
            lambda: client.put_bucket_encryption(
                Bucket=bucket,
                ServerSideEncryptionConfiguration={
                    "Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]
                },
            ),
        )
        _aws_call(
            f"blocking public access to bucket {bucket}",
            lambda: client.put_public_access_block(
                Bucket=bucket,
                PublicAccessBlockConfiguration={
                    "BlockPublicAcls": True,
                    "IgnorePublicAcls": True,
                    "BlockPublicPolicy": True,
                    "RestrictPublicBuckets": True,
                },
            ),
        )
    finally:
        client.close()


def _store_secrets(dep: _Deployment) -> _Secrets:
    """Put each active token, an env: Kafka password and the [tls] files in Secrets
    Manager. Values go only into SecretString; nothing here prints them."""
    client = dep.aws_client("secretsmanager")
    refs: dict[str, str] = {}
    arns: list[str] = []
    for name, value in sorted(dep.settings.auth.active().items()):
        secret = dep.token_prefix + re.sub(r"[^A-Za-z0-9/_+=.@-]", "-", name)
        arns.append(_put_secret(client, dep, secret, value))
        refs[name] = f"secret:{secret}"
    kafka_ref: str | None = None
    password = dep.settings.kafka.sasl_password
    if password is not None:
        kind, existing = secret_reference(password) or ("", "")
        if kind == "secret":
            found = _aws_call(
                f"reading secret {existing}", lambda: client.describe_secret(SecretId=existing)
            )
            arns.append(str(found["ARN"]))
            kafka_ref = password
        else:
            value = dep.settings.kafka.secrets("kafka.sasl_password", password)
            arns.append(_put_secret(client, dep, dep.kafka_secret_name, value))
            kafka_ref = f"secret:{dep.kafka_secret_name}"
    tls = dep.settings.tls
    files = {"cert": tls.cert_file, "key": tls.key_file, "client-ca": tls.client_ca_file}
    tls_arns = {
        name: _put_secret(client, dep, dep.tls_prefix + name, Path(path).read_text())
        for name, path in files.items()
        if path is not None
    }
    if tls.client_ca_file is None:  # mTLS turned off: no stale CA left to read
        _delete_secret_if_any(client, dep.tls_prefix + "client-ca")
    return _Secrets(refs, kafka_ref, arns, tls_arns)


def _delete_secret_if_any(client: Any, name: str) -> None:
    with aws_errors(f"deleting secret {name}", DeployError, expect={"ResourceNotFoundException"}):
        client.delete_secret(SecretId=name, ForceDeleteWithoutRecovery=True)


def _put_secret(client: Any, dep: _Deployment, name: str, value: str) -> str:
    """Create `name` holding `value`, or give it `value` if it differs; returns its ARN."""
    tags = [
        {"Key": "triage:stack", "Value": dep.stack},
        {"Key": "triage:topic", "Value": dep.settings.kafka.topic},
    ]
    with aws_errors(f"creating secret {name}", DeployError, expect=ANY_CODE) as refused:
        created = client.create_secret(Name=name, SecretString=value, Tags=tags)
    if not refused:
        logger.info("created secret %s", name)
        return str(created["ARN"])
    if refused.code != "ResourceExistsException":  # the code only: nothing near the value
        raise DeployError(f"creating secret {name} failed: {refused.code}") from None
    current = _aws_call(f"reading secret {name}", lambda: client.get_secret_value(SecretId=name))
    if current.get("SecretString") != value:
        _aws_call(
            f"updating secret {name}",
            lambda: client.put_secret_value(SecretId=name, SecretString=value),
        )
        logger.info("updated secret %s", name)
    return str(current["ARN"])


def _container_config(
    dep: _Deployment, partitions: int, token_refs: Mapping[str, str], kafka_ref: str | None
) -> str:
    """triage.toml for the containers: the operator's config with secrets as references,
    listening on every interface (gRPC, and HTTP for `triage status` inside the VPC), AWS
    endpoints (no endpoint_url), no [aws], no [tls] (the entrypoint adds it with the files
    ECS injects from Secrets Manager), and each task advertising its own address
    (`ecstask`: "ecs-task-dns" unless the operator chose "ecs-task-ip"). Checked by
    loading it, which also reads every secret back."""
    doc: dict[str, Any] = {
        name: dict(table) for name, table in dep.raw.items() if name not in ("tls", "aws")
    }
    doc["kafka"]["partitions"] = partitions
    if kafka_ref is not None:
        doc["kafka"]["sasl_password"] = kafka_ref
    # One config serves every task, and each is dialled at its own address on the port it
    # binds: an advertised address meant for elsewhere would be wrong here.
    server = dict(doc.get("server", {}))
    chosen = server.pop("advertised_host", None)
    server.pop("advertised_port", None)
    server["advertised_host"] = chosen if chosen in ECS_ADDRESS_KINDS else ECS_TASK_DNS
    server["host"] = "0.0.0.0"
    if _monitoring_port(dep.settings) is not None:
        server["http_host"] = "0.0.0.0"  # the security group lets only the VPC in
    doc["server"] = server
    auth: dict[str, Any] = {"tokens": dict(token_refs)}
    if dep.settings.auth.revoked:
        auth["revoked"] = list(dep.settings.auth.revoked)
    doc["auth"] = auth
    doc["dead_letters"].pop("endpoint_url", None)
    doc["dead_letters"]["region"] = dep.region
    text = tomli_w.dumps(doc)
    if len(text.encode()) > PARAMETER_LIMIT:
        raise ConfigError(
            "<file>",
            f"the containers' config is {len(text.encode())} bytes, over CloudFormation's "
            f"{PARAMETER_LIMIT}-byte parameter limit; drop long kafka.client extras",
        )
    try:
        settings_from_dict(tomllib.loads(text), env={}, fetch_secret=read_secret)
    except TriageError as exc:
        raise DeployError(f"the containers' config would not load: {exc}") from exc
    return text


def _network(dep: _Deployment) -> tuple[str, str, list[str]]:
    """(VPC id, its CIDR, subnets): aws.vpc_id / aws.subnet_ids, else the default VPC and
    its default subnets. The CIDR bounds who may reach the tasks' HTTP endpoint."""
    aws = dep.settings.aws
    ec2 = dep.aws_client("ec2")
    if aws.vpc_id is None:
        vpcs = _aws_call(
            "finding the default VPC",
            lambda: ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}]),
        )["Vpcs"]
        if not vpcs:
            raise ConfigError("aws.vpc_id", f"no default VPC in {dep.region}: set aws.vpc_id")
    else:
        chosen = aws.vpc_id
        vpcs = _aws_call(f"describing VPC {chosen}", lambda: ec2.describe_vpcs(VpcIds=[chosen]))[
            "Vpcs"
        ]
        if not vpcs:
            raise ConfigError("aws.vpc_id", f"no VPC {chosen} in {dep.region}")
    vpc_id, cidr = str(vpcs[0]["VpcId"]), str(vpcs[0]["CidrBlock"])
    if aws.subnet_ids:
        return vpc_id, cidr, list(aws.subnet_ids)
    filters = [{"Name": "vpc-id", "Values": [vpc_id]}]
    if aws.vpc_id is None:
        filters.append({"Name": "default-for-az", "Values": ["true"]})
    found = _aws_call(
        f"listing the subnets of {vpc_id}", lambda: ec2.describe_subnets(Filters=filters)
    )["Subnets"]
    if not found:
        raise ConfigError("aws.subnet_ids", f"VPC {vpc_id} has no subnets: set aws.subnet_ids")
    return vpc_id, cidr, sorted(str(s["SubnetId"]) for s in found)


def _repository_arn(image: str) -> str:
    """The ECR repository ARN of an ECR image (the execution role may pull only it)."""
    match = _ECR_IMAGE.match(image)
    if match is None:
        return "*"  # not ECR: no ECR permission is used, the statement is inert
    partition = "aws-cn" if match["cn"] else "aws"
    return f"arn:{partition}:ecr:{match['region']}:{match['account']}:repository/{match['repo']}"


# --- the running fleet ----------------------------------------------------------------

DESCRIBE_TASKS_LIMIT = 100
"""ECS DescribeTasks takes at most 100 tasks per call."""


def fleet_hosts(config: Path) -> list[str]:
    """The private IPv4 address of each running task of the deployment's service, where
    `triage status --target aws` asks `/status` (sorted; empty when none runs)."""
    dep = _load(config)
    ecs = dep.aws_client("ecs")
    what = f"listing the tasks of {dep.stack}/{SERVICE_NAME}"
    pages = ecs.get_paginator("list_tasks").paginate(
        cluster=dep.stack, serviceName=SERVICE_NAME, desiredStatus="RUNNING"
    )
    arns = [arn for page in _aws_call(what, lambda: list(pages)) for arn in page["taskArns"]]
    tasks: list[Mapping[str, Any]] = []
    for start in range(0, len(arns), DESCRIBE_TASKS_LIMIT):
        chunk = arns[start : start + DESCRIBE_TASKS_LIMIT]
        found = _aws_call(
            f"describing the tasks of {dep.stack}",
            lambda chunk=chunk: ecs.describe_tasks(cluster=dep.stack, tasks=chunk),  # type: ignore[misc]
        )
        tasks.extend(found["tasks"])
    return task_hosts(tasks)


def task_hosts(tasks: list[Mapping[str, Any]]) -> list[str]:
    """The private IPv4 address of each described task's network interface (pure; a task
    still being placed has none yet and is left out)."""
    hosts = {
        str(detail["value"])
        for task in tasks
        for attachment in task.get("attachments", [])
        if attachment.get("type") == "ElasticNetworkInterface"
        for detail in attachment.get("details", [])
        if detail.get("name") == "privateIPv4Address" and detail.get("value")
    }
    return sorted(hosts)


# --- the stack ------------------------------------------------------------------------


def _stack_status(cfn: Any, stack: str) -> str | None:
    """The stack's status, or None when there is none (never created, or deleted)."""
    what = f"describing stack {stack}"
    with aws_errors(what, DeployError, expect={"ValidationError"}) as refused:
        stacks = cfn.describe_stacks(StackName=stack)["Stacks"]
    if refused:
        if "does not exist" in refused.message:
            return None
        raise DeployError(f"{what} failed: {refused.describe()}") from refused.error
    status = str(stacks[0]["StackStatus"]) if stacks else None
    return None if status in _GONE else status


def _apply_stack(
    dep: _Deployment, body: str, parameters: Mapping[str, str], console: Console
) -> dict[str, str]:
    cfn = dep.aws_client("cloudformation")
    params = [{"ParameterKey": k, "ParameterValue": v} for k, v in parameters.items()]
    tags = [
        {"Key": "triage:topic", "Value": dep.settings.kafka.topic},
        {"Key": "triage:group", "Value": dep.settings.kafka.group_id},
    ]
    status = _stack_status(cfn, dep.stack)
    if status == "ROLLBACK_COMPLETE":  # a failed first create can only be deleted
        console.print(f"{dep.stack} failed to create earlier; deleting it before retrying")
        _aws_call(f"deleting stack {dep.stack}", lambda: cfn.delete_stack(StackName=dep.stack))
        _wait(cfn, dep.stack, "delete", console)
        status = None
    if status is not None and status.endswith("_IN_PROGRESS"):
        raise DeployError(f"stack {dep.stack} is busy ({status}); rerun once it settles")
    if status is None:
        _aws_call(
            f"creating stack {dep.stack}",
            lambda: cfn.create_stack(
                StackName=dep.stack,
                TemplateBody=body,
                Parameters=params,
                Capabilities=CAPABILITIES,
                Tags=tags,
            ),
        )
        _wait(cfn, dep.stack, "create", console)
    else:
        what = f"updating stack {dep.stack}"
        with aws_errors(what, DeployError, expect={"ValidationError"}) as refused:
            cfn.update_stack(
                StackName=dep.stack,
                TemplateBody=body,
                Parameters=params,
                Capabilities=CAPABILITIES,
                Tags=tags,
            )
        if not refused:
            _wait(cfn, dep.stack, "update", console)
        elif _NO_UPDATES in refused.message:
            console.print(f"{dep.stack} is up to date")
        else:
            raise DeployError(f"{what} failed: {refused.describe()}") from refused.error
    found = _aws_call(
        f"reading the outputs of {dep.stack}", lambda: cfn.describe_stacks(StackName=dep.stack)
    )["Stacks"][0]
    return {str(o["OutputKey"]): str(o["OutputValue"]) for o in found.get("Outputs", [])}


def _wait(cfn: Any, stack: str, action: str, console: Console) -> None:
    """Follow a stack operation until it settles, resources done / total as a bar."""
    deadline = time.monotonic() + STACK_TIMEOUT_S
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} resources"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(f"{action} {stack}", total=None)
        while True:
            status = _stack_status(cfn, stack)
            _show_resources(cfn, stack, action, progress, task)
            progress.update(task, description=f"{action} {stack}: {status or 'DELETE_COMPLETE'}")
            if action == "delete" and status is None:
                break
            if status is not None and not status.endswith("_IN_PROGRESS"):
                break
            if time.monotonic() > deadline:
                raise DeployError(f"stack {stack} still {status} after {STACK_TIMEOUT_S:g}s")
            time.sleep(POLL_INTERVAL_S)
    if action == "delete" and status is None:
        console.print(f"[green]deleted[/] stack {stack}")
        return
    if status in _OK:
        console.print(f"[green]{status}[/] {stack}")
        return
    raise DeployError(f"stack {stack} ended {status}: {_failure_reasons(cfn, stack)}")


def _show_resources(cfn: Any, stack: str, action: str, progress: Progress, task: TaskID) -> None:
    with aws_errors(f"describing stack {stack}", DeployError, expect=ANY_CODE) as gone:
        resources = cfn.describe_stack_resources(StackName=stack)["StackResources"]
    if gone:
        return  # deleted meanwhile
    suffix = "DELETE_COMPLETE" if action == "delete" else "_COMPLETE"
    done = sum(1 for r in resources if str(r.get("ResourceStatus", "")).endswith(suffix))
    progress.update(task, total=len(resources), completed=done)


def _failure_reasons(cfn: Any, stack: str) -> str:
    """The first few resource failures from the stack's events, for the error message."""
    with aws_errors(f"reading the events of {stack}", DeployError, expect=ANY_CODE) as gone:
        events = cfn.describe_stack_events(StackName=stack)["StackEvents"]
    if gone:
        return "no events"
    reasons = [
        f"{e.get('LogicalResourceId')}: {e.get('ResourceStatusReason')}"
        for e in events
        if str(e.get("ResourceStatus", "")).endswith("_FAILED") and e.get("ResourceStatusReason")
    ]
    return "; ".join(reasons[:5]) or "see the stack's events"


# --- destroy --------------------------------------------------------------------------


def destroy_aws(config: Path, *, delete_data: bool, console: Console) -> None:
    """Delete the stack of `config` and wait; with `delete_data` also the dead-letter
    table, the overflow bucket (emptied first) and the secrets deploy created."""
    dep = _load(config)
    cfn = dep.aws_client("cloudformation")
    if _stack_status(cfn, dep.stack) is None:
        console.print(f"no stack {dep.stack} in {dep.region}; nothing to delete")
    else:
        _aws_call(f"deleting stack {dep.stack}", lambda: cfn.delete_stack(StackName=dep.stack))
        _wait(cfn, dep.stack, "delete", console)
    kept = [f"table {dep.dead_letters.table}"]
    if dep.dead_letters.overflow_bucket:
        kept.append(f"bucket {dep.dead_letters.overflow_bucket}")
    if not delete_data:
        console.print(
            f"kept {', '.join(kept)} and the secrets under {dep.stack}/ "
            "(--delete-data removes them)"
        )
        return
    _delete_table(dep)
    _delete_bucket(dep)
    _delete_secrets(dep)
    console.print(f"[green]deleted[/] {', '.join(kept)} and the secrets under {dep.stack}/")


def _delete_table(dep: _Deployment) -> None:
    table = dep.dead_letters.table
    client = dynamodb_client(dep.dead_letters)
    try:
        with aws_errors(f"deleting table {table}", DeployError, expect={TABLE_MISSING}) as gone:
            client.delete_table(TableName=table)
        if gone:
            return
        _aws_call(
            f"waiting for table {table} to go",
            lambda: client.get_waiter("table_not_exists").wait(
                TableName=table, WaiterConfig={"Delay": 1, "MaxAttempts": 300}
            ),
        )
    finally:
        client.close()


def _delete_bucket(dep: _Deployment) -> None:
    """Empty (every version, if versioning was ever on) and delete the overflow bucket."""
    bucket = dep.dead_letters.overflow_bucket
    if bucket is None:
        return
    client = s3_client(dep.dead_letters)
    try:
        with aws_errors(f"deleting bucket {bucket}", DeployError, expect={"NoSuchBucket"}):
            _empty_and_delete(client, bucket)
    finally:
        client.close()


def _empty_and_delete(client: S3Client, bucket: str) -> None:
    """Delete every object version (if versioning was ever on) and then the bucket."""
    pages = client.get_paginator("list_object_versions").paginate(Bucket=bucket)
    for page in pages:
        doomed = [
            {"Key": v["Key"], "VersionId": v["VersionId"]}
            for v in [*page.get("Versions", []), *page.get("DeleteMarkers", [])]
        ]
        if doomed:
            client.delete_objects(Bucket=bucket, Delete={"Objects": doomed, "Quiet": True})  # type: ignore[typeddict-item]
    client.delete_bucket(Bucket=bucket)


def _delete_secrets(dep: _Deployment) -> None:
    """Delete the secrets deploy created (never a "secret:NAME" the operator owns)."""
    client = dep.aws_client("secretsmanager")
    pages = client.get_paginator("list_secrets").paginate(
        Filters=[{"Key": "name", "Values": [f"{dep.stack}/"]}]
    )
    names = [
        str(s["Name"])
        for page in _aws_call("listing secrets", lambda: list(pages))
        for s in page["SecretList"]
        if str(s["Name"]).startswith(f"{dep.stack}/")
    ]
    for name in names:
        # no recovery window: a redeploy may create the same name again at once
        _aws_call(
            f"deleting secret {name}",
            lambda name=name: client.delete_secret(SecretId=name, ForceDeleteWithoutRecovery=True),  # type: ignore[misc]
        )
