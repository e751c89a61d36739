"""A runnable Triage consumer: prints what it handles and fails values starting with b"poison".

    TRIAGE_TOKEN=... python client_lib/examples/consumer.py --endpoint HOST:PORT

(or with `triage dev`'s `export` line run first, no option at all: the endpoint and the
token come from TRIAGE_ENDPOINT and TRIAGE_TOKEN)

Returning from the handler acks the message; raising nacks it, and the proxy writes it to the
dead-letter table instead of blocking the partition. Values starting with b"busy" raise
TimeoutError, which `retry_on` makes a retryable nack: the proxy redelivers them after a
backoff. Ctrl-C or SIGTERM stops gracefully: running handlers finish and their settlements
are sent before the process exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from triage_client import AuthenticationError, Consumer, Message, StreamError


class PoisonPill(Exception):
    """This example's stand-in for a message the application cannot process."""


async def handle(message: Message) -> None:
    value = message.value or b""
    print(
        f"{message.topic}[{message.partition}]@{message.offset} attempt {message.attempt}: "
        f"{len(value)} bytes, starts {value[:20]!r}",
        flush=True,
    )
    if value.startswith(b"poison"):
        raise PoisonPill(f"cannot process offset {message.offset}")
    if value.startswith(b"busy"):
        raise TimeoutError(f"downstream busy for offset {message.offset}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    endpoint = os.environ.get("TRIAGE_ENDPOINT")
    parser.add_argument(
        "--endpoint",
        "--target",  # the name older scripts pass
        default=endpoint,
        required=endpoint is None,
        help="the consumer endpoint, any proxy of the deployment: HOST:PORT "
        "(default: $TRIAGE_ENDPOINT)",
    )
    parser.add_argument(
        "--token-env",
        default="TRIAGE_TOKEN",
        help="environment variable holding the proxy's bearer token (kept out of `ps`)",
    )
    parser.add_argument("--concurrency", type=int, default=16, help="handlers at once")
    args = parser.parse_args(argv)
    token = os.environ.get(args.token_env)
    if not token:
        print(f"error: set {args.token_env} to the proxy's token", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    consumer = Consumer(
        args.endpoint,
        token,
        handle,
        concurrency=args.concurrency,
        retry_on=(TimeoutError,),
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: consumer.stop())
    try:
        consumer.run()
    except AuthenticationError as exc:
        print(f"error: {exc} (check ${args.token_env})", file=sys.stderr)
        return 2
    except StreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    stats = consumer.stats
    print(
        f"stopped: {stats.acked} acked, {stats.nacked} nacked, {stats.dropped} released, "
        f"{stats.extended} lease extensions"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
