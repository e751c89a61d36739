"""The conformance kit: any Triage client, or any push receiver, driven through the same
scenarios.

    python -m triage_conformance --client "<command>" [--peer "<command>"]
        [--scenario NAME ...] [--partitions N] [--work-dir DIR] [--list]
    python -m triage_conformance --push-receiver "<command>" [--batch N]
        [--scenario NAME ...] [--partitions N] [--work-dir DIR]

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

With `--push-receiver`, no client runs: the kit picks a free loopback port, starts the
stack with one `[[push]]` target posting there (`batch = N`; 1, the default, is
CloudEvents binary mode), starts the receiver command for each `push-*` scenario,
produces its records and judges from the commit, the dead-letter table and the
receiver's JSON lines. The receiver contract:

- Environment: TRIAGE_PUSH_PORT (listen on 127.0.0.1 there, answer POST /) and
  TRIAGE_PUSH_MODE (`binary`: one CloudEvent per request, the body is the value;
  `batch`: an `application/cloudevents-batch+json` array). Recover the key, value and
  headers byte-exact as `triage_proxy.push.cloudevents` documents (`triagekey`,
  `triageheaders`, `triagetombstone`, the body or `data_base64`).
- Each record's header `x-triage-action` (in `triageheaders`) says what to answer
  (absent: `ack`):
    action       binary mode                          batch mode (`batchItemFailures`)
    ack          2xx                                  not named
    fail         400, the body = the value's bytes    {"itemIdentifier": id, "action":
                 (dead letter: `HTTP 400: <value>`)   "deadletter", "reason": <value as
                                                      UTF-8 with replacement>}
    retry        the first time this id is seen:      the first time: {"itemIdentifier":
                 200 with `triage-action: retry`;     id, "action": "retry"}; then not
                 then 2xx                             named
    sleep:<ms>   wait that long, then 2xx             wait (the records of a batch side
                                                      by side), then not named
  `retry` is once per id because a receiver is not told the attempt; a batch's answer
  is a 2xx with {"batchItemFailures": [...]} (an empty list acks the whole batch).
- stdout, one JSON line per record received, flushed at once, before answering:
  {"event":"received","id":<ce id>,"key":<base64|null>,"value":<base64|null>,
   "headers":[[name,<base64|null>],...]}. stderr is free-form.
- SIGTERM: exit. The kit also kills the receiver -9 (`push-restart`) and starts the
  command again on the same port, so the command must be the receiver itself (no
  wrapper that would outlive the kill) and must be able to rebind that port at once.

The reference receivers, each passing every push scenario in both modes:
`python -m triage_conformance.python_receiver` (aiohttp and the `cloudevents` SDK) and
`node conformance/receivers/receiver.js` (Node's `http` module, no dependency).
"""

ACTION_HEADER = "x-triage-action"
"""The header whose value says what a client's handler or a push receiver does."""
