// A push receiver under the conformance contract (see the RECEIVER CONTRACT in
// conformance/triage_conformance/__init__.py), on Node's own `http` module and nothing
// else: what a service in any language has to do to recover every byte of a record from
// Triage's CloudEvents and to answer for it.
//
//   TRIAGE_PUSH_PORT=8080 TRIAGE_PUSH_MODE=binary node conformance/receivers/receiver.js
//
// Listens on 127.0.0.1:$TRIAGE_PUSH_PORT, answers POST / in $TRIAGE_PUSH_MODE (`binary`:
// one CloudEvent per request, the body is the value; `batch`: a JSON array answered with
// `batchItemFailures`), and prints one JSON line per record received.
"use strict";

const http = require("node:http");

const ACTION_HEADER = "x-triage-action";
const port = Number(process.env.TRIAGE_PUSH_PORT);
const mode = process.env.TRIAGE_PUSH_MODE || "binary";
if (!Number.isInteger(port) || port < 1 || port > 65535) {
  process.stderr.write(`TRIAGE_PUSH_PORT must be a port, got ${process.env.TRIAGE_PUSH_PORT}\n`);
  process.exit(2);
}
if (mode !== "binary" && mode !== "batch") {
  process.stderr.write(`TRIAGE_PUSH_MODE must be binary or batch, got ${mode}\n`);
  process.exit(2);
}

// `retry` asks once per id, then acks: a receiver cannot know the attempt.
const seen = new Set();

function firstTime(id) {
  const fresh = !seen.has(id);
  seen.add(id);
  return fresh;
}

const b64 = (buffer) => (buffer === null ? null : buffer.toString("base64"));
const unb64 = (text) => Buffer.from(text, "base64");

// Key, value and headers, byte-exact, from an event's attributes (`triagekey`,
// `triageheaders`, `triagetombstone`) and its data as bytes (null: none sent).
function recover(attrs, data) {
  const key = attrs.triagekey === undefined ? null : unb64(attrs.triagekey);
  const rows = attrs.triageheaders === undefined
    ? []
    : JSON.parse(unb64(attrs.triageheaders).toString("utf8"));
  const headers = rows.map(([name, value]) => [name, value === null ? null : unb64(value)]);
  const value = attrs.triagetombstone === "true" ? null : (data || Buffer.alloc(0));
  return { key, value, headers };
}

// Prints the `received` line (before answering, so a kill after it is a redelivery the
// kit can see) and returns the record's action.
function receive(id, record) {
  const line = {
    event: "received",
    id,
    key: b64(record.key),
    value: b64(record.value),
    headers: record.headers.map(([name, value]) => [name, b64(value)]),
  };
  process.stdout.write(JSON.stringify(line) + "\n");
  const action = record.headers.find(([name, value]) => name === ACTION_HEADER && value !== null);
  return action ? action[1].toString("utf8") : "ack";
}

function pause(action) {
  if (!action.startsWith("sleep:")) return Promise.resolve();
  return new Promise((resolve) => setTimeout(resolve, Number(action.slice(6))));
}

// Binary mode: the CloudEvents attributes are `ce-` headers (percent-encoded, as the HTTP
// binding says), the body is the value.
async function binary(req, res, body) {
  const attrs = {};
  for (const [name, value] of Object.entries(req.headers)) {
    if (name.startsWith("ce-")) attrs[name.slice(3)] = decodeURIComponent(value);
  }
  const action = receive(attrs.id, recover(attrs, body));
  await pause(action);
  if (action === "fail") {
    res.writeHead(400, { "content-type": "application/octet-stream" });
    return res.end(body);
  }
  if (action === "retry" && firstTime(attrs.id)) {
    res.writeHead(200, { "triage-action": "retry" });
    return res.end();
  }
  res.writeHead(204);
  return res.end();
}

// Batch mode: a JSON array of structured events, the value in `data_base64`; the answer
// names the records that failed and how.
async function batch(req, res, body) {
  const failures = [];
  const pauses = [];
  for (const event of JSON.parse(body.toString("utf8"))) {
    const data = event.data_base64 === undefined ? null : unb64(event.data_base64);
    const record = recover(event, data);
    const action = receive(event.id, record);
    pauses.push(pause(action));
    if (action === "fail") {
      const reason = (record.value || Buffer.alloc(0)).toString("utf8");
      failures.push({ itemIdentifier: event.id, action: "deadletter", reason });
    } else if (action === "retry" && firstTime(event.id)) {
      failures.push({ itemIdentifier: event.id, action: "retry" });
    }
  }
  await Promise.all(pauses); // the records of a batch are handled side by side
  const answer = JSON.stringify({ batchItemFailures: failures });
  res.writeHead(200, { "content-type": "application/json" });
  return res.end(answer);
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (chunk) => chunks.push(chunk));
  req.on("end", () => {
    if (req.method !== "POST" || req.url !== "/") {
      res.writeHead(404);
      return res.end();
    }
    const handle = mode === "batch" ? batch : binary;
    handle(req, res, Buffer.concat(chunks)).catch((err) => {
      process.stderr.write(`cannot handle a request: ${err.stack}\n`);
      res.writeHead(500, { "content-type": "text/plain" });
      res.end(String(err));
    });
  });
});
server.listen(port, "127.0.0.1");
process.on("SIGTERM", () => process.exit(0));
