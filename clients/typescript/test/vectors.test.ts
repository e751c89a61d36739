/**
 * The golden vectors in proto/triage/v1/vectors/ (the repo's, beside the proto), checked
 * against this client. tests/unit/test_vectors.py checks the same files against the Python
 * client and the proxy: a rule both clients implement cannot drift apart without one of the
 * two failing. Vectors of rules only the proxy applies (the frame limit a Hello gets, the
 * proxy's check of ack ranges, its encoding of packed columns) are checked there alone; the
 * frame sizes the proxy computes are checked here against this client's protobuf encoder.
 */

import assert from "node:assert/strict";
import * as fs from "node:fs";
import * as path from "node:path";
import { test } from "node:test";

import { DEFAULT_FRAME_BYTES, MAX_REASON_CHARS, MIN_FRAME_BYTES } from "../src/generated/constants.js";
import type { Delivery, PackedDeliveries, ProxyFrame } from "../src/generated/messages.js";
import { unpackMessages } from "../src/message.js";
import { nackReason } from "../src/pool.js";
import { CONSUME } from "../src/proto.js";
import { DEFAULT_MAX_BACKOFF_MS, INITIAL_BACKOFF_MS, backoffDelay } from "../src/stream.js";
import { settleFrame } from "../src/writer.js";
import { creditShare } from "../src/topology.js";

type Pieces = [string, number][];
type Columns = Record<string, string>;
type Hex = string | null;

/** The repo's vectors folder, from dist-test/test/ (or wherever the build put this file). */
function vectorsDir(): string {
  for (let dir = __dirname; dir !== path.dirname(dir); dir = path.dirname(dir)) {
    const candidate = path.join(dir, "proto", "triage", "v1", "vectors");
    if (fs.existsSync(candidate)) {
      return candidate;
    }
  }
  throw new Error(`no proto/triage/v1/vectors above ${__dirname}`);
}

const VECTORS = vectorsDir();

function load<T>(name: string): T {
  return JSON.parse(fs.readFileSync(path.join(VECTORS, name), "utf8")) as T;
}

/** A vector string written as [text, times] pieces. */
function text(pieces: Pieces): string {
  return pieces.map(([part, times]) => part.repeat(times)).join("");
}

function unhex(value: Hex): Buffer | undefined {
  return value === null ? undefined : Buffer.from(value, "hex");
}

function packedFrom(columns: Columns): PackedDeliveries {
  return Object.fromEntries(Object.entries(columns).map(([name, hex]) => [name, Buffer.from(hex, "hex")]));
}

test("vectors: this suite checks every vector file", () => {
  const files = fs.readdirSync(VECTORS).filter((name) => name.endsWith(".json"));
  assert.deepEqual(files.sort(), [
    "ack_ranges.json",
    "backoff.json",
    "credit_splits.json",
    "frame_sizes.json",
    "packed_deliveries.json",
    "reason_cutting.json",
  ]);
});

test("vectors: credit splits", () => {
  const { cases } = load<{ cases: { budget: number; streams: number; shares: number[] }[] }>("credit_splits.json");
  for (const { budget, streams, shares } of cases) {
    const count = Math.max(1, streams);
    const got = Array.from({ length: count }, (_, i) => creditShare(budget, streams, i));
    assert.deepEqual(got, shares, `budget ${budget} over ${streams} streams`);
  }
});

test("vectors: backoff", () => {
  const vectors = load<{
    initial_ms: number;
    cap_ms: number;
    cases: { failures: number; rand: number; delay_ms: number }[];
  }>("backoff.json");
  assert.equal(INITIAL_BACKOFF_MS, vectors.initial_ms);
  assert.equal(DEFAULT_MAX_BACKOFF_MS, vectors.cap_ms);
  for (const { failures, rand, delay_ms } of vectors.cases) {
    const got = backoffDelay(failures, { rand: () => rand });
    assert.ok(Math.abs(got - delay_ms) <= 1e-6, `failures ${failures}, rand ${rand}: ${got} != ${delay_ms}`);
  }
});

test("vectors: reason cutting", () => {
  const vectors = load<{
    max_chars: number;
    cases: { name: string; error_name: string; message: Pieces; reason: Pieces }[];
  }>("reason_cutting.json");
  assert.equal(MAX_REASON_CHARS, vectors.max_chars);
  for (const { name, error_name, message, reason } of vectors.cases) {
    const error = new Error(text(message));
    error.name = error_name;
    assert.equal(nackReason(error), text(reason), name);
  }
});

test("vectors: packed deliveries", () => {
  const vectors = load<{
    cases: {
      name: string;
      topic: string;
      partition: number;
      columns: Columns;
      deliveries: { offset: number; key: Hex; value: Hex; timestamp_ms: number; attempt: number }[];
    }[];
    refused: { name: string; columns: Columns }[];
  }>("packed_deliveries.json");
  for (const { name, topic, partition, columns, deliveries } of vectors.cases) {
    // Through the real decoder too, as a frame from the proxy arrives.
    const frame = CONSUME.responseDeserialize(
      CONSUME.responseSerialize({ deliveries: { topic, partition, packed: packedFrom(columns) } }),
    );
    const messages = unpackMessages(topic, partition, frame.deliveries?.packed ?? {});
    const got = messages.map((m) => ({
      offset: m.offset,
      key: m.key === null ? null : m.key.toString("hex"),
      value: m.value === null ? null : m.value.toString("hex"),
      timestamp_ms: m.timestampMs,
      attempt: m.attempt,
    }));
    assert.deepEqual(got, deliveries, name);
    assert.ok(messages.every((m) => m.topic === topic && m.partition === partition), name);
  }
  for (const { name, columns } of vectors.refused) {
    assert.throws(() => unpackMessages("orders", 3, packedFrom(columns)), /packed deliveries/, name);
  }
});

test("vectors: ack ranges (the client's Settle)", () => {
  const { client_settle } = load<{
    client_settle: { acks: number[]; plain: number[]; ranges: [number, number][] }[];
  }>("ack_ranges.json");
  for (const { acks, plain, ranges } of client_settle) {
    const settle = settleFrame(acks, []);
    assert.deepEqual(settle.acks ?? [], plain, `acks ${JSON.stringify(acks)}`);
    const got = (settle.ack_ranges ?? []).map((r) => [r.first, r.last]);
    assert.deepEqual(got, ranges, `acks ${JSON.stringify(acks)}`);
  }
});

test("vectors: frame sizes are what any protobuf encoder writes", () => {
  const vectors = load<{
    default_frame_bytes: number;
    min_frame_bytes: number;
    frames: {
      name: string;
      topic: string;
      partition: number;
      deliveries: {
        offset: number;
        key: Hex;
        value: Hex;
        headers: [string, Hex][];
        timestamp_ms: number;
        attempt: number;
      }[];
      delivery_bytes: number[];
      frame_bytes: number;
    }[];
  }>("frame_sizes.json");
  assert.equal(DEFAULT_FRAME_BYTES, vectors.default_frame_bytes);
  assert.equal(MIN_FRAME_BYTES, vectors.min_frame_bytes);
  for (const { name, topic, partition, deliveries, delivery_bytes, frame_bytes } of vectors.frames) {
    // protobufjs writes a proto3 scalar that is set even when it is 0 or "", where the
    // proxy's encoder leaves it out (both decode alike): leave those unset, as absent.
    const items: Delivery[] = deliveries.map((d) => ({
      offset: d.offset || undefined,
      key: unhex(d.key),
      value: unhex(d.value),
      headers: d.headers.map(([key, value]) => ({ key: key || undefined, value: unhex(value) })),
      timestamp_ms: d.timestamp_ms || undefined,
      attempt: d.attempt || undefined,
    }));
    const size = (frame: ProxyFrame): number => CONSUME.responseSerialize(frame).length;
    const whole = { topic: topic || undefined, partition: partition || undefined, deliveries: items };
    assert.equal(size({ deliveries: whole }), frame_bytes, name);
    // Each delivery alone in an otherwise empty Deliveries: its bytes plus the framing of
    // the item in Deliveries and of Deliveries in the ProxyFrame (tag and length each).
    const alone = items.map((item) => size({ deliveries: { deliveries: [item] } }));
    const expected = delivery_bytes.map((n) => {
      const inner = 1 + varintSize(n) + n;
      return 1 + varintSize(inner) + inner;
    });
    assert.deepEqual(alone, expected, name);
  }
});

function varintSize(n: number): number {
  let size = 1;
  while (n >= 128) {
    n = Math.floor(n / 128);
    size += 1;
  }
  return size;
}
