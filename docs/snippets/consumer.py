import os
import signal

from triage_client import Consumer, Message


async def handle(message: Message) -> None:  # returning acks; raising nacks: a dead letter
    if message.value == b"poison":
        raise ValueError("cannot handle this one")
    print(f"partition {message.partition} offset {message.offset}: {message.value!r}", flush=True)


consumer = Consumer(os.environ["TRIAGE_ENDPOINT"], os.environ["TRIAGE_TOKEN"], handle)
signal.signal(signal.SIGINT, lambda *_: consumer.stop())  # Ctrl-C or SIGTERM: finish the
signal.signal(signal.SIGTERM, lambda *_: consumer.stop())  # running handlers, then return
consumer.run()
