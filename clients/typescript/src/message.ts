/** The message a handler receives, and the consumer's counters. */

import type { Deliveries, PackedDeliveries } from "./proto";

/** Kafka headers in broker order; a header value may be null. Names may repeat. */
export type Headers = [name: string, value: Buffer | null][];

/** One Kafka message delivered by the proxy, byte-exact. */
export interface Message {
  /** Source topic. */
  readonly topic: string;
  /** Source partition. */
  readonly partition: number;
  /** Offset within the partition; settlements name the message by it. */
  readonly offset: number;
  /** Message key; null when the producer sent none (an empty Buffer is a distinct, empty key). */
  readonly key: Buffer | null;
  /** Message value; null for a tombstone. */
  readonly value: Buffer | null;
  /** Headers in broker order; never null itself (an empty array). */
  readonly headers: Headers;
  /** Kafka timestamp in milliseconds since the epoch. */
  readonly timestampMs: number;
  /** 1 for the first delivery of this offset, higher for redeliveries. */
  readonly attempt: number;
}

/** Counters of one partition's streams (or, summed, of the whole consumer). */
export interface PartitionStats {
  /** Messages received from the proxy. */
  delivered: number;
  /** Acks sent to the proxy. */
  acked: number;
  /** Nacks sent to the proxy (retry or not). */
  nacked: number;
  /** Settlements the proxy refused (it did not consider this instance their holder). */
  rejected: number;
  /**
   * Deliveries given up without a settlement: their stream broke, or stop() released them
   * before a handler started. The proxy redelivers them.
   */
  dropped: number;
  /** Streams opened after the first one. */
  reconnects: number;
  /** Lease extensions sent: each offset listed in each Extend frame counts once. */
  extended: number;
}

/**
 * A snapshot of a consumer's counters since it was created: the fields are totals over
 * every partition it consumes, and `partitions` has the same counters per partition.
 */
export interface ConsumerStats extends PartitionStats {
  /** Partition -> its counters (an older proxy's only partition is listed once its Welcome named it). */
  partitions: Record<number, PartitionStats>;
}

export function emptyStats(): PartitionStats {
  return { delivered: 0, acked: 0, nacked: 0, rejected: 0, dropped: 0, reconnects: 0, extended: 0 };
}

const EMPTY = Buffer.alloc(0);

/** `n` little-endian int64 from `data` as Numbers (offsets and timestamps fit 2^53). */
function int64s(data: Buffer, what: string, n: number): number[] {
  if (data.length !== 8 * n) {
    throw new Error(`packed deliveries: ${data.length / 8} ${what} for ${n} offsets`);
  }
  const out: number[] = new Array(n);
  for (let i = 0; i < n; i++) {
    out[i] = data.readInt32LE(8 * i + 4) * 4294967296 + data.readUInt32LE(8 * i);
  }
  return out;
}

/** A packed key or value column: `n` slices of `data` (a length of -1: null). */
function payloads(lengths: Buffer, data: Buffer, what: string, n: number): (Buffer | null)[] {
  if (lengths.length !== 4 * n) {
    throw new Error(`packed deliveries: ${lengths.length / 4} ${what} lengths for ${n} offsets`);
  }
  const out: (Buffer | null)[] = new Array(n);
  let at = 0;
  for (let i = 0; i < n; i++) {
    const length = lengths.readInt32LE(4 * i);
    if (length < 0) {
      out[i] = null;
    } else {
      out[i] = data.subarray(at, at + length);
      at += length;
    }
  }
  if (at !== data.length) {
    throw new Error(`packed deliveries: the ${what} lengths do not add up to the payload`);
  }
  return out;
}

/**
 * The messages of a `Deliveries.packed` (PROTOCOL.md, "Packed deliveries"): columns of
 * fixed-width little-endian integers and the payloads concatenated, read without decoding
 * a protobuf message per delivery. Throws when the columns disagree (a broken proxy).
 */
export function unpackMessages(topic: string, partition: number, packed: PackedDeliveries): Message[] {
  const offsetBytes = packed.offsets ?? EMPTY;
  if (offsetBytes.length % 8 !== 0) {
    throw new Error("packed deliveries: the offsets are not a whole number of int64");
  }
  const n = offsetBytes.length / 8;
  const offsets = int64s(offsetBytes, "offsets", n);
  const timestamps = int64s(packed.timestamps_ms ?? EMPTY, "timestamps", n);
  const attemptBytes = packed.attempts ?? EMPTY;
  if (attemptBytes.length !== 0 && attemptBytes.length !== 4 * n) {
    throw new Error("packed deliveries: the attempts do not match the offsets");
  }
  const values = payloads(packed.value_lengths ?? EMPTY, packed.values ?? EMPTY, "value", n);
  const keyLengths = packed.key_lengths ?? EMPTY;
  const keys = keyLengths.length === 0 ? null : payloads(keyLengths, packed.keys ?? EMPTY, "key", n);
  const messages: Message[] = new Array(n);
  for (let i = 0; i < n; i++) {
    messages[i] = {
      topic,
      partition,
      offset: offsets[i]!,
      key: keys === null ? null : keys[i]!,
      value: values[i]!,
      headers: [],
      timestampMs: timestamps[i]!,
      attempt: attemptBytes.length === 0 ? 1 : attemptBytes.readUInt32LE(4 * i),
    };
  }
  return messages;
}

/**
 * The Messages of a Deliveries frame: the packed ones first, then the repeated ones
 * appended, as the Python client's `messages_of` does (a frame from a current proxy is all
 * packed, and its array is used as it is).
 */
export function messagesOf(batch: Deliveries): Message[] {
  const topic = batch.topic ?? "";
  const partition = batch.partition ?? 0;
  const deliveries = batch.deliveries ?? [];
  const messages: Message[] =
    batch.packed == null ? [] : unpackMessages(topic, partition, batch.packed);
  for (let i = 0; i < deliveries.length; i++) {
    const d = deliveries[i]!;
    const hs = d.headers;
    let headers: Headers;
    if (hs === undefined || hs.length === 0) {
      headers = [];
    } else {
      headers = new Array(hs.length);
      for (let j = 0; j < hs.length; j++) {
        const h = hs[j]!;
        headers[j] = [h.key ?? "", h.value ?? null];
      }
    }
    messages.push({
      topic,
      partition,
      offset: d.offset ?? 0,
      key: d.key ?? null,
      value: d.value ?? null,
      headers,
      timestampMs: d.timestamp_ms ?? 0,
      attempt: d.attempt ?? 0,
    });
  }
  return messages;
}
