/**
 * An in-process fake proxy: a grpc-js Server implementing the Triage service, driven by the
 * test. Each Consume stream is recorded (metadata, every ConsumerFrame with its arrival time,
 * the half-close) and the test answers with Welcome, Deliveries and a final status.
 */

import * as grpc from "@grpc/grpc-js";

import { definition } from "../src/proto.js";
import type { ConsumerFrame, Delivery, ProxyFrame, TopologyReply } from "../src/proto.js";

export const TOKEN = "test-token";

export interface Received {
  at: number;
  frame: ConsumerFrame;
}

/** Poll `predicate` until it holds (or fail after `ms`). */
export async function until(predicate: () => boolean, ms = 5000, what = "condition"): Promise<void> {
  const deadline = Date.now() + ms;
  while (!predicate()) {
    if (Date.now() > deadline) {
      throw new Error(`timed out waiting for ${what}`);
    }
    await sleep(5);
  }
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * How long a test waits for a Consumer's stop(): the longest drain a test scripts is the
 * client's CLOSE_TIMEOUT_MS (5 s) after a half-close the fake leaves unanswered.
 */
export const STOP_LIMIT_MS = 10_000;
/** How long withProxies() lets a test body run: under `npm test`'s 60 s per-test timeout. */
export const BODY_LIMIT_MS = 45_000;

/**
 * `promise`, or a rejection naming `what` once `ms` passed. A hung await then fails its test
 * with a clear message and lets withProxies() clean up; unbounded, the live gRPC handles kept
 * node --test from exiting after the per-test timeout (a CI run hung that way).
 */
export function within<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`${what} did not finish within ${ms / 1000} s`)), ms);
    promise.then(
      (value) => {
        clearTimeout(timer);
        resolve(value);
      },
      (error: unknown) => {
        clearTimeout(timer);
        reject(error);
      },
    );
  });
}

/** `consumer.stop()`, failing the test if it does not resolve within `ms`. */
export function stopped(consumer: { stop(): Promise<void> }, ms = STOP_LIMIT_MS): Promise<void> {
  return within(consumer.stop(), ms, "stop()");
}

export class FakeStream {
  readonly received: Received[] = [];
  readonly metadata: grpc.Metadata;
  halfClosedAt: number | null = null;
  cancelled = false;
  finished = false;

  constructor(
    readonly proxy: FakeProxy,
    readonly call: grpc.ServerDuplexStream<ConsumerFrame, ProxyFrame>,
  ) {
    this.metadata = call.metadata;
    call.on("data", (frame: ConsumerFrame) => this.received.push({ at: Date.now(), frame }));
    call.on("end", () => {
      // Like the proxy: a half-close is answered by ending the stream with OK.
      this.halfClosedAt = Date.now();
      if (this.proxy.endOnHalfClose) {
        this.end();
      }
    });
    call.on("cancelled", () => {
      this.cancelled = true;
    });
    call.on("error", () => {});
  }

  get hello(): ConsumerFrame["hello"] {
    return this.received[0]?.frame.hello;
  }

  frames<K extends keyof ConsumerFrame>(kind: K): { at: number; value: NonNullable<ConsumerFrame[K]> }[] {
    return this.received
      .filter((r) => r.frame[kind] !== undefined)
      .map((r) => ({ at: r.at, value: r.frame[kind]! }));
  }

  acks(): number[] {
    return this.frames("settle").flatMap((s) => s.value.acks ?? []);
  }

  nacks(): { offset: number; reason: string; retry: boolean }[] {
    return this.frames("settle").flatMap((s) =>
      (s.value.nacks ?? []).map((n) => ({
        offset: n.offset ?? 0,
        reason: n.reason ?? "",
        retry: n.retry ?? false,
      })),
    );
  }

  settled(): number[] {
    return [...this.acks(), ...this.nacks().map((n) => n.offset)].sort((a, b) => a - b);
  }

  welcome(ackDeadlineMs = 30_000, partition = this.hello?.partition ?? 0, topic = "t"): void {
    this.call.write({
      welcome: { topic, partition, ack_deadline_ms: ackDeadlineMs, max_attempts: 5 },
    });
  }

  deliver(offsets: number[], partition = this.hello?.partition ?? 0, extra: Partial<Delivery> = {}): void {
    this.call.write({
      deliveries: {
        topic: "t",
        partition,
        deliveries: offsets.map((offset) => ({
          offset,
          value: Buffer.from(`v${offset}`),
          attempt: 1,
          timestamp_ms: 1000 + offset,
          ...extra,
        })),
      },
    });
  }

  deliverRaw(deliveries: Delivery[], partition = 0): void {
    this.call.write({ deliveries: { topic: "t", partition, deliveries } });
  }

  /** End the stream with OK. */
  end(): void {
    if (!this.finished) {
      this.finished = true;
      this.call.end();
    }
  }

  /** End the stream with an error status (and trailers). */
  fail(code: grpc.status, details: string, trailers?: Record<string, string>): void {
    if (this.finished) {
      return;
    }
    this.finished = true;
    const metadata = new grpc.Metadata();
    for (const [key, value] of Object.entries(trailers ?? {})) {
      metadata.set(key, value);
    }
    this.call.emit("error", { code, details, metadata });
  }
}

type Topology = TopologyReply | { code: grpc.status; details: string } | null;

/** One fake proxy on a free port. `onStream` scripts each new stream; `topology` answers Topology. */
export class FakeProxy {
  readonly streams: FakeStream[] = [];
  readonly topologyCalls: grpc.Metadata[] = [];
  onStream: (stream: FakeStream) => void = (s) => s.welcome();
  topology: Topology = null; // null: UNIMPLEMENTED, like a proxy older than Topology
  endOnHalfClose = true;
  private server = new grpc.Server();
  port = 0;

  get endpoint(): string {
    return `127.0.0.1:${this.port}`;
  }

  async start(port = 0): Promise<FakeProxy> {
    const pkg = grpc.loadPackageDefinition(definition) as unknown as {
      triage: { v1: { Triage: { service: grpc.ServiceDefinition } } };
    };
    this.server.addService(pkg.triage.v1.Triage.service, {
      Consume: (call: grpc.ServerDuplexStream<ConsumerFrame, ProxyFrame>) => {
        const stream = new FakeStream(this, call);
        this.streams.push(stream);
        // Like the proxy: answer once the Hello arrived.
        call.once("data", () => this.onStream(stream));
      },
      Topology: (
        call: grpc.ServerUnaryCall<unknown, TopologyReply>,
        callback: grpc.sendUnaryData<TopologyReply>,
      ) => {
        this.topologyCalls.push(call.metadata);
        const answer = this.topology;
        if (answer === null) {
          callback({ code: grpc.status.UNIMPLEMENTED, details: "Method not found" });
        } else if ("code" in answer) {
          callback({ code: answer.code, details: answer.details });
        } else {
          callback(null, answer);
        }
      },
    });
    this.port = await new Promise<number>((resolve, reject) =>
      this.server.bindAsync(`127.0.0.1:${port}`, grpc.ServerCredentials.createInsecure(), (error, bound) =>
        error ? reject(error) : resolve(bound),
      ),
    );
    return this;
  }

  async stop(): Promise<void> {
    this.server.forceShutdown();
  }

  /** A Topology answer: every partition SERVING at the given endpoints. */
  static serving(topic: string, endpoints: (string | null)[]): TopologyReply {
    return {
      topic,
      partition_count: endpoints.length,
      partitions: endpoints.map((endpoint, partition) =>
        endpoint === null
          ? { partition, state: 3 }
          : { partition, endpoint, state: 1, owner_id: `owner-${partition}` },
      ),
      complete: true,
      problem: "",
    };
  }
}

const live: { stop(): Promise<void> }[] = [];

/** Stop `consumer` when the test's withProxies() ends, even if the test failed. */
export function track<T extends { stop(): Promise<void> }>(consumer: T): T {
  live.push(consumer);
  return consumer;
}

/**
 * Start fake proxies, run `body` (bounded by BODY_LIMIT_MS), always stop the consumers it
 * tracked (bounded by STOP_LIMIT_MS), then the proxies, which ends any call still open.
 */
export async function withProxies(
  count: number,
  body: (...proxies: FakeProxy[]) => Promise<void>,
): Promise<void> {
  const proxies = await Promise.all(Array.from({ length: count }, () => new FakeProxy().start()));
  try {
    await within(body(...proxies), BODY_LIMIT_MS, "the test body");
  } finally {
    const consumers = live.splice(0);
    for (const proxy of proxies) {
      proxy.endOnHalfClose = true;
      for (const stream of proxy.streams) {
        if (stream.halfClosedAt !== null) stream.end();
      }
    }
    const limit = new Promise<void>((resolve) => setTimeout(resolve, STOP_LIMIT_MS).unref());
    await Promise.race([Promise.all(consumers.map((c) => c.stop())), limit]);
    await Promise.all(proxies.map((p) => p.stop()));
  }
}
