/**
 * Following a deployment's topology: which partitions to consume, and where each is served.
 * The same behaviour as the Python client's (client_lib/triage_client/follower.py).
 *
 * The first read (`discover`) comes from the Consumer's endpoint and is retried while it is
 * not up yet; an endpoint that is not a Triage proxy rejects, one that predates Topology
 * (UNIMPLEMENTED) means "consume that proxy's only partition". Then `run` reads it again
 * every `intervalMs`, at once when a stream asks (`wake`), and every second or so while a
 * wanted partition has no serving proxy or a stream is reconnecting, from the endpoint or
 * any endpoint a stream uses (any proxy answers). Each answer opens streams for wanted
 * partitions new to the Consumer and points the others at the endpoints serving them now.
 */

import { status as Status, type Metadata, type ServiceError } from "@grpc/grpc-js";

import type { Channels } from "./channels";
import { EndpointError, PartitionError, errorForStatus, speaksGrpc, statusName } from "./errors";
import { Flag } from "./flag";
import type { Logger } from "./log";
import { backoffDelay, type PartitionStream } from "./stream";
import { fetchLayout, type Layout } from "./topology";

/** Longest wait for one Topology answer. */
export const TOPOLOGY_TIMEOUT_MS = 5000;
/** Longest wait between topology reads while a wanted partition has no serving proxy. */
export const REFRESH_SOON_MAX_MS = 1000;
/** Shortest gap between two topology reads, however many streams ask. */
export const REFRESH_MIN_GAP_MS = 100;

export function isServiceError(error: unknown): error is ServiceError {
  return error instanceof Error && typeof (error as { code?: unknown }).code === "number";
}

export interface FollowerOptions {
  consumerId: string;
  /** The Consumer's endpoint (any proxy of the deployment). */
  endpoint: string;
  /** `partitions: [...]`, sorted; null: every partition. */
  wanted: readonly number[] | null;
  metadata: Metadata;
  channels: Channels;
  /** The Consumer's streams by partition (read here; added through `addStreams`). */
  streams: ReadonlyMap<number | null, PartitionStream>;
  addStreams(endpoints: Map<number | null, string | null>): void;
  stopping: Flag;
  maxBackoffMs: number;
  intervalMs: number;
  logger: Logger;
}

/** Reads the topology for one Consumer and applies it to its streams. */
export class TopologyFollower {
  private readonly wanted = new Flag(); // a stream asked, or stop(): read (or end) now

  constructor(private readonly o: FollowerOptions) {}

  /** Read the topology again now (a stream failed), or end `run` after stop(). */
  wake(): void {
    this.wanted.set();
  }

  /** `fetch`'s answer, or null when stop() comes first. */
  private untilStopped(fetch: Promise<Layout>): Promise<Layout | null> {
    return Promise.race([fetch, this.o.stopping.wait().then(() => null)]);
  }

  private fetch(endpoint: string): Promise<Layout> {
    return fetchLayout(this.o.channels.client(endpoint), this.o.metadata, TOPOLOGY_TIMEOUT_MS);
  }

  /**
   * The first topology, from the endpoint; null for a proxy without Topology (an older one:
   * consume its only partition) or when stop() came first. Transient failures (the proxy not
   * up yet) are retried; an endpoint that is not a Triage proxy rejects.
   */
  async discover(): Promise<Layout | null> {
    const { consumerId, stopping, logger } = this.o;
    let failures = 0;
    const target = this.o.endpoint;
    while (!stopping.isSet) {
      let problem: string;
      try {
        const layout = await this.untilStopped(this.fetch(target));
        if (layout === null) {
          break;
        }
        if (layout.partitionCount > 0) {
          this.checkPartitions(layout);
          return layout;
        }
        problem = `its topology lists no partitions (${layout.problem || "no reason"})`;
      } catch (error) {
        if (!isServiceError(error)) {
          throw error;
        }
        const { code, details } = error;
        if (!speaksGrpc(details)) {
          throw new EndpointError(target, code, details, "it does not speak gRPC (a wrong port?)");
        }
        if (code === Status.UNIMPLEMENTED) {
          // An older proxy, or a gRPC server that is no proxy: Consume tells which.
          logger.info(
            `consumer ${consumerId}: ${target} does not answer Topology: consuming its only partition, as with an older proxy`,
          );
          return null;
        }
        const fatal = errorForStatus(code, details, target);
        if (fatal !== null) {
          throw fatal;
        }
        problem = `${statusName(code)}: ${details}`;
      }
      const delay = backoffDelay(failures, { cap: this.o.maxBackoffMs });
      failures += 1;
      logger.warn(
        `consumer ${consumerId}: no topology from ${target} (${problem}); retrying in ${Math.round(delay)} ms`,
      );
      await stopping.wait(delay);
    }
    return null;
  }

  private checkPartitions(layout: Layout): void {
    const count = layout.partitionCount;
    const missing = (this.o.wanted ?? []).filter((p) => p >= count);
    if (missing.length > 0) {
      throw new PartitionError(
        missing,
        `partitions [${missing.join(", ")}] are not in topic '${layout.topic}', which has ` +
          `${count} partition${count === 1 ? "" : "s"} (0 to ${count - 1})`,
      );
    }
  }

  /** Open streams for wanted partitions new to the Consumer; point the others at their endpoints now. */
  apply(layout: Layout): void {
    const { streams } = this.o;
    const count = layout.partitionCount;
    const wanted = this.o.wanted ?? Array.from({ length: count }, (_, p) => p);
    const fresh = new Map<number | null, string | null>();
    for (const p of wanted) {
      if (p >= count) {
        continue;
      }
      const endpoint = layout.endpoints.get(p) ?? null;
      const stream = streams.get(p);
      if (stream === undefined) {
        fresh.set(p, endpoint);
      } else if (endpoint !== null) {
        stream.move(endpoint);
      }
    }
    if (fresh.size > 0 && streams.size > 0) {
      this.o.logger.info(
        `consumer ${this.o.consumerId}: partitions [${[...fresh.keys()].join(", ")}] of '${layout.topic}' are new: consuming them too`,
      );
    }
    this.o.addStreams(fresh);
  }

  /** What in a topology answer calls for asking again soon ("" for nothing). */
  trouble(layout: Layout): string {
    if (!layout.complete) {
      return `the topology of '${layout.topic}' is incomplete (${layout.problem})`;
    }
    const unserved = [...this.o.streams.keys()]
      .filter((p): p is number => p !== null && !layout.endpoints.has(p))
      .sort((a, b) => a - b);
    if (unserved.length > 0) {
      return `nobody serves partitions [${unserved.join(", ")}] of '${layout.topic}' now`;
    }
    return "";
  }

  /**
   * Reads the topology every `intervalMs`, at once when a stream asks, and every second or
   * so while a wanted partition has no serving proxy, no proxy answered, or a stream is
   * reconnecting, until stop(). Trouble is logged when it starts or changes.
   */
  async run(initialTrouble: string): Promise<void> {
    const { consumerId, stopping, logger } = this.o;
    let trouble = initialTrouble;
    let last = Date.now();
    let failures = trouble ? 1 : 0;
    if (trouble) {
      logger.warn(`consumer ${consumerId}: ${trouble}; asking again soon`);
    }
    while (!stopping.isSet) {
      const wait =
        failures > 0
          ? backoffDelay(failures - 1, { initial: 100, cap: REFRESH_SOON_MAX_MS })
          : this.o.intervalMs;
      await this.wanted.wait(wait);
      const gap = REFRESH_MIN_GAP_MS - (Date.now() - last);
      if (gap > 0 && !stopping.isSet) {
        await stopping.wait(gap);
      }
      if (stopping.isSet) {
        return;
      }
      this.wanted.clear();
      last = Date.now();
      const [layout, fetchProblem] = await this.fetchAny();
      if (stopping.isSet) {
        return;
      }
      let problem = fetchProblem;
      if (layout !== null) {
        this.apply(layout);
        problem = this.trouble(layout);
      }
      if (problem && problem !== trouble) {
        logger.warn(`consumer ${consumerId}: ${problem}; asking again soon`);
      } else if (trouble && !problem) {
        logger.info(`consumer ${consumerId}: every partition is served again`);
      }
      trouble = problem;
      // A stream that is reconnecting (its proxy died, say) may wait out a long backoff;
      // asking again soon lets a standby's endpoint wake it at once.
      const reconnecting = [...this.o.streams.values()].some(
        (s) => s.endpoint !== null && !s.established,
      );
      failures = problem || reconnecting ? failures + 1 : 0;
    }
  }

  /** The topology from the endpoint, else from any endpoint a stream uses (any proxy answers). */
  private async fetchAny(): Promise<[Layout | null, string]> {
    const candidates = [this.o.endpoint];
    for (const stream of this.o.streams.values()) {
      if (stream.endpoint !== null && !candidates.includes(stream.endpoint)) {
        candidates.push(stream.endpoint);
      }
    }
    const problems: string[] = [];
    for (const endpoint of candidates) {
      if (this.o.stopping.isSet) {
        break;
      }
      let layout: Layout | null;
      try {
        layout = await this.untilStopped(this.fetch(endpoint));
      } catch (error) {
        problems.push(`${endpoint}: ${isServiceError(error) ? statusName(error.code) : String(error)}`);
        continue;
      }
      if (layout !== null && layout.partitionCount > 0) {
        return [layout, ""];
      }
      problems.push(`${endpoint}: no partitions`);
    }
    return [null, `no proxy answered Topology (${problems.join(", ")})`];
  }
}
