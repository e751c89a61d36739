/** The message a handler receives, and the consumer's counters. */

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
