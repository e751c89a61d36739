"""A push receiver that a crash-type poison pill takes down, for tests that restart it:
serves POST on 127.0.0.1:PORT (one record per request, several at once), prints one JSON
line once it listens, answers 204 after `work_ms`, and exits at once (exit code 3) when a
record's value is `crash_on`, with whatever other requests it holds in flight.

    python -m tests.integration.crash_receiver '{"port": P, "work_ms": 50, "crash_on": "crash"}'
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def main(options: dict[str, Any]) -> None:
    work_s = options.get("work_ms", 0) / 1000
    crash_on = str(options.get("crash_on", "crash")).encode()

    class Receiver(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            value = self.rfile.read(int(self.headers.get("content-length", 0)))
            if value == crash_on:
                os._exit(3)
            time.sleep(work_s)
            self.send_response(204)
            self.send_header("content-length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", options["port"]), Receiver)
    server.daemon_threads = True
    print(json.dumps({"port": server.server_address[1]}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
