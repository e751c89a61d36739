/**
 * The wire contract: this package's copy of proto/triage/v1/triage.proto, loaded once with
 * @grpc/proto-loader, and the frames as the plain objects proto-loader reads and writes.
 *
 * Options, and why: `keepCase` keeps the proto's field names (`ack_deadline_ms`), so the
 * PROTOCOL document and this code use the same words; `longs: Number` gives offsets as
 * numbers (exact up to 2^53, far beyond any Kafka offset); `defaults: false` leaves an
 * absent optional field undefined, which is how a null key, value or header value is told
 * apart from an empty one; `oneofs: true` names the frame kind in `frame`.
 */

import * as fs from "node:fs";
import * as path from "node:path";

import type { MethodDefinition } from "@grpc/proto-loader";
import { loadSync } from "@grpc/proto-loader";

/** Where the package's copy of the proto is, from dist/ or from the test build's dist-test/src/. */
function protoPath(): string {
  const relative = path.join("proto", "triage", "v1", "triage.proto");
  for (const up of ["..", path.join("..", "..")]) {
    const candidate = path.resolve(__dirname, up, relative);
    if (fs.existsSync(candidate)) {
      return candidate;
    }
  }
  throw new Error(`the package's ${relative} is missing (run npm run build)`);
}

export const PROTO_PATH = protoPath();

/** The loaded package definition (the tests' fake proxy serves it too). */
export const definition = loadSync(PROTO_PATH, {
  keepCase: true,
  longs: Number,
  defaults: false,
  oneofs: true,
});

export interface Hello {
  consumer_id: string;
  credits: number;
  partition?: number;
  max_frame_bytes?: number;
  /** This client reads Deliveries.packed (PROTOCOL.md, "Packed deliveries"). */
  packed_deliveries?: boolean;
}

export interface Nack {
  offset: number;
  reason: string;
  retry: boolean;
}

export interface OffsetRange {
  first: number;
  last: number;
}

export interface Settle {
  acks: number[];
  nacks: Nack[];
  /** Only to a proxy whose Welcome said ack_ranges. */
  ack_ranges?: OffsetRange[];
}

export interface OffsetList {
  offsets: number[];
}

export interface ConsumerFrame {
  hello?: Hello;
  settle?: Settle;
  extend?: OffsetList;
  release?: OffsetList;
}

export interface Welcome {
  topic?: string;
  partition?: number;
  ack_deadline_ms?: number;
  max_attempts?: number;
  max_frame_bytes?: number;
  /** This proxy understands Settle.ack_ranges. */
  ack_ranges?: boolean;
}

export interface Header {
  key?: string;
  value?: Buffer;
}

export interface Delivery {
  offset?: number;
  key?: Buffer;
  value?: Buffer;
  headers?: Header[];
  timestamp_ms?: number;
  attempt?: number;
}

/** Deliveries as columns (PROTOCOL.md, "Packed deliveries"); an absent column is empty. */
export interface PackedDeliveries {
  offsets?: Buffer;
  timestamps_ms?: Buffer;
  attempts?: Buffer;
  value_lengths?: Buffer;
  values?: Buffer;
  key_lengths?: Buffer;
  keys?: Buffer;
}

export interface Deliveries {
  topic?: string;
  partition?: number;
  deliveries?: Delivery[];
  packed?: PackedDeliveries;
}

export interface Rejected {
  offsets?: number[];
  reason?: string;
}

export interface ProxyFrame {
  frame?: "welcome" | "deliveries" | "rejected";
  welcome?: Welcome;
  deliveries?: Deliveries;
  rejected?: Rejected;
}

/** PartitionRoute.State.SERVING: a proxy delivers the partition at `endpoint`. */
export const ROUTE_SERVING = 1;

export interface PartitionRoute {
  partition?: number;
  endpoint?: string;
  state?: number;
  owner_id?: string;
}

export interface TopologyReply {
  topic?: string;
  partition_count?: number;
  partitions?: PartitionRoute[];
  complete?: boolean;
  problem?: string;
}

function method<Req, Res>(name: string): MethodDefinition<Req, Res> {
  const service = definition["triage.v1.Triage"] as unknown as Record<string, MethodDefinition<Req, Res>>;
  const found = service[name];
  if (found === undefined) {
    throw new Error(`${PROTO_PATH} has no Triage.${name}`);
  }
  return found;
}

export const CONSUME = method<ConsumerFrame, ProxyFrame>("Consume");
export const TOPOLOGY = method<Record<string, never>, TopologyReply>("Topology");
