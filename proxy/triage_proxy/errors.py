"""The one error tree of the proxy, grouped by what the caller does next.

    TriageError                      root; `retriable` says whether trying again can help
    +-- ConfigError                  fix the config file or flag it names (not retriable;
    |                                ExportExists in triage_replay/job.py)
    +-- AuthError                    wrong, missing or revoked token: refuse the call
    +-- FrameError                   a consumer broke the stream protocol (no Hello, bad
    |                                credits): refuse its stream
    +-- PartitionNotServed           a Hello named a partition this proxy does not serve:
    |                                the consumer goes to its owner (named when known)
    +-- DeadLetterTooLarge           a dead letter over DynamoDB's item limit (until S3 overflow)
    +-- UnavailableError             a dependency is down: keep retrying, never lose data
    |   +-- ShuttingDown             this proxy is stopping: connect again (to its successor)
    |   +-- BrokerUnavailable        Kafka did not answer (fetch or commit)
    |   +-- DeadLetterUnavailable    the dead-letter table did not take a write
    |   +-- TableUnavailable         the table did not answer a lease or checkpoint call
    |   +-- OwnershipLost            the partition lease lapsed or was taken: stop delivering,
    |   |                            exit, restart as a standby (ownership.py)
    |   +-- (elsewhere)              NotifyUnavailable (deadletters/notifier.py), PortTaken
    |                                (triage_cli/embedded.py), ReplayFailed (triage_replay/job.py)
    +-- NotFoundError                the table or item asked for does not exist (store/query.py
    |                                has the specific ones: TableNotFound, DeadLetterNotFound)
    +-- BadInput                     an argument a tool was handed is malformed (store/pages.py:
    |                                InvalidCursor): fix it, asking again cannot help
    +-- CheckpointError              commit metadata or a checkpoint that cannot be trusted:
    |                                ignore it and redeliver (pipeline/settled.py)
    +-- StateError                   a lifecycle method called in the wrong state (a bug)
    +-- DeployError                  `triage deploy/destroy` could not finish: the cloud
                                     refused a call or a stack failed; read why, fix, rerun

confluent-kafka and botocore exceptions are translated into these at the adapter edge
with `raise ... from`: `kafka/errors.py`'s `kafka_errors` for librdkafka, `store/aws.py`'s
`aws_errors` for botocore. `server/status.py` maps them to the gRPC status a client sees
(the service ends calls through it). This module imports neither grpc nor a client
library: the CLI and the Spark executors share it.
"""

from __future__ import annotations

from collections.abc import Sequence


class TriageError(Exception):
    """Root of every error Triage raises on purpose."""

    retriable: bool = False


class ConfigError(TriageError):
    """A config value is missing, malformed or of the wrong type; `key` names it."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config key {key!r}: {problem}")
        self.key = key
        self.problem = problem

    @classmethod
    def unknown(cls, key: str, what: str, known: Sequence[str]) -> ConfigError:
        """`key` (its last dotted part) is no known `what` ("key", "section"): the
        problem lists the known ones, and names the closest first when it looks like a
        typo of one (`group_idd`: did you mean 'group_id'?)."""
        import difflib

        name = key.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return cls(key, f"unknown {what} ({hint}known: {', '.join(known)})")


class AuthError(TriageError):
    """The call carried no token, a wrong one, or one revoked since."""


class FrameError(TriageError):
    """A consumer's frames break the stream protocol; sending them again cannot help."""


class PartitionNotServed(TriageError):
    """A stream asked for a partition this proxy does not serve; asking this proxy again
    cannot help, its owner (`owner_endpoint`, when known) or the Topology RPC can."""

    def __init__(self, message: str, partition: int, owner_endpoint: str = "") -> None:
        super().__init__(message)
        self.partition = partition
        self.owner_endpoint = owner_endpoint
        """host:port serving the partition now; "" when not known."""


class DeadLetterTooLarge(TriageError):
    """A record does not fit in one DynamoDB item; writing it again cannot help."""

    def __init__(self, key: tuple[str, int, int], size: int, limit: int) -> None:
        topic, partition, offset = key
        super().__init__(
            f"dead letter {topic}[{partition}]@{offset} needs {size} bytes, "
            f"over DynamoDB's item limit of {limit}"
        )
        self.key = key
        self.size = size


class UnavailableError(TriageError):
    """A dependency did not answer; the operation can be retried as is."""

    retriable = True


class ShuttingDown(UnavailableError):
    """This proxy is stopping and takes no new streams."""


class BrokerUnavailable(UnavailableError):
    """Kafka did not answer a fetch or a commit."""


class DeadLetterUnavailable(UnavailableError):
    """The dead-letter store did not durably take a write."""


class TableUnavailable(UnavailableError):
    """The table did not answer a lease or checkpoint call (store/leases.py, checkpoints.py)."""


class OwnershipLost(UnavailableError):
    """This proxy no longer holds the partition's lease; it must not deliver or commit."""


class NotFoundError(TriageError):
    """What was asked for does not exist; asking again will not help."""


class BadInput(TriageError):
    """An argument a tool was handed (not a config key) is malformed; the message says
    what is wrong and what to do."""


class StateError(TriageError):
    """A lifecycle method was called in a state that does not allow it."""


class DeployError(TriageError):
    """A deployment step failed (an AWS call refused, a stack rolled back); rerunning the
    command after fixing the cause continues where it stopped."""
