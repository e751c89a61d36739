#!/usr/bin/env node
// @ts-check
/**
 * A consumer instance for the repo's benchmarks (tests/perf/bench_clients.py), the twin of
 * tests/perf/instance.py: same options (--target, --concurrency, --id; the token in
 * TRIAGE_TOKEN), same handler (the value says what it does: `poison...` throws, `slow...`
 * sleeps 500 ms, `ordinary...` 2 ms, `sleep:<ms>` that long, anything else returns at once),
 * and on SIGTERM the same one JSON line: handled, acked, nacked, first and last finish times
 * (seconds since the epoch), every finish as [time, was-ordinary], and per partition the
 * messages handled and the last finish time.
 */
"use strict";

const { Consumer } = require("@triage/client");

/** @param {string} name @param {string} fallback */
function option(name, fallback) {
  const index = process.argv.indexOf(`--${name}`);
  return index >= 0 && index + 1 < process.argv.length ? process.argv[index + 1] : fallback;
}

/** @param {number} ms */
function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

const ORDINARY = Buffer.from("ordinary");
const SLOW = Buffer.from("slow");
const POISON = Buffer.from("poison");
const SLEEP = Buffer.from("sleep:");

const stats = { handled: 0, acked: 0, nacked: 0, first: 0, last: 0 };
/** @type {[number, boolean][]} */
const finishes = [];
/** @type {Record<number, [number, number]>} */
const partitions = {};
/** @type {number[]} */
const finishPartitions = [];

/** @param {Buffer} value */
async function work(value) {
  if (value.subarray(0, POISON.length).equals(POISON)) {
    throw new Error("poison pill");
  }
  if (value.subarray(0, SLOW.length).equals(SLOW)) {
    await sleep(500);
  } else if (value.subarray(0, ORDINARY.length).equals(ORDINARY)) {
    await sleep(2);
  } else if (value.subarray(0, SLEEP.length).equals(SLEEP)) {
    await sleep(Number(value.subarray(SLEEP.length).toString().split(":")[0]));
  }
}

/** @param {import("@triage/client").Message} message */
async function handle(message) {
  const value = message.value ?? Buffer.alloc(0);
  try {
    await work(value);
    stats.acked += 1;
  } catch (error) {
    stats.nacked += 1;
    throw error;
  } finally {
    const now = Date.now() / 1000;
    stats.handled += 1;
    stats.first = stats.first || now;
    stats.last = now;
    finishes.push([now, value.subarray(0, ORDINARY.length).equals(ORDINARY)]);
    finishPartitions.push(message.partition);
    const seen = (partitions[message.partition] ??= [0, 0]);
    seen[0] += 1;
    seen[1] = now;
  }
}

async function main() {
  const consumer = new Consumer({
    endpoint: option("target", ""),
    token: process.env.TRIAGE_TOKEN ?? "",
    concurrency: Number(option("concurrency", "16")),
    consumerId: option("id", "bench"),
    handler: handle,
  });
  process.once("SIGTERM", () => void consumer.stop());
  process.once("SIGINT", () => void consumer.stop());
  await consumer.run();
  process.stdout.write(
    `${JSON.stringify({ ...stats, finishes, partitions, finish_partitions: finishPartitions })}\n`,
  );
}

main().catch((error) => {
  console.error(`bench instance: ${error.message}`);
  process.exit(1);
});
