"""A consumer of the original Triage, as its Go programs behave, for tests that kill it:
serves triage.MessageHandler on 127.0.0.1:PORT, registers with `GET /consumers` (the raw
token in Authorization, the port in grpcport), prints one JSON line once registered, and
acks every message after `delay_ms`; a message whose body is `crash_on` makes the process
exit at once (exit code 3), like a crash-type poison pill.

    python -m tests.integration.grpc_consumer '{"port": P, "register": URL, "token": T}'
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import urllib.request
from typing import Any

import grpc

from triage_protocol import handler_pb2, handler_pb2_grpc


class Handler(handler_pb2_grpc.MessageHandlerServicer):
    def __init__(self, delay_s: float, crash_on: str | None) -> None:
        self.delay_s = delay_s
        self.crash_on = crash_on

    async def SendMessage(self, request: Any, context: Any) -> Any:
        if request.body == self.crash_on:
            os._exit(3)
        await asyncio.sleep(self.delay_s)
        return handler_pb2.MessageResponse(body="ok", status=1)


def register(url: str, token: str, port: int) -> int:
    request = urllib.request.Request(url, headers={"Authorization": token, "grpcport": str(port)})
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(response.status)


async def main(options: dict[str, Any]) -> None:
    server = grpc.aio.server()
    handler = Handler(options.get("delay_ms", 0) / 1000, options.get("crash_on"))
    handler_pb2_grpc.add_MessageHandlerServicer_to_server(handler, server)
    port = server.add_insecure_port(f"127.0.0.1:{options['port']}")
    await server.start()
    status = await asyncio.to_thread(register, options["register"], options["token"], port)
    print(json.dumps({"port": port, "registered": status}), flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
