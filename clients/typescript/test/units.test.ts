/** Pure parts: backoff, credit split, nack reasons, constructor validation, the proto copy. */

import assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { test } from "node:test";

import { Consumer, MAX_REASON_CHARS, Retry } from "../src/index.js";
import { type Message, unpackMessages } from "../src/message.js";
import { nackReason } from "../src/pool.js";
import { CONSUME, PROTO_PATH, type PackedDeliveries, type ProxyFrame } from "../src/proto.js";
import { DEFAULT_MAX_BACKOFF_MS, INITIAL_BACKOFF_MS, backoffDelay } from "../src/stream.js";
import { settleFrame } from "../src/writer.js";
import { creditShare, layoutFromReply } from "../src/topology.js";

const PACKAGE = path.resolve(__dirname, "..", "..");
const handler = (): void => {};

test("backoff doubles from 50 ms, is capped, and jitters over the upper half", () => {
  assert.equal(backoffDelay(0, { rand: () => 1 }), INITIAL_BACKOFF_MS);
  assert.equal(backoffDelay(0, { rand: () => 0 }), INITIAL_BACKOFF_MS / 2);
  assert.equal(backoffDelay(3, { rand: () => 1 }), INITIAL_BACKOFF_MS * 8);
  assert.equal(backoffDelay(40, { rand: () => 1 }), DEFAULT_MAX_BACKOFF_MS);
  assert.equal(backoffDelay(40, { rand: () => 0 }), DEFAULT_MAX_BACKOFF_MS / 2);
  assert.equal(backoffDelay(2000, { cap: 700, rand: () => 1 }), 700);
  for (let failures = 0; failures < 12; failures++) {
    assert.ok(backoffDelay(failures + 1, { rand: () => 1 }) >= backoffDelay(failures, { rand: () => 1 }));
  }
});

test("credits are split evenly, remainder first, at least 1 each, summing to the budget", () => {
  for (const [budget, streams] of [
    [10, 3],
    [32, 4],
    [7, 7],
    [1000, 6],
  ] as const) {
    const shares = Array.from({ length: streams }, (_, i) => creditShare(budget, streams, i));
    assert.equal(shares.reduce((a, b) => a + b, 0), budget);
    assert.ok(Math.max(...shares) - Math.min(...shares) <= 1);
  }
  assert.deepEqual([0, 1, 2].map((i) => creditShare(10, 3, i)), [4, 3, 3]);
  assert.equal(creditShare(2, 5, 4), 1, "more streams than budget: still 1 each");
});

test("a Topology reply keeps only SERVING routes that name an endpoint", () => {
  const layout = layoutFromReply({
    topic: "t",
    partition_count: 3,
    complete: true,
    partitions: [
      { partition: 0, endpoint: "a:1", state: 1 },
      { partition: 1, endpoint: "", state: 2 },
      { partition: 2, state: 3 },
    ],
  });
  assert.equal(layout.partitionCount, 3);
  assert.deepEqual([...layout.endpoints], [[0, "a:1"]]);
});

test("a nack reason is `Name: message`, for subclasses and non-errors too", () => {
  class ValidationError extends Error {}
  assert.equal(nackReason(new Error("boom")), "Error: boom");
  assert.equal(nackReason(new TypeError("bad type")), "TypeError: bad type");
  assert.equal(nackReason(new ValidationError("no")), "ValidationError: no");
  assert.equal(nackReason(new Retry("later")), "Retry: later");
  assert.equal(nackReason("plain string"), "Error: plain string");
  const unprintable = {
    toString(): string {
      throw new Error("no");
    },
  };
  assert.equal(nackReason(unprintable), "Error: <unprintable>");
});

test("a nack reason is cut to 4,000 characters, whole code points, valid UTF-8", () => {
  const long = nackReason(new Error("x".repeat(10_000)));
  assert.equal(MAX_REASON_CHARS, 4000);
  assert.equal(long.length, 4000);
  assert.ok(long.endsWith("..."));
  const emoji = nackReason(new Error("\u{1F600}".repeat(5000)));
  assert.equal(Array.from(emoji).length, 4000);
  assert.ok(!/[\uD800-\uDBFF](?![\uDC00-\uDFFF])/.test(emoji), "no pair cut in half");
  assert.equal(nackReason(new Error("a\uD800b")), "Error: a\uFFFDb");
  const exact = nackReason(new Error("y".repeat(4000 - "Error: ".length)));
  assert.equal(exact.length, 4000);
  assert.ok(!exact.endsWith("..."), "exactly 4,000 is kept whole");
});

test("the constructor refuses a missing or empty token with a clear error", () => {
  for (const token of [undefined, "", null]) {
    assert.throws(
      () => new Consumer({ endpoint: "h:1", token: token as unknown as string, handler }),
      (error: Error) => error instanceof TypeError && /token is required/.test(error.message),
    );
  }
  assert.throws(
    () => new Consumer({ endpoint: "h:1", token: "a\nb", handler }),
    /token must be printable ASCII/,
  );
});

test("the constructor refuses concurrency < 1 and other bad options", () => {
  for (const concurrency of [0, -1, 1.5, Number.NaN]) {
    assert.throws(
      () => new Consumer({ endpoint: "h:1", token: "t", handler, concurrency }),
      (error: Error) => error instanceof RangeError && /concurrency must be an integer of at least 1/.test(error.message),
    );
  }
  assert.throws(() => new Consumer({ endpoint: "", token: "t", handler }), /endpoint is required/);
  assert.throws(
    () => new Consumer({ endpoint: "h:1", token: "t", handler: undefined as unknown as () => void }),
    /handler is required/,
  );
  assert.throws(() => new Consumer({ endpoint: "h:1", token: "t", handler, prefetch: -1 }), /prefetch/);
  assert.throws(() => new Consumer({ endpoint: "h:1", token: "t", handler, partitions: [] }), /partitions is empty/);
  assert.throws(() => new Consumer({ endpoint: "h:1", token: "t", handler, partitions: [-1] }), /integers from 0/);
  const ok = new Consumer({ endpoint: "h:1", token: "t", handler, concurrency: 3 });
  assert.equal(ok.credits, 6, "credits = concurrency + prefetch (default: concurrency)");
});

test("the package's proto is the repo's proto, verbatim", () => {
  // eslint-disable-next-line @typescript-eslint/no-require-imports
  const copy = require(path.join(PACKAGE, "scripts", "copy-proto.js")) as { source: string };
  assert.equal(path.resolve(PROTO_PATH), path.join(PACKAGE, "proto", "triage", "v1", "triage.proto"));
  const ours = fs.readFileSync(PROTO_PATH, "utf8");
  assert.equal(ours, fs.readFileSync(copy.source, "utf8"));
  assert.match(ours, /max_frame_bytes\s*=\s*4;/, "Hello.max_frame_bytes: the client sends its limit");
});

/** Little-endian fixed-width columns, as the proxy packs them. */
function int64s(values: number[]): Buffer {
  const out = Buffer.alloc(8 * values.length);
  values.forEach((v, i) => out.writeBigInt64LE(BigInt(v), 8 * i));
  return out;
}
function int32s(values: number[]): Buffer {
  const out = Buffer.alloc(4 * values.length);
  values.forEach((v, i) => out.writeInt32LE(v, 4 * i));
  return out;
}

/** `packed` encoded in a Deliveries frame, decoded as the client decodes frames, unpacked. */
function throughProto(topic: string, partition: number, packed: PackedDeliveries): Message[] {
  const wire = CONSUME.responseSerialize({ deliveries: { topic, partition, packed } });
  const frame = CONSUME.responseDeserialize(wire) as ProxyFrame;
  return unpackMessages(topic, partition, frame.deliveries!.packed!);
}

/** Two deliveries, values "a" and "b", no keys, no attempts column. */
const TWO: PackedDeliveries = {
  offsets: int64s([5, 6]),
  timestamps_ms: int64s([0, 0]),
  value_lengths: int32s([1, 1]),
  values: Buffer.from("ab"),
};

test("packed deliveries decode through the real proto: nulls, empties, big offsets, attempts", () => {
  const big = 2 ** 40 + 7; // past 32 bits: both halves of the int64 count
  const packed = {
    offsets: int64s([big, big + 1, big + 2]),
    timestamps_ms: int64s([1_700_000_000_000, 1_700_000_000_001, 1_700_000_000_002]),
    attempts: Buffer.from([1, 0, 0, 0, 3, 0, 0, 0, 1, 0, 0, 0]),
    value_lengths: int32s([2, -1, 0]),
    values: Buffer.from("hi"),
    key_lengths: int32s([-1, 1, 0]),
    keys: Buffer.from("k"),
  };
  const messages = throughProto("orders", 2, packed);
  assert.deepEqual(
    messages.map((m) => [m.offset, m.key, m.value, m.timestampMs, m.attempt, m.headers]),
    [
      [big, null, Buffer.from("hi"), 1_700_000_000_000, 1, []],
      [big + 1, Buffer.from("k"), null, 1_700_000_000_001, 3, []],
      [big + 2, Buffer.alloc(0), Buffer.alloc(0), 1_700_000_000_002, 1, []],
    ],
  );
  assert.ok(messages.every((m) => m.topic === "orders" && m.partition === 2));
});

test("packed deliveries without attempts or keys: attempt 1, every key null", () => {
  const messages = throughProto("t", 0, TWO);
  assert.deepEqual(
    messages.map((m) => [m.offset, m.key, m.value?.toString(), m.attempt]),
    [
      [5, null, "a", 1],
      [6, null, "b", 1],
    ],
  );
});

test("packed deliveries whose columns disagree are refused (a broken proxy)", () => {
  const good = TWO;
  assert.throws(() => unpackMessages("t", 0, { ...good, values: Buffer.from("abc") }), /do not add up/);
  assert.throws(() => unpackMessages("t", 0, { ...good, timestamps_ms: int64s([0]) }), /timestamps/);
  assert.throws(() => unpackMessages("t", 0, { ...good, attempts: Buffer.alloc(4) }), /attempts/);
  assert.throws(() => unpackMessages("t", 0, { ...good, value_lengths: int32s([2]) }), /lengths/);
  assert.equal(unpackMessages("t", 0, good).length, 2);
});

test("a Settle for an ack-range proxy: runs become ranges, the rest and duplicates plain acks", () => {
  const nacks = [{ offset: 7, reason: "Error: bad", retry: false }];
  assert.deepEqual(settleFrame([5, 3, 4, 10, 12, 11, 20, 20, 30], nacks), {
    acks: [20, 20, 30],
    nacks,
    ack_ranges: [
      { first: 3, last: 5 },
      { first: 10, last: 12 },
    ],
  });
  assert.deepEqual(settleFrame([], nacks), { acks: [], nacks });
  assert.deepEqual(settleFrame([9], []), { acks: [9], nacks: [], ack_ranges: [] });
});
