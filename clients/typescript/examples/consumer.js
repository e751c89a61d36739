#!/usr/bin/env node
// @ts-check
/**
 * An example consumer: orders arrive as JSON; a message that is not JSON is dead-lettered
 * (the handler throws), a downstream that is busy asks for redelivery (Retry), and SIGTERM
 * or Ctrl-C drains before exit. The token comes from the environment, so `ps` never shows it.
 *
 *     npm run build
 *     TRIAGE_TOKEN=... node examples/consumer.js --endpoint HOST:PORT [--concurrency 32]
 *
 * (or with `triage dev`'s `export` line run first, no --endpoint: TRIAGE_ENDPOINT is read)
 */
"use strict";

const { Consumer, Retry } = require("@triage/client");

/** @param {string} name @param {string} fallback */
function option(name, fallback) {
  const index = process.argv.indexOf(`--${name}`);
  return index >= 0 && index + 1 < process.argv.length ? process.argv[index + 1] : fallback;
}

let handled = 0;

/** @param {import("@triage/client").Message} message */
async function handle(message) {
  const order = JSON.parse(message.value?.toString("utf8") ?? "null"); // throws: dead-lettered
  if (order?.downstream === "busy" && message.attempt < 3) {
    throw new Retry("downstream busy"); // redelivered after the proxy's backoff
  }
  handled += 1; // ... charge(order) ...
}

async function main() {
  const consumer = new Consumer({
    endpoint: option("endpoint", process.env.TRIAGE_ENDPOINT ?? "127.0.0.1:7700"),
    token: process.env.TRIAGE_TOKEN ?? "",
    concurrency: Number(option("concurrency", "32")),
    consumerId: option("id", ""),
    handler: handle,
  });
  const stop = () => void consumer.stop();
  process.once("SIGTERM", stop);
  process.once("SIGINT", stop);
  await consumer.run(); // resolves once stop() drained every stream
  const { delivered, acked, nacked, partitions } = consumer.stats;
  console.log(JSON.stringify({ handled, delivered, acked, nacked, partitions: Object.keys(partitions) }));
}

main().catch((error) => {
  console.error(`example consumer: ${error.message}`);
  process.exit(1);
});
