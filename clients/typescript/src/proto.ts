/**
 * The wire contract: this package's copy of proto/triage/v1/triage.proto, loaded once with
 * @grpc/proto-loader, and the frames as the plain objects proto-loader reads and writes (their
 * types are generated from the same .proto into generated/messages.ts by proto/generate.py).
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

import type { ConsumerFrame, ProxyFrame, TopologyReply } from "./generated/messages";
import { PartitionRoute_State } from "./generated/messages";

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

export type {
  ConsumerFrame,
  Deliveries,
  Delivery,
  Header,
  Hello,
  Nack,
  OffsetRange,
  PackedDeliveries,
  PartitionRoute,
  ProxyFrame,
  Rejected,
  Settle,
  TopologyReply,
  Welcome,
} from "./generated/messages";

/** PartitionRoute.State.SERVING: a proxy delivers the partition at `endpoint`. */
export const ROUTE_SERVING = PartitionRoute_State.SERVING;

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
