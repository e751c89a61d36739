/**
 * Where a deployment's partitions are served now, and how an instance's credits are split.
 *
 * Any proxy of a deployment answers the Topology RPC; `Layout` is its answer, read once into
 * plain values. `creditShare` is the one formula that splits `concurrency + prefetch` over
 * the partition streams of one Consumer (the Python client's topology.py, same rule).
 */

import { Metadata, type Client, type ServiceError } from "@grpc/grpc-js";

import { OWNER_ENDPOINT_METADATA } from "./generated/constants";
import { ROUTE_SERVING, TOPOLOGY, type TopologyReply } from "./proto";

/** One Topology answer. */
export interface Layout {
  /** The deployment's topic. */
  readonly topic: string;
  /** Partitions of the topic (0 .. partitionCount - 1). */
  readonly partitionCount: number;
  /** Partition -> the endpoint serving it now; partitions nobody serves now are absent. */
  readonly endpoints: ReadonlyMap<number, string>;
  /** False when the answering proxy could not read where ownership lives. */
  readonly complete: boolean;
  /** Why the answer is incomplete, if it is. */
  readonly problem: string;
}

/** A Topology reply as plain values: only SERVING routes with an endpoint count. */
export function layoutFromReply(reply: TopologyReply): Layout {
  const endpoints = new Map<number, string>();
  for (const route of reply.partitions ?? []) {
    if (route.state === ROUTE_SERVING && route.endpoint) {
      endpoints.set(route.partition ?? 0, route.endpoint);
    }
  }
  return {
    topic: reply.topic ?? "",
    partitionCount: reply.partition_count ?? 0,
    endpoints,
    complete: reply.complete ?? false,
    problem: reply.problem ?? "",
  };
}

/** The `triage-owner-endpoint` a proxy named when it refused a Hello, if it named one. */
export function ownerEndpoint(metadata: Metadata | undefined): string | null {
  for (const value of metadata?.get(OWNER_ENDPOINT_METADATA) ?? []) {
    const text = typeof value === "string" ? value : value.toString("utf8");
    if (text) {
      return text;
    }
  }
  return null;
}

/**
 * Hello credits of stream number `index` (0-based) out of `streams`: `budget` split as evenly
 * as it goes, the remainder to the first ones, so the shares sum to `budget`; at least 1 each
 * (the protocol's minimum), so more streams than budget exceed it by design.
 */
export function creditShare(budget: number, streams: number, index: number): number {
  const count = Math.max(1, streams);
  const base = Math.floor(budget / count);
  const extra = budget % count;
  return Math.max(1, base + (index < extra ? 1 : 0));
}

/** Ask one proxy for the topology; rejects with the call's ServiceError as it failed. */
export function fetchLayout(client: Client, metadata: Metadata, limitMs: number): Promise<Layout> {
  return new Promise((resolve, reject) => {
    client.makeUnaryRequest(
      TOPOLOGY.path,
      TOPOLOGY.requestSerialize,
      TOPOLOGY.responseDeserialize,
      {},
      metadata,
      { deadline: Date.now() + limitMs },
      (error: ServiceError | null, reply?: TopologyReply) => {
        if (error !== null || reply === undefined) {
          reject(error ?? new Error("Topology answered nothing"));
        } else {
          resolve(layoutFromReply(reply));
        }
      },
    );
  });
}
