"""The AWS edge: botocore clients built one way, and the one place botocore's errors are caught.

Why: every part of Triage that talks to AWS (the stores, the tools, provisioning, the
notifier, `triage deploy`, the config's "secret:NAME" references) needs the same endpoint,
region, timeout and local-credentials logic, and none of them should know botocore's
exception types. `aws_errors` is the only code that catches them (as httpx's
`map_httpcore_exceptions` does for httpcore): it re-raises each as the Triage error its
caller names (what the caller does next), or, for the AWS error codes the caller expects
as an answer (a failed condition, a missing object), hands the code back in an
`AwsAnswer` instead of raising.

    with aws_errors(f"PutItem on {table!r}", DeadLetterUnavailable,
                    expect={CONDITION_FAILED}) as answer:
        client.put_item(...)
    if answer.code == CONDITION_FAILED:
        ...  # the condition said no: an answer, not a failure

Messages name the call and the AWS error code and message, never request content
(payloads stay out of logs).
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from triage_proxy.config.sections import DeadLetterSettings
from triage_proxy.errors import ConfigError

if TYPE_CHECKING:
    from mypy_boto3_dynamodb.client import DynamoDBClient
    from mypy_boto3_s3.client import S3Client

DEFAULT_CONNECT_TIMEOUT_S = 2.0
DEFAULT_READ_TIMEOUT_S = 5.0
DEFAULT_BOTO_ATTEMPTS = 2
"""botocore's own attempts per call (the dead-letter writer retries forever above it)."""
LOCAL_CREDENTIALS = ("triage-local", "triage-local")
"""Placeholder key pair for a loopback endpoint (moto accepts any credentials)."""
CONDITION_FAILED = "ConditionalCheckFailedException"
"""DynamoDB's answer when a conditional write's condition does not hold."""
TABLE_MISSING = "ResourceNotFoundException"
"""DynamoDB's answer when the table does not exist."""
TRANSACTION_CANCELLED = "TransactionCanceledException"
"""DynamoDB's answer when a TransactWriteItems call did nothing (`AwsAnswer.reasons` says
why, action by action)."""
CHECK_FAILED = "ConditionalCheckFailed"
"""A cancellation reason: that action's condition did not hold."""


# --- errors -----------------------------------------------------------------------------


@dataclass
class AwsAnswer:
    """What an expected AWS error code said; empty while the call succeeded."""

    code: str = ""
    """The AWS error code the caller expected (e.g. CONDITION_FAILED); "" on success."""
    message: str = ""
    """AWS's message with that code."""
    error: BaseException | None = None
    """The original exception, for `raise ... from answer.error`."""
    reasons: tuple[str, ...] = ()
    """For TRANSACTION_CANCELLED: each action's code, in order ("None": it was fine,
    CHECK_FAILED: its condition did not hold)."""

    def __bool__(self) -> bool:
        return bool(self.code)

    def describe(self) -> str:
        """The code and message as "<code>: <message>", for the caller's own message."""
        return f"{self.code}: {self.message}"


class _AnyCode:
    def __contains__(self, code: object) -> bool:
        return bool(code)


ANY_CODE: Container[str] = _AnyCode()
"""`expect=ANY_CODE`: every error AWS answered with is an answer (only transport errors,
e.g. timeouts, raise)."""


@contextmanager
def aws_errors(
    what: str,
    error: Callable[[str], Exception],
    *,
    expect: Container[str] = (),
) -> Iterator[AwsAnswer]:
    """Run the block; turn a botocore error into `error("<what> failed: <why>")`, raised
    from it, unless AWS answered with a code in `expect`: then the block ends quietly and
    the yielded AwsAnswer holds the code. The only place botocore's exceptions are caught.
    """
    from botocore.exceptions import BotoCoreError, ClientError

    answer = AwsAnswer()
    try:
        yield answer
    except ClientError as exc:
        code, message = _code(exc), _message(exc)
        if code and code in expect:
            answer.code, answer.message, answer.error = code, message, exc
            answer.reasons = _reasons(exc)
            return
        raise error(f"{what} failed: {code or type(exc).__name__}: {message}") from exc
    except BotoCoreError as exc:  # no response: a timeout, a refused connection
        raise error(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def _reasons(exc: BaseException) -> tuple[str, ...]:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ()
    return tuple(str(r.get("Code", "")) for r in response.get("CancellationReasons", []))


def _message(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Message", "") or exc)
    return str(exc)


# --- clients ----------------------------------------------------------------------------

_session_lock = threading.Lock()
_session: Any = None


def _client(service: str, options: dict[str, Any]) -> Any:
    """A new client of `service` from the process's one botocore Session.

    Why one Session: each Session loads and keeps its own copy of botocore's service
    models, about 10 MB resident per DynamoDB client; a fleet process made two clients
    per partition (lease, checkpoint), so 16 idle partitions cost 3.3x the memory of one
    (tests/perf/bench_fleet_memory.py). Clients made from one Session share the loaded
    models (about 0.2 MB each); each client is still its caller's to close. A Session is
    not thread-safe, so clients are made under a lock (the clients themselves are).

    Why botocore's Session and not boto3's: a boto3 client is botocore's
    `Session.create_client` plus resources and S3's transfer methods, which Triage does
    not use, and `import boto3` also imports s3transfer: 0.65 s of CPU against 0.45 s for
    `botocore.session` (2 cores, 2026-11-28), paid by every proxy and CLI process that
    talks to AWS."""
    global _session
    import botocore.session

    with _session_lock:
        if _session is None:
            _session = botocore.session.get_session()
        return _session.create_client(service, **options)


def dynamodb_client(
    settings: DeadLetterSettings,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    max_attempts: int = DEFAULT_BOTO_ATTEMPTS,
) -> DynamoDBClient:
    """A boto3 DynamoDB client with short timeouts; placeholder credentials on loopback."""
    options = _client_options(settings, connect_timeout_s, read_timeout_s, max_attempts)
    client: DynamoDBClient = _client("dynamodb", options)
    return client


def s3_client(
    settings: DeadLetterSettings,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    max_attempts: int = DEFAULT_BOTO_ATTEMPTS,
) -> S3Client:
    """A boto3 S3 client for the overflow bucket: same endpoint, region and credentials
    logic as dynamodb_client (path-style addressing when an endpoint_url is set, since a
    local endpoint has no per-bucket host names)."""
    options = _client_options(settings, connect_timeout_s, read_timeout_s, max_attempts)
    client: S3Client = _client("s3", options)
    return client


def aws_client(
    service: str,
    settings: DeadLetterSettings,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    max_attempts: int = DEFAULT_BOTO_ATTEMPTS,
) -> Any:
    """A boto3 client of any `service` (e.g. "sns") with the same endpoint, region,
    timeouts and loopback-credentials logic as dynamodb_client."""
    options = _client_options(settings, connect_timeout_s, read_timeout_s, max_attempts)
    return _client(service, options)


def read_secret(key: str, name: str) -> str:
    """The value of Secrets Manager secret `name`, which config key `key` references
    ("secret:NAME"); a failure is ConfigError naming `key`. The region and endpoint come
    from the standard chain (AWS_REGION, AWS_ENDPOINT_URL), not from `[dead_letters]`:
    the secret lives where the process runs. The loader's callers hand this to
    `load_settings(fetch_secret=...)`."""
    options = _options(
        None, None, DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S, DEFAULT_BOTO_ATTEMPTS
    )
    with aws_errors(f"reading secret {name!r}", lambda why: ConfigError(key, why)):
        client = _client("secretsmanager", options)
        try:
            found = client.get_secret_value(SecretId=name)
        finally:
            client.close()
    return str(found["SecretString"])


def _client_options(
    settings: DeadLetterSettings,
    connect_timeout_s: float,
    read_timeout_s: float,
    max_attempts: int,
) -> dict[str, Any]:
    """Keyword arguments of boto3's client() shared by every AWS client of Triage."""
    return _options(
        settings.region, settings.endpoint_url, connect_timeout_s, read_timeout_s, max_attempts
    )


def _options(
    region: str | None,
    endpoint_url: str | None,
    connect_timeout_s: float,
    read_timeout_s: float,
    max_attempts: int,
) -> dict[str, Any]:
    from botocore.config import Config

    config = Config(
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        retries={"mode": "standard", "total_max_attempts": max_attempts},
        s3={"addressing_style": "path"} if endpoint_url is not None else None,
    )
    access_key: str | None = None
    secret_key: str | None = None
    if endpoint_url is not None and _is_loopback(endpoint_url):
        access_key, secret_key = LOCAL_CREDENTIALS
    return {
        "region_name": region,
        "endpoint_url": endpoint_url,
        "config": config,
        "aws_access_key_id": access_key,
        "aws_secret_access_key": secret_key,
    }


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
