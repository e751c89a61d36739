"""`triage deploy --target aws` and `triage destroy --target aws`.

deploy_aws, in order (each step is idempotent, so a rerun continues a failed one):

1. the DynamoDB dead-letter table (`table.provisioning.create_table`: the proxy's key
   schema, TTL when `ttl_days`) with point-in-time recovery on;
2. the S3 overflow bucket (`table.provisioning.create_bucket`) with default encryption
   and every public-access block on;
3. Secrets Manager entries `<stack>/token/<name>` for each active token and
   `<stack>/kafka-sasl-password` for a password given as "env:VAR" (a "secret:NAME"
   password is used where it is). The values are never printed or logged; the
   containers' config holds only "secret:NAME" references, read with the task role;
4. the CloudFormation stack (`awsstack.render` for the partition count) created or
   updated, followed with a progress display until it settles; returns its outputs.

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

from triage_cli.awsstack import LOG_RETENTION_DAYS, render
from triage_proxy.errors import ConfigError, DeployError, TriageError
from triage_proxy.settings import (
    DeadLetterSettings,
    Settings,
    load_settings,
    resolve_secret,
    secret_reference,
    settings_from_dict,
)
from triage_proxy.table.aws import ANY_CODE, TABLE_MISSING, aws_errors, dynamodb_client, s3_client
from triage_proxy.table.provisioning import (
    create_bucket,
    create_table,
    enable_point_in_time_recovery,
)

if TYPE_CHECKING:
    from mypy_boto3_s3.client import S3Client

logger = logging.getLogger(__name__)

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

    def client(self, service: str) -> Any:
        """A boto3 client: standard credentials, AWS_ENDPOINT_URL, the deployment's region."""
        import boto3

        return boto3.session.Session().client(service, region_name=self.region)  # type: ignore[call-overload]

    @property
    def token_prefix(self) -> str:
        return f"{self.stack}/token/"

    @property
    def kafka_secret_name(self) -> str:
        return f"{self.stack}/kafka-sasl-password"


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
    settings = load_settings(config)
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
    (ConsumerEndpoint, Partition<p>Endpoint, LoadBalancerDns, ClusterName, LogGroupName)."""
    dep = _load(config)
    aws = dep.settings.aws
    image = image or aws.image
    if not image:
        raise ConfigError("aws.image", "no container image: pass --image or set aws.image")
    if not aws.certificate_arn:
        raise ConfigError("aws.certificate_arn", "the TLS listeners need an ACM certificate ARN")
    if aws.log_retention_days not in LOG_RETENTION_DAYS:
        raise ConfigError(
            "aws.log_retention_days",
            f"CloudWatch keeps logs {', '.join(map(str, LOG_RETENTION_DAYS))} days",
        )
    partitions = dep.settings.kafka.partitions
    if partitions is None:
        from triage_cli.init import discover_partitions

        partitions = discover_partitions(dict(dep.raw["kafka"]))
    if dep.settings.tls.client_ca_file:
        console.print(
            "[yellow]note:[/] tls.client_ca_file is not carried to AWS: the NLB terminates "
            "TLS and cannot ask for client certificates; tokens still apply."
        )
    with _steps(console, 5) as step:
        step("dead-letter table")
        create_table(dep.dead_letters)
        enable_point_in_time_recovery(dep.dead_letters)
        step("overflow bucket")
        _create_bucket(dep)
        step("secrets")
        token_refs, kafka_ref, secret_arns = _store_secrets(dep)
        step("container config")
        container_config = _container_config(dep, partitions, token_refs, kafka_ref)
        vpc_id, subnets = _network(dep)
        step(f"stack {dep.stack}")
    bucket = dep.dead_letters.overflow_bucket
    console.print(
        f"[green]ready:[/] table {dep.dead_letters.table} (point-in-time recovery on)"
        + (f", bucket {bucket} (encrypted, not public)" if bucket else "")
        + f", {len(secret_arns)} secret(s)"
    )
    parameters = {
        "Image": image,
        "CertificateArn": aws.certificate_arn,
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
        "SecretArns": ",".join(secret_arns),
        "TlsListeners": "true" if aws.tls_listeners else "false",
        "ImageRepositoryArn": _repository_arn(image),
    }
    body = render(partitions, dep.settings.server.port)
    outputs = _apply_stack(dep, body, parameters, console)
    endpoint = outputs.get("ConsumerEndpoint", "?")
    console.print(
        f"[green]deployed[/] {dep.stack}: {partitions} partition(s); consumers connect with "
        f"TLS to [bold]{endpoint}[/] (partition p on port {dep.settings.server.port} + p)"
    )
    return outputs


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


def _store_secrets(dep: _Deployment) -> tuple[dict[str, str], str | None, list[str]]:
    """Put each active token (and an env: Kafka password) in Secrets Manager.

    Returns (token name -> "secret:NAME", the Kafka password reference or None, the ARNs
    the task role may read). Values go only into SecretString; nothing here prints them.
    """
    client = dep.client("secretsmanager")
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
            value = resolve_secret("kafka.sasl_password", password)
            arns.append(_put_secret(client, dep, dep.kafka_secret_name, value))
            kafka_ref = f"secret:{dep.kafka_secret_name}"
    return refs, kafka_ref, arns


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
    listening on every interface, AWS endpoints (no endpoint_url), no TLS files (the NLB
    terminates TLS), no [aws], no advertised address (the stack sets the NLB's). Checked
    by loading it, which also reads every secret back."""
    doc: dict[str, Any] = {
        name: dict(table) for name, table in dep.raw.items() if name not in ("tls", "aws")
    }
    doc["kafka"]["partitions"] = partitions
    if kafka_ref is not None:
        doc["kafka"]["sasl_password"] = kafka_ref
    # The stack advertises the NLB's name (TRIAGE_ADVERTISED_HOST) and its listener port
    # is the container's: an advertised address meant for elsewhere would be wrong here.
    server = {
        k: v
        for k, v in doc.get("server", {}).items()
        if k not in ("advertised_host", "advertised_port")
    }
    doc["server"] = {**server, "host": "0.0.0.0"}
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
        settings_from_dict(tomllib.loads(text), env={})
    except TriageError as exc:
        raise DeployError(f"the containers' config would not load: {exc}") from exc
    return text


def _network(dep: _Deployment) -> tuple[str, list[str]]:
    """aws.vpc_id / aws.subnet_ids, else the default VPC and its default subnets."""
    aws = dep.settings.aws
    ec2 = dep.client("ec2")
    vpc_id = aws.vpc_id
    if vpc_id is None:
        vpcs = _aws_call(
            "finding the default VPC",
            lambda: ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}]),
        )["Vpcs"]
        if not vpcs:
            raise ConfigError("aws.vpc_id", f"no default VPC in {dep.region}: set aws.vpc_id")
        vpc_id = str(vpcs[0]["VpcId"])
    if aws.subnet_ids:
        return vpc_id, list(aws.subnet_ids)
    filters = [{"Name": "vpc-id", "Values": [vpc_id]}]
    if aws.vpc_id is None:
        filters.append({"Name": "default-for-az", "Values": ["true"]})
    found = _aws_call(
        f"listing the subnets of {vpc_id}", lambda: ec2.describe_subnets(Filters=filters)
    )["Subnets"]
    if not found:
        raise ConfigError("aws.subnet_ids", f"VPC {vpc_id} has no subnets: set aws.subnet_ids")
    return vpc_id, sorted(str(s["SubnetId"]) for s in found)


def _repository_arn(image: str) -> str:
    """The ECR repository ARN of an ECR image (the execution role may pull only it)."""
    match = _ECR_IMAGE.match(image)
    if match is None:
        return "*"  # not ECR: no ECR permission is used, the statement is inert
    partition = "aws-cn" if match["cn"] else "aws"
    return f"arn:{partition}:ecr:{match['region']}:{match['account']}:repository/{match['repo']}"


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
    cfn = dep.client("cloudformation")
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
    cfn = dep.client("cloudformation")
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
    client = dep.client("secretsmanager")
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
