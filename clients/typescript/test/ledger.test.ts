/** The ledger of deliveries in hand (src/ledger.ts): pure state, driven call by call. */

import assert from "node:assert/strict";
import { test } from "node:test";

import { type Account, Ledger } from "../src/ledger.js";
import type { Message } from "../src/message.js";
import type { Nack } from "../src/proto.js";
import type { PartitionStream } from "../src/stream.js";

function messages(...offsets: number[]): Message[] {
  return offsets.map((offset) => ({
    topic: "t",
    partition: 0,
    offset,
    key: null,
    value: null,
    headers: [],
    timestampMs: 0,
    attempt: 1,
  }));
}

function opened(ledger: Ledger, name: string): Account {
  return ledger.open(name as unknown as PartitionStream);
}

/** Pick the next delivery, which must be `account`'s, and finish it. */
function run(ledger: Ledger, account: Account, nack: Nack | null = null): number {
  assert.equal(ledger.pick(), account);
  const offset = ledger.take(account).offset;
  ledger.finished(account, account.epoch, account.leases, offset, nack);
  return offset;
}

test("ledger: queued deliveries are outstanding and leased", () => {
  const ledger = new Ledger();
  const a = opened(ledger, "a");
  ledger.queue(a, messages(3, 4, 5));
  assert.deepEqual([ledger.outstanding, a.outstanding, a.queued], [3, 3, 3]);
  assert.deepEqual([...a.leases], [3, 4, 5]);
  assert.equal(ledger.ready, true);
});

test("ledger: an empty batch leaves the stream not ready", () => {
  const ledger = new Ledger();
  ledger.queue(opened(ledger, "a"), []);
  assert.equal(ledger.ready, false);
});

test("ledger: a finished delivery leaves its slot and lease and waits to be sent", () => {
  const ledger = new Ledger();
  const a = opened(ledger, "a");
  ledger.queue(a, messages(0, 1));
  assert.equal(ledger.pick(), a);
  assert.equal(ledger.take(a).offset, 0);
  assert.deepEqual([a.busy, a.queued, [...a.leases]], [1, 1, [0, 1]]);
  assert.equal(ledger.finished(a, a.epoch, a.leases, 0, null), false, "offset 1 is queued");
  assert.deepEqual([a.busy, a.outstanding, ledger.outstanding, [...a.leases]], [0, 1, 1, [1]]);
  assert.deepEqual(a.acks, [0]);
  const nack: Nack = { offset: 1, reason: "Error: x", retry: false };
  assert.equal(ledger.take(a).offset, 1);
  assert.equal(ledger.ready, false, "its queue is empty");
  assert.equal(ledger.finished(a, a.epoch, a.leases, 1, nack), true, "nothing queued behind it");
  assert.deepEqual(ledger.takeSettlements(a), [[0], [nack]]);
  assert.deepEqual([a.acks, a.nacks, ledger.outstanding], [[], [], 0]);
});

test("ledger: the stream with the fewest running goes first and ties go round-robin", () => {
  const ledger = new Ledger();
  const a = opened(ledger, "a");
  const b = opened(ledger, "b");
  ledger.queue(a, messages(0, 1, 2, 3));
  ledger.queue(b, messages(10, 11, 12, 13));
  const order: unknown[] = [];
  for (let i = 0; i < 4; i++) {
    const account = ledger.pick();
    ledger.take(account);
    order.push(account.stream);
  }
  assert.deepEqual(order, ["a", "b", "a", "b"]);
  ledger.finished(b, b.epoch, b.leases, 10, null);
  assert.equal(ledger.pick(), b, "b runs fewer now");
});

test("ledger: a long queue is taken in order across its compaction", () => {
  const ledger = new Ledger();
  const a = opened(ledger, "a");
  const offsets = Array.from({ length: 3000 }, (_, i) => i);
  ledger.queue(a, messages(...offsets));
  const taken: number[] = [];
  while (ledger.ready) {
    taken.push(ledger.take(ledger.pick()).offset);
  }
  assert.deepEqual(taken, offsets);
  assert.deepEqual([a.queued, a.busy], [0, 3000]);
});

test("ledger: a result from an ended connection is dropped", () => {
  const ledger = new Ledger();
  const a = opened(ledger, "a");
  ledger.queue(a, messages(0, 1, 2));
  ledger.take(ledger.pick());
  const epoch = a.epoch;
  const leases = a.leases;
  assert.deepEqual(
    ledger.takeBack(a, true).map((m) => m.offset),
    [1, 2],
  );
  assert.deepEqual([a.epoch, a.outstanding, ledger.outstanding, a.queued], [epoch + 1, 0, 1, 0]);
  assert.equal(a.leases.size, 0, "the next connection starts with a fresh lease set");
  assert.equal(ledger.ready, false);
  ledger.queue(a, messages(0)); // the proxy redelivers offset 0 on the next connection
  ledger.finished(a, epoch, leases, 0, null);
  assert.deepEqual([...a.leases], [0], "the late handler left the next connection's lease alone");
  assert.deepEqual([a.acks, a.dropped, a.outstanding, ledger.outstanding], [[], 1, 1, 1]);
});

test("ledger: taking back at stop keeps the running ones", () => {
  const ledger = new Ledger();
  const a = opened(ledger, "a");
  ledger.queue(a, messages(0, 1, 2));
  ledger.take(ledger.pick());
  const taken = ledger.takeBack(a);
  assert.deepEqual(
    taken.map((m) => m.offset),
    [1, 2],
  );
  assert.deepEqual([a.outstanding, ledger.outstanding, [...a.leases], a.epoch], [1, 1, [0], 0]);
  ledger.release(a, taken);
  assert.deepEqual(ledger.takeReleases(a), [1, 2]);
  assert.deepEqual(a.releases, []);
});

test("ledger: unsent results are forgotten when the connection ends", () => {
  const ledger = new Ledger();
  const a = opened(ledger, "a");
  ledger.queue(a, messages(0, 1));
  run(ledger, a);
  run(ledger, a, { offset: 1, reason: "Error: x", retry: false });
  ledger.release(a, messages(5));
  assert.equal(ledger.forget(a), 2);
  assert.deepEqual([a.acks, a.nacks, a.releases], [[], [], []]);
});
