"""The skeleton of a consumer instance run as its own process, shared by the benchmarks
(tests/perf/instance.py) and the fault suite (tests/fault/instance.py).

Why shared: both are started the same way (a target, a concurrency, an id, the token in
TRIAGE_TOKEN) and stop the same way (SIGTERM: a graceful `Consumer.stop()`); only the
handler and what they report differ.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

from triage_client import Consumer, Handler


def instance_arguments(default_id: str) -> argparse.ArgumentParser:
    """--target, --concurrency and --id; a script adds its own options."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--id", default=default_id)
    return parser


def run_consumer(args: argparse.Namespace, handle: Handler, **options: Any) -> None:
    """Consume from `args.target` with `handle` until SIGTERM stops the consumer gracefully."""
    consumer = Consumer(
        args.target,
        os.environ["TRIAGE_TOKEN"],
        handle,
        concurrency=args.concurrency,
        consumer_id=args.id,
        **options,
    )
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    consumer.run()
