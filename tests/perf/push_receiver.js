// A push receiver for the benchmarks, on Node's own `http` module so that the receiver is
// not what limits a figure. Usage:
//
//   node tests/perf/push_receiver.js '{"mode": "noop"}'
//
// It prints {"port": N} on one line once it listens (127.0.0.1, a free port), then answers
// POSTs by mode:
//
//   noop      200 at once (a batch: an empty body acks it all)
//   demo      the head-of-line demo's work: a value starting "slow" takes slow_ms, one
//             starting "poison" answers 400, any other takes work_ms; at most `handlers`
//             at once, the rest wait their turn (a service with that many workers)
//   capacity  at most `capacity` requests at once, each delay_ms x the current factor
//             (x the records it carries with "per_record": true); beyond that, 503 at
//             once (a service that sheds load)
//
// Lines on stdin: "factor F" multiplies delay_ms from now on; "stats" prints
// {"requests": n, "records": n, "shed": n, "max_active": n}; "reset" zeroes the counters.
"use strict";

const http = require("node:http");
const readline = require("node:readline");

const options = Object.assign(
  {
    mode: "noop",
    handlers: 32,
    work_ms: 2,
    slow_ms: 500,
    capacity: 16,
    delay_ms: 20,
    per_record: false,
  },
  JSON.parse(process.argv[2] || "{}"),
);
let factor = 1;
let requests = 0;
let records = 0;
let shed = 0;
let active = 0;
let maxActive = 0;
const waiting = [];

function countRecords(req, body) {
  if ((req.headers["content-type"] || "").startsWith("application/cloudevents-batch+json")) {
    // A batch: one event per "specversion" (cheaper than parsing the whole body).
    let n = 0;
    let at = body.indexOf("specversion");
    while (at !== -1) {
      n += 1;
      at = body.indexOf("specversion", at + 11);
    }
    return n;
  }
  return 1;
}

function finish(res, status, text) {
  res.writeHead(status, { "content-type": "text/plain", "content-length": Buffer.byteLength(text) });
  res.end(text);
}

function acquire() {
  if (active < options.handlers) {
    active += 1;
    return Promise.resolve();
  }
  return new Promise((resolve) => waiting.push(resolve));
}

function release() {
  const next = waiting.shift();
  if (next) next();
  else active -= 1;
}

function handle(req, res, body) {
  const n = countRecords(req, body);
  requests += 1;
  records += n;
  if (options.mode === "noop") return finish(res, 200, "");
  if (options.mode === "capacity") {
    if (active >= options.capacity) {
      shed += 1;
      return finish(res, 503, "busy");
    }
    active += 1;
    maxActive = Math.max(maxActive, active);
    setTimeout(() => {
      active -= 1;
      finish(res, 200, "");
    }, options.delay_ms * factor * (options.per_record ? n : 1));
    return undefined;
  }
  // demo
  acquire().then(() => {
    maxActive = Math.max(maxActive, active);
    const text = body.toString("latin1");
    if (text.startsWith("poison")) {
      release();
      return finish(res, 400, "poison pill");
    }
    const ms = text.startsWith("slow") ? options.slow_ms : options.work_ms;
    setTimeout(() => {
      release();
      finish(res, 200, "");
    }, ms);
    return undefined;
  });
  return undefined;
}

const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => handle(req, res, Buffer.concat(chunks)));
});
server.keepAliveTimeout = 60000;
server.listen(options.port || 0, "127.0.0.1", () => {
  process.stdout.write(JSON.stringify({ port: server.address().port }) + "\n");
});

readline.createInterface({ input: process.stdin }).on("line", (line) => {
  const [command, arg] = line.trim().split(/\s+/);
  if (command === "factor") factor = Number(arg);
  if (command === "reset") requests = records = shed = maxActive = 0;
  if (command === "stats") {
    process.stdout.write(JSON.stringify({ requests, records, shed, max_active: maxActive }) + "\n");
  }
});
process.on("SIGTERM", () => process.exit(0));
process.stdin.on("end", () => process.exit(0));
