/**
 * The consumer: every partition of a deployment, one pool of handler slots, batched
 * settlements. The same behaviour as the Python client's Consumer (client_lib/triage_client).
 *
 * How it finds its partitions: `new Consumer({ endpoint, ... })` asks the proxy at `endpoint`
 * for the Topology (any proxy of a deployment answers: which endpoint serves which partition
 * now), then opens one stream per partition at that partition's endpoint, one channel per
 * endpoint, each Hello naming its partition (`partitions: [...]` restricts the set). The
 * topology is read again every `topologyIntervalMs`, at once when a stream fails, and every
 * second or so while a wanted partition has no serving proxy or a stream is reconnecting, so
 * a partition that fails over to a standby, or one added to the topic, is followed without a
 * restart. A proxy that predates Topology (UNIMPLEMENTED) is consumed with one stream
 * whose Hello names no partition, meaning that proxy's only partition.
 *
 *     Topology --> PartitionStream per partition --deliveries--> HandlerPool (concurrency slots)
 *                          ^                                            |
 *                          +------------- acks / nacks (per stream) ----+
 *
 * The Consumer owns the lifecycle; following the topology is in follower.ts, the gRPC clients
 * per endpoint in channels.ts, stream mechanics in stream.ts, the handler pool in pool.ts.
 *
 * Credits: the proxy lets a stream hold at most the credits its Hello announced, so they are
 * static per stream: `concurrency + prefetch` split evenly over the partition streams
 * (`creditShare`); the sum stays within `concurrency + prefetch` (a stream gets at least 1).
 * Fairness comes from the shared pool (see pool.ts).
 *
 * Lifecycle: idle -> running (start()) -> stopped. stop() shuts down every stream at once, in
 * this order: stop taking deliveries (queued ones are released for the proxy to redeliver) ->
 * wait for running handlers -> send their settlements -> half-close -> wait for the proxy to
 * end the stream -> resolve once every stream has ended and no handler runs.
 */

import * as os from "node:os";

import { Metadata, credentials as grpcCredentials } from "@grpc/grpc-js";

import { Channels } from "./channels";
import { StateError } from "./errors";
import { Flag } from "./flag";
import { TopologyFollower } from "./follower";
import { AUTHORIZATION_METADATA, BEARER_PREFIX, CLIENT_MAX_FRAME_BYTES, UINT32_MAX } from "./generated/constants";
import { DEFAULT_LOGGER, type Logger } from "./log";
import { emptyStats, type ConsumerStats, type PartitionStats } from "./message";
import { HandlerPool, type ErrorClass, type Handler } from "./pool";
import { DEFAULT_MAX_BACKOFF_MS, PartitionStream, type StreamContext } from "./stream";
import { creditShare } from "./topology";

export const DEFAULT_CONCURRENCY = 16;
/** How often a running Consumer reads the topology again when nothing asks sooner. */
export const DEFAULT_TOPOLOGY_INTERVAL_MS = 30_000;

export interface ConsumerOptions {
  /** Any proxy of the deployment, `host:port` (an older proxy without Topology: its only partition). */
  endpoint: string;
  /** The deployment's bearer token (sent as `authorization: Bearer <token>`). */
  token: string;
  /** Return or resolve to ack; throw or reject to nack (throw `Retry` for redelivery). */
  handler: Handler;
  /** Most handlers running at once, over all partitions (default 16). */
  concurrency?: number;
  /**
   * Deliveries queued locally beyond the running ones (default: concurrency), so handlers
   * never wait for a round trip; credits = concurrency + prefetch, split over the streams.
   */
  prefetch?: number;
  /** Consume only these partitions (default: every one, including ones added later). */
  partitions?: Iterable<number>;
  /** Stable instance name recorded on dead letters (default: host-pid). */
  consumerId?: string;
  /** Error classes (subclasses included) that nack with retry, as `Retry` always does. */
  retryOn?: readonly ErrorClass[];
  /** Longest wait between reconnect attempts, in milliseconds (default 5000). */
  maxBackoffMs?: number;
  /** Milliseconds between topology reads when nothing asks sooner (default 30000). */
  topologyIntervalMs?: number;
  /** TLS with the system's root certificates (default: plaintext). */
  secure?: boolean;
  /** PEM of the CA that signed the proxy's certificate, for a private CA (implies TLS). */
  rootCertificates?: Buffer;
  /** PEM of this app's client certificate, with `privateKey`, for mTLS (implies TLS). */
  certificateChain?: Buffer;
  /** PEM of the client certificate's key. */
  privateKey?: Buffer;
  /** Where log lines go (default: warnings and errors to stderr). */
  logger?: Logger;
}

type State = "idle" | "running" | "stopped";

interface Deferred<T> {
  promise: Promise<T>;
  resolve(value: T): void;
  reject(error: unknown): void;
}

function deferred<T>(): Deferred<T> {
  let resolve!: (value: T) => void;
  let reject!: (error: unknown) => void;
  const promise = new Promise<T>((res, rej) => {
    resolve = res;
    reject = rej;
  });
  return { promise, resolve, reject };
}

function byPartition(a: number | null, b: number | null): number {
  return (a ?? -1) - (b ?? -1);
}

/**
 * Consumes a deployment's partitions with a handler: return to ack, throw to nack.
 *
 * A Consumer runs once. While a delivery is in this instance's hands (running or queued),
 * its lease is extended automatically every third of the proxy's ack deadline.
 */
export class Consumer {
  private readonly endpoint: string;
  private readonly wanted: readonly number[] | null;
  private readonly budget: number;
  private readonly id: string;
  private readonly logger: Logger;
  private readonly concurrency: number;
  private readonly pool: HandlerPool;
  private readonly context: StreamContext;
  /** One gRPC client per endpoint (channels.ts). */
  private readonly channels: Channels;
  /** Which partitions to consume and where each is served (follower.ts). */
  private readonly topology: TopologyFollower;

  private state: State = "idle";
  private readonly stopping = new Flag();
  private readonly streams = new Map<number | null, PartitionStream>();
  private readonly tasks: Promise<void>[] = [];
  private failure: Error | null = null;
  private readonly started = deferred<void>();
  private readonly finished = deferred<void>();

  constructor(options: ConsumerOptions) {
    if (options === null || typeof options !== "object") {
      throw new TypeError("new Consumer({ endpoint, token, handler, concurrency }) takes an options object");
    }
    const { endpoint, token, handler } = options;
    if (typeof endpoint !== "string" || endpoint.trim() === "") {
      throw new TypeError("endpoint is required: any proxy of the deployment, as host:port");
    }
    if (typeof token !== "string" || token === "") {
      throw new TypeError(
        "token is required: the deployment's bearer token (the proxy refuses a call without one)",
      );
    }
    if (typeof handler !== "function") {
      throw new TypeError("handler is required: a function (message) => void | Promise<void>");
    }
    const concurrency = options.concurrency ?? DEFAULT_CONCURRENCY;
    if (!Number.isInteger(concurrency) || concurrency < 1) {
      throw new RangeError(`concurrency must be an integer of at least 1, got ${String(concurrency)}`);
    }
    const prefetch = options.prefetch ?? concurrency;
    if (!Number.isInteger(prefetch) || prefetch < 0) {
      throw new RangeError(`prefetch must be an integer of at least 0, got ${String(prefetch)}`);
    }
    if (concurrency + prefetch > UINT32_MAX) {
      throw new RangeError("concurrency + prefetch does not fit the protocol's uint32 credits");
    }
    const maxBackoffMs = options.maxBackoffMs ?? DEFAULT_MAX_BACKOFF_MS;
    if (!(maxBackoffMs > 0)) {
      throw new RangeError(`maxBackoffMs must be positive, got ${String(maxBackoffMs)}`);
    }
    const topologyIntervalMs = options.topologyIntervalMs ?? DEFAULT_TOPOLOGY_INTERVAL_MS;
    if (!(topologyIntervalMs > 0)) {
      throw new RangeError(`topologyIntervalMs must be positive, got ${String(topologyIntervalMs)}`);
    }
    const retryOn = options.retryOn ?? [];
    for (const cls of retryOn) {
      if (typeof cls !== "function") {
        throw new TypeError(`retryOn takes error classes, got ${String(cls)}`);
      }
    }
    if ((options.certificateChain === undefined) !== (options.privateKey === undefined)) {
      throw new TypeError("give certificateChain and privateKey together");
    }
    let wanted: number[] | null = null;
    if (options.partitions !== undefined) {
      wanted = [...new Set(options.partitions)].sort((a, b) => a - b);
      if (wanted.length === 0) {
        throw new RangeError("partitions is empty: leave it out to consume every partition");
      }
      for (const p of wanted) {
        if (!Number.isInteger(p) || p < 0) {
          throw new RangeError(`partitions are integers from 0, got ${String(p)}`);
        }
      }
    }
    const metadata = new Metadata();
    try {
      metadata.set(AUTHORIZATION_METADATA, BEARER_PREFIX + token);
    } catch {
      throw new TypeError("token must be printable ASCII (it travels in a gRPC header)");
    }

    this.endpoint = endpoint;
    this.wanted = wanted;
    this.concurrency = concurrency;
    this.budget = concurrency + prefetch;
    this.id = options.consumerId || `${os.hostname()}-${process.pid}`;
    const tls =
      options.secure === true ||
      options.rootCertificates !== undefined ||
      options.certificateChain !== undefined;
    const channelCredentials = tls
      ? grpcCredentials.createSsl(
          options.rootCertificates ?? null,
          options.privateKey ?? null,
          options.certificateChain ?? null,
        )
      : grpcCredentials.createInsecure();
    this.channels = new Channels(channelCredentials, maxBackoffMs);
    this.logger = options.logger ?? DEFAULT_LOGGER;
    this.pool = new HandlerPool(handler, concurrency, retryOn);
    this.topology = new TopologyFollower({
      consumerId: this.id,
      endpoint,
      wanted,
      metadata,
      channels: this.channels,
      streams: this.streams,
      addStreams: (endpoints) => this.addStreams(endpoints),
      stopping: this.stopping,
      maxBackoffMs,
      intervalMs: topologyIntervalMs,
      logger: this.logger,
    });
    this.context = {
      consumerId: this.id,
      metadata,
      pool: this.pool,
      stopping: () => this.stopping.isSet,
      maxBackoffMs,
      allowed: wanted === null ? null : new Set(wanted),
      client: (target) => this.channels.client(target),
      credits: (stream) => this.creditsFor(stream),
      refresh: () => this.topology.wake(),
      maxFrameBytes: CLIENT_MAX_FRAME_BYTES,
      logger: this.logger,
    };
    // The outcome is reported through start(), run() and `done`; never as an unhandled rejection.
    this.finished.promise.catch(() => {});
    this.started.promise.catch(() => {});
  }

  /** The name this instance gives the proxies. */
  get consumerId(): string {
    return this.id;
  }

  /** Most unsettled deliveries the proxies may send this instance, over all partitions. */
  get credits(): number {
    return this.budget;
  }

  /** Resolves once the consumer stopped; rejects with the error that stopped it, if one did. */
  get done(): Promise<void> {
    return this.finished.promise;
  }

  /** Counters since creation, in total and per partition (a snapshot). */
  get stats(): ConsumerStats {
    const total = emptyStats();
    const partitions: Record<number, PartitionStats> = {};
    const keys = [...this.streams.keys()].sort(byPartition);
    for (const key of keys) {
      const stream = this.streams.get(key)!;
      const part = stream.stats();
      for (const name of Object.keys(total) as (keyof PartitionStats)[]) {
        total[name] += part[name];
      }
      if (stream.partition !== null) {
        partitions[stream.partition] = part;
      }
    }
    return { ...total, partitions };
  }

  // -- lifecycle ------------------------------------------------------------------------------

  /**
   * Start consuming. Resolves once the deployment's partitions were found and their streams
   * opened; rejects, before consuming anything, with EndpointError when the endpoint is not
   * a Triage proxy, AuthenticationError when it refuses the token, PartitionError when
   * `partitions` names one the topic lacks. A Consumer starts once (StateError).
   */
  start(): Promise<void> {
    if (this.state !== "idle") {
      return Promise.reject(new StateError("a Consumer starts once; create a new one"));
    }
    this.state = "running";
    this.pool.start();
    this.logger.info(
      `consumer ${this.id} starting: endpoint ${this.endpoint}, partitions ` +
        `${this.wanted === null ? "all" : `[${this.wanted.join(", ")}]`}, concurrency ` +
        `${this.concurrency}, credits ${this.budget}`,
    );
    void this.main();
    return this.started.promise;
  }

  /**
   * Drain and stop: release queued deliveries, let running handlers finish, send their
   * settlements, half-close every stream. Resolves once every stream has ended and no
   * handler runs (also when the consumer had failed: `done` says how it ended). Idempotent;
   * safe from a signal handler or from inside a handler.
   */
  stop(): Promise<void> {
    if (this.state === "idle") {
      this.state = "stopped";
      this.stopping.set();
      this.started.resolve();
      this.finished.resolve();
    } else {
      this.beginStop();
    }
    return this.finished.promise.then(
      () => {},
      () => {},
    );
  }

  /** start(), then wait until stopped: resolves after stop(), rejects with what stopped it. */
  async run(): Promise<void> {
    await this.start();
    await this.finished.promise;
  }

  private async main(): Promise<void> {
    let topology: Promise<void> | null = null;
    try {
      const layout = await this.topology.discover();
      if (!this.stopping.isSet) {
        if (layout === null) {
          this.addStreams(new Map([[null, this.endpoint]]));
        } else {
          this.topology.apply(layout);
          topology = this.guarded(this.topology.run(this.topology.trouble(layout)));
        }
      }
      this.started.resolve();
      await this.stopping.wait();
      // No stream is added once stopping is set: these are all of them.
      await Promise.all(this.tasks);
      // Handlers that outlived a broken stream: the consumer never stops under running user code.
      await this.pool.drained();
      await topology;
    } catch (error) {
      this.failure ??= error instanceof Error ? error : new Error(String(error));
      this.beginStop();
      await Promise.all(this.tasks);
    } finally {
      this.pool.close();
      this.channels.close();
      this.state = "stopped";
      const failure = this.failure;
      if (failure !== null) {
        this.logger.error(`consumer ${this.id} stopped: ${failure.message}`);
        this.started.reject(failure);
        this.finished.reject(failure);
      } else {
        this.logger.info(`consumer ${this.id} stopped`);
        this.started.resolve();
        this.finished.resolve();
      }
    }
  }

  private beginStop(): void {
    if (this.stopping.isSet) {
      return;
    }
    this.stopping.set();
    this.topology.wake();
    let inFlight = 0;
    let released = 0;
    for (const stream of this.streams.values()) {
      const [running, givenBack] = stream.beginStop();
      inFlight += running;
      released += givenBack;
    }
    this.logger.info(
      `consumer ${this.id} stopping: ${inFlight} deliveries in flight, ${released} queued ones released`,
    );
  }

  /** A stream's or the topology reader's work: a failure for good stops the whole Consumer. */
  private async guarded(work: Promise<void>): Promise<void> {
    try {
      await work;
    } catch (error) {
      this.failure ??= error instanceof Error ? error : new Error(String(error));
      this.beginStop();
    }
  }

  // -- streams ------------------------------------------------------------------------------

  private addStreams(endpoints: Map<number | null, string | null>): void {
    if (this.stopping.isSet) {
      return;
    }
    // All created before any connects, so each Hello sees the full split.
    const added: PartitionStream[] = [];
    for (const [partition, endpoint] of endpoints) {
      if (!this.streams.has(partition)) {
        const stream = new PartitionStream(this.context, partition, endpoint);
        this.streams.set(partition, stream);
        added.push(stream);
      }
    }
    for (const stream of added) {
      this.tasks.push(this.guarded(stream.run()));
    }
  }

  /** The Hello credits of a stream about to connect: its share of the split. */
  private creditsFor(stream: PartitionStream): number {
    const order = [...this.streams.keys()].sort(byPartition);
    const key = stream.named ? stream.partition : null;
    return creditShare(this.budget, order.length, order.indexOf(key));
  }
}
