"""The conformance kit: any Triage client, driven through the same scenarios.

    python -m triage_conformance --client "<command>" [--peer "<command>"]
        [--scenario NAME ...] [--partitions N] [--work-dir DIR] [--list]

It starts the embedded stack (Tansu, moto server, one proxy per partition: `triage dev`'s
DevStack with short deadlines), produces each scenario's messages and runs the client
command as child processes, then judges from what the proxy committed, the dead-letter
table and the client's JSON lines. Exit 0 when every scenario passed, 1 otherwise.

The contract between the kit and a client under test:

- Environment: TRIAGE_ENDPOINT (host:port of any proxy; use Topology discovery),
  TRIAGE_TOKEN, TRIAGE_CONSUMER_ID (send it in Hello), TRIAGE_CONCURRENCY (handler slots).
- Each message's header `x-triage-action` says what the handler does (absent: `ack`):
  `ack` return; `fail` throw an error whose message is the value as UTF-8 with
  replacement (nack reason `Name: message`); `retry` throw the client's Retry while
  attempt < 3, then ack; `sleep:<ms>` wait that long (async; the client extends the
  lease), then ack; `hang` never settle.
- stdout, one JSON line per handler start, flushed at once, before the action:
  {"event":"start","partition":P,"offset":O,"attempt":A,"key":<base64|null>,
   "value":<base64|null>,"headers":[[name,<base64|null>],...]}
  and one when it settled: {"event":"settled","partition":P,"offset":O,
  "outcome":"ack"|"nack"|"retry"}. stderr is free-form.
- SIGTERM: the library's stop() (release unstarted, finish and settle running), exit 0.
- A refused token: exit non-zero, with a message on stderr mentioning authentication.
- The command is run without a shell (split like a shell would, so `env VAR=x node a.js`
  works but `cd x && node a.js` does not): the process it starts must be the client
  itself, so a SIGKILL reaches the process that holds the stream (an `npm run` wrapper
  would leave the real client running).
- `--peer CMD` (optional) runs a different client as the second instance of
  `side-by-side`, e.g. TypeScript beside Python. `TRIAGE_CONFORMANCE_DEBUG=1` prints
  each client's stderr tail after its scenario; every client's stderr is kept under
  `--work-dir`.

The Python client's adapter is `python -m triage_conformance.python_client`.
"""
