/**
 * One partition's stream: Hello, deliveries into the shared pool, batched settlements, leases.
 *
 * How a delivery flows:
 *
 *     Deliveries frame --> this stream's local queue --> the Consumer's shared handler pool
 *     handler returns / throws --> this stream's ack / nack batch --Settle--> proxy
 *
 * What the stream sends after its Hello (batched settlements, Release, Extend, the half-close)
 * is writer.ts's; its isolated deliveries and the process's turn are isolation.ts's
 * (StreamTurn); this module keeps the connection and reads frames.
 *
 * A broken stream is reopened with capped, jittered backoff, at the endpoint the topology
 * names for its partition then: a proxy that refuses the Hello with FAILED_PRECONDITION and
 * names the partition's owner (`triage-owner-endpoint`) is followed at once, and every failure
 * asks the Consumer to refresh the topology. Each stream is an epoch: results of handlers that
 * started on an earlier stream are dropped and counted, never settled on the new stream,
 * because the proxy redelivers whatever the broken stream held.
 *
 * Leases: the proxy redelivers a delivery left unsettled for the Welcome's `ack_deadline_ms`
 * (0: never). Every third of that deadline one Extend frame lists the offsets this stream
 * holds right then (running or queued for a handler slot, not yet settled), so long work keeps
 * its lease and so do the deliveries queued behind it (writer.ts).
 *
 * Isolated deliveries: the Hello sets `isolation`; a delivery the proxy flags isolated (a
 * suspect: its earlier holder vanished) waits for the process's turn (isolation.ts), then
 * Started is sent and, once the proxy answers it, it takes the next handler slot; the turn
 * passes on when its Settle is written (or the connection ends).
 *
 * Shutdown (stop()), per stream: queued deliveries are given back in a Release frame (no
 * attempt used; sent even when empty, since it also stops the proxy sending more) -> running
 * handlers finish and their settlements are sent -> half-close -> the proxy ends the stream
 * with OK (cancelled after CLOSE_TIMEOUT_MS if it does not).
 */

import { status as Status, type Client, type Metadata, type StatusObject } from "@grpc/grpc-js";

import { PartitionError, errorForStatus, statusName } from "./errors";
import { StreamTurn } from "./isolation";
import type { Account } from "./ledger";
import type { Logger } from "./log";
import { emptyStats, messagesOf, type PartitionStats } from "./message";
import type { HandlerPool } from "./pool";
import { CONSUME, type Deliveries, type Hello, type Nack, type ProxyFrame, type Welcome } from "./proto";
import { ownerEndpoint } from "./topology";
import { StreamWriter } from "./writer";

export const DEFAULT_MAX_BACKOFF_MS = 5000;
export const INITIAL_BACKOFF_MS = 50;
/**
 * Owner endpoints followed at once in a row; past that, redirects wait out the backoff too,
 * so two proxies that each name the other cannot spin a stream.
 */
export const MAX_REDIRECTS = 3;

/**
 * Milliseconds to wait before reconnect number `failures` (0-based): exponential, capped,
 * with jitter over the upper half so many instances do not reconnect in lockstep. The same
 * formula as the Python client's `backoff_delay`.
 */
export function backoffDelay(
  failures: number,
  { initial = INITIAL_BACKOFF_MS, cap = DEFAULT_MAX_BACKOFF_MS, rand = Math.random } = {},
): number {
  const ceiling = Math.min(cap, initial * 2 ** Math.min(failures, 32));
  return ceiling / 2 + (ceiling / 2) * rand();
}

/** What every stream of one Consumer shares. */
export interface StreamContext {
  /** The instance name sent in each Hello. */
  readonly consumerId: string;
  /** Call metadata (the bearer token). */
  readonly metadata: Metadata;
  /** The handler slots all streams feed. */
  readonly pool: HandlerPool;
  /** True once stop() began: streams drain and end. */
  stopping(): boolean;
  /** Longest wait between reconnects. */
  readonly maxBackoffMs: number;
  /** `partitions: [...]`: checked against the Welcome of a stream that names none. */
  readonly allowed: ReadonlySet<number> | null;
  /** The shared client (channel) to an endpoint. */
  client(endpoint: string): Client;
  /** Hello credits for a stream about to connect (the Consumer's split). */
  credits(stream: PartitionStream): number;
  /** Ask the Consumer to read the topology again now. */
  refresh(): void;
  /** The largest frame this client receives, announced in Hello.max_frame_bytes. */
  readonly maxFrameBytes: number;
  readonly logger: Logger;
  /** Test seam: the backoff's random source. */
  readonly rand?: () => number;
}

/**
 * The stream for one partition (or, against a proxy without Topology, for that proxy's only
 * partition): reconnects until stop(), following the partition's owner.
 */
export class PartitionStream {
  /** The Hello names the partition (false: an older proxy's only partition). */
  readonly named: boolean;
  /** The partition, or null until the Welcome of an unnamed stream says which. */
  partition: number | null;
  /** Where the next connection goes; null while nobody serves the partition. */
  endpoint: string | null;

  /** This stream's deliveries in hand: queued, running, results to send (ledger.ts). */
  readonly account: Account;
  /** The credits the current stream's Hello announced. */
  credits = 0;
  /** A Welcome or a delivery arrived on the current stream. */
  established = false;
  /** The current stream's proxy understands Settle.ack_ranges (its Welcome said so). */
  ackRanges = false;
  private dropped = 0;

  private received = 0; // delivered on this connection (held: minus what the writer settled)
  private overWarned = false;
  private fatal: Error | null = null; // raised by a frame handler: ends the Consumer
  private woken = false; // a new endpoint, or stop(): cut a backoff short
  private wake: (() => void) | null = null;
  /** What this stream sends (writer.ts). */
  private readonly writer: StreamWriter;
  /** Its isolated deliveries and the process's turn (isolation.ts). */
  private readonly turn: StreamTurn;

  private delivered = 0;
  private rejected = 0;
  private opened = 0;

  constructor(
    private readonly ctx: StreamContext,
    partition: number | null,
    endpoint: string | null,
  ) {
    this.named = partition !== null;
    this.partition = partition;
    this.endpoint = endpoint;
    this.account = ctx.pool.ledger.open(this);
    this.writer = new StreamWriter(this, ctx);
    this.turn = new StreamTurn(this, ctx, this.writer);
  }

  /** How logs name this stream's partition. */
  get label(): string {
    return this.partition === null ? "the proxy's only partition" : `partition ${this.partition}`;
  }

  stats(): PartitionStats {
    return {
      ...emptyStats(),
      delivered: this.delivered,
      acked: this.writer.acked,
      nacked: this.writer.nacked,
      rejected: this.rejected,
      dropped: this.dropped + this.account.dropped,
      reconnects: Math.max(0, this.opened - 1),
      extended: this.writer.extended,
    };
  }

  /**
   * The topology names a new endpoint for this partition: the next connection goes there,
   * and a reconnect waiting out its backoff goes now. A working stream stays: the proxy that
   * lost the partition ends it.
   */
  move(endpoint: string): void {
    if (endpoint !== this.endpoint) {
      this.ctx.logger.info(
        `consumer ${this.ctx.consumerId}: ${this.label} is served at ${endpoint} now`,
      );
      this.endpoint = endpoint;
      this.rouse();
    }
  }

  /** Release the queued deliveries and let the stream drain; [in flight, released]. */
  beginStop(): [number, number] {
    const taken = this.ctx.pool.takeBack(this.account);
    this.turn.giveBack();
    this.ctx.pool.ledger.release(this.account, taken);
    this.dropped += taken.length;
    this.writer.beginStop();
    this.rouse();
    return [this.account.outstanding, taken.length];
  }

  // -- connections --------------------------------------------------------------------------

  /** Consume until stop(); rejects with a StreamError the proxy means for good. */
  async run(): Promise<void> {
    const ctx = this.ctx;
    let failures = 0;
    let redirects = 0;
    while (!ctx.stopping()) {
      this.woken = false;
      const endpoint = this.endpoint;
      if (endpoint === null) {
        await this.sleep(Infinity); // nobody serves the partition: wait for the topology
        continue;
      }
      const status = await this.connect(ctx.client(endpoint));
      this.endStream();
      if (this.fatal !== null) {
        throw this.fatal;
      }
      if (ctx.stopping()) {
        break;
      }
      let owner: string | null = null;
      let problem: string;
      if (status.code === Status.OK) {
        problem = "the proxy ended the stream";
      } else {
        const error = errorForStatus(status.code, status.details, endpoint);
        if (error !== null) {
          throw error;
        }
        if (status.code === Status.FAILED_PRECONDITION) {
          owner = ownerEndpoint(status.metadata);
        }
        problem = `${statusName(status.code)}: ${status.details}`;
      }
      if (this.established) {
        failures = 0;
        redirects = 0;
      } else {
        failures += 1;
      }
      if (this.named) {
        ctx.refresh(); // the topology may know a better endpoint by now
      }
      if (owner !== null && owner !== endpoint) {
        this.endpoint = owner;
        if (redirects < MAX_REDIRECTS) {
          redirects += 1;
          ctx.logger.info(
            `consumer ${ctx.consumerId}: ${endpoint} does not serve ${this.label} (${problem}); following it to ${owner}`,
          );
          continue;
        }
      }
      const delay = backoffDelay(failures, {
        cap: ctx.maxBackoffMs,
        ...(ctx.rand ? { rand: ctx.rand } : {}),
      });
      ctx.logger.warn(
        `consumer ${ctx.consumerId}: stream for ${this.label} at ${endpoint} lost (${problem}); reconnecting in ${Math.round(delay)} ms`,
      );
      await this.sleep(delay);
    }
  }

  /** Wait `ms`, or less if woken (a new endpoint, stop()). */
  private sleep(ms: number): Promise<void> {
    if (this.woken) {
      return Promise.resolve();
    }
    return new Promise((resolve) => {
      const timer = ms === Infinity ? null : setTimeout(done, ms);
      const self = this;
      function done(): void {
        if (timer !== null) {
          clearTimeout(timer);
        }
        self.wake = null;
        resolve();
      }
      this.wake = done;
    });
  }

  private rouse(): void {
    this.woken = true;
    this.wake?.();
  }

  /** One stream, from Hello to its end: resolves with the status the call ended with. */
  private connect(client: Client): Promise<StatusObject> {
    const ctx = this.ctx;
    this.opened += 1;
    this.established = false;
    this.ackRanges = false;
    this.overWarned = false;
    this.received = 0;
    this.credits = ctx.credits(this);
    const call = client.makeBidiStreamRequest(
      CONSUME.path,
      CONSUME.requestSerialize,
      CONSUME.responseDeserialize,
      ctx.metadata,
      {},
    );
    this.writer.connected(call, this.credits);
    return new Promise((resolve) => {
      call.on("data", (frame: ProxyFrame) => {
        try {
          this.onFrame(frame);
        } catch (error) {
          this.fatal = error instanceof Error ? error : new Error(String(error));
          call.cancel();
        }
      });
      call.on("error", () => {}); // the status event carries the outcome
      call.on("status", resolve);
      const hello: Hello = {
        consumer_id: ctx.consumerId,
        credits: this.credits,
        max_frame_bytes: ctx.maxFrameBytes,
        packed_deliveries: true,
        isolation: true,
      };
      if (this.named && this.partition !== null) {
        hello.partition = this.partition;
      }
      call.write({ hello });
    });
  }

  /** Forget what the dead stream held: the proxy redelivers all of it. */
  private endStream(): void {
    this.writer.ended();
    const leases = this.account.leases; // the ended connection's: a handler leaves it when done
    const taken = this.ctx.pool.takeBack(this.account, true);
    const released = taken.length;
    this.turn.connectionEnded(leases, taken); // the proxy redelivers what waited
    // unsent releases were counted as dropped when they were released
    const unsent = this.ctx.pool.ledger.forget(this.account);
    this.dropped += released + unsent;
    this.received = this.writer.settled;
    if (released || unsent) {
      this.ctx.logger.debug(
        `consumer ${this.ctx.consumerId}: ${this.label}: dropped ${released} queued deliveries and ${unsent} unsent settlements`,
      );
    }
  }

  private onFrame(frame: ProxyFrame): void {
    if (frame.deliveries !== undefined) {
      this.onDeliveries(frame.deliveries);
    } else if (frame.welcome !== undefined) {
      this.onWelcome(frame.welcome);
    } else if (frame.started !== undefined) {
      this.turn.onStarted(frame.started.offsets ?? []);
    } else if (frame.rejected !== undefined) {
      const count = frame.rejected.offsets?.length ?? 0;
      this.rejected += count;
      this.ctx.logger.warn(
        `consumer ${this.ctx.consumerId}: proxy rejected ${count} settlements: ${frame.rejected.reason ?? ""}`,
      );
    }
  }

  private onWelcome(welcome: Welcome): void {
    const ctx = this.ctx;
    const partition = welcome.partition ?? 0;
    if (!this.named) {
      const allowed = ctx.allowed;
      if (allowed !== null && !allowed.has(partition)) {
        const wanted = [...allowed].sort((a, b) => a - b);
        throw new PartitionError(
          wanted,
          `partitions [${wanted.join(", ")}] asked for, but the proxy at ${this.endpoint} ` +
            `(an older proxy, without Topology) serves only partition ${partition} of ` +
            `'${welcome.topic ?? ""}'`,
        );
      }
      this.partition = partition;
    }
    this.established = true;
    this.ackRanges = welcome.ack_ranges === true;
    const deadline = welcome.ack_deadline_ms ?? 0;
    this.writer.welcomed(deadline);
    ctx.logger.info(
      `consumer ${ctx.consumerId} connected to ${this.endpoint}: ${welcome.topic ?? ""}[${partition}], ` +
        `credits ${this.credits}, ack deadline ${deadline} ms, max attempts ${welcome.max_attempts ?? 0}`,
    );
  }

  private onDeliveries(batch: Deliveries): void {
    const messages = messagesOf(batch);
    const count = messages.length;
    this.established = true;
    this.delivered += count;
    this.received += count;
    const held = this.received - this.writer.settled;
    if (held > this.credits && !this.overWarned) {
      this.overWarned = true;
      this.ctx.logger.warn(
        `consumer ${this.ctx.consumerId}: proxy sent ${held} unsettled deliveries, more than the ${this.credits} credits`,
      );
    }
    if (this.ctx.stopping()) {
      this.dropped += count; // released: the proxy redelivers them
      this.ctx.pool.ledger.release(this.account, messages);
      this.writer.scheduleFlush();
      return;
    }
    const isolated = batch.isolated;
    if (isolated !== undefined && isolated.length > 0) {
      this.turn.isolate(messages, isolated);
      return;
    }
    this.ctx.pool.submit(this.account, messages);
  }

  /** The writer sent these results (an isolated delivery's passes the turn on). */
  settlementsSent(acks: readonly number[], nacks: readonly Nack[]): void {
    this.turn.settled(acks, nacks);
  }

  /** A handler of this stream finished: send now if the batch is full, soon otherwise. */
  afterSettle(queueDrained: boolean): void {
    this.writer.afterSettle(queueDrained);
  }
}
