/**
 * One partition's stream: Hello, deliveries into the shared pool, batched settlements, leases.
 *
 * How a delivery flows:
 *
 *     Deliveries frame --> this stream's local queue --> the Consumer's shared handler pool
 *     handler returns / throws --> this stream's ack / nack batch --Settle--> proxy
 *
 * Settlements are batched, never one frame per result: a batch goes out when it is full
 * (SETTLE_BATCH, or the stream's credits if fewer), when this stream's local queue drains
 * (the moment the proxy's next batch is needed; sent on the next turn of the event loop, so
 * every handler that finished in this turn shares the frame), or SETTLE_DELAY_MS after its
 * first result otherwise.
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
 * its lease and so do the deliveries queued behind it. An offset leaves the lease set before
 * its result joins a batch, so it is never extended after its settlement was sent.
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

import {
  status as Status,
  type Client,
  type ClientDuplexStream,
  type Metadata,
  type StatusObject,
} from "@grpc/grpc-js";

import { PartitionError, errorForStatus, statusName } from "./errors";
import { GATE, Ticket } from "./isolation";
import type { Account } from "./ledger";
import type { Logger } from "./log";
import {
  emptyStats,
  type Headers,
  type Message,
  type PartitionStats,
  unpackMessages,
} from "./message";
import type { HandlerPool } from "./pool";
import {
  CONSUME,
  type ConsumerFrame,
  type Deliveries,
  type Hello,
  type Nack,
  type OffsetRange,
  type ProxyFrame,
  type Settle,
  type Welcome,
} from "./proto";
import { ownerEndpoint } from "./topology";

export const DEFAULT_MAX_BACKOFF_MS = 5000;
export const INITIAL_BACKOFF_MS = 50;
/** Settlements sent at once without waiting for the queue to drain. */
export const SETTLE_BATCH = 256;
/**
 * How often a stream whose connection ended looks whether its isolated delivery's handler,
 * still running, is done (then the process's turn passes on).
 */
const TURN_POLL_MS = 50;

/**
 * The turn passes on once `turn`'s handler, still running though its connection ended, is
 * done (its offset leaves the ended connection's lease set): until then it is the process's
 * one started isolated delivery, and may still crash it.
 */
function leaveWhenDone(turn: Ticket, leases: ReadonlySet<number>): void {
  if (!leases.has(turn.message.offset)) {
    GATE.leave(turn);
    return;
  }
  setTimeout(() => leaveWhenDone(turn, leases), TURN_POLL_MS).unref();
}

/** Longest a settlement waits for company before it is sent. */
export const SETTLE_DELAY_MS = 2;
/** How long stop() waits for the proxy to end the stream after the half-close. */
export const CLOSE_TIMEOUT_MS = 5000;
/**
 * How long stop() waits for the Welcome of a stream still connecting before it cancels the
 * call. Waiting is worth it: a proxy that read the Hello has already sent deliveries, and a
 * cancelled call counts each as a failed attempt, where a Release gives them back free.
 */
export const STOP_CONNECT_GRACE_MS = 2000;
/**
 * After a Welcome that arrives during stop(), how long to wait for the deliveries the proxy
 * sent right behind it (before it read the Release) so they are released, not held at the
 * half-close.
 */
export const STOP_WELCOME_WAIT_MS = 50;
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

/**
 * A Settle for a proxy that understands ack ranges (its Welcome said `ack_ranges`): runs of
 * consecutive offsets (most acks are: handlers finish in about delivery order) become
 * `ack_ranges`, the rest stay plain acks. A duplicate ack stays a separate plain ack, so the
 * proxy rejects it as it rejects any duplicate ack. The same rule as the Python client's
 * `settle_frame`.
 */
export function settleFrame(acks: readonly number[], nacks: Nack[]): Settle {
  if (acks.length === 0) {
    return { acks: [], nacks };
  }
  const ordered = [...acks].sort((a, b) => a - b);
  const singles: number[] = [];
  const ranges: OffsetRange[] = [];
  let first = ordered[0]!;
  let prev = first;
  const close = (): void => {
    if (prev > first) {
      ranges.push({ first, last: prev });
    } else {
      singles.push(first);
    }
  };
  for (let i = 1; i < ordered.length; i++) {
    const offset = ordered[i]!;
    if (offset === prev + 1) {
      prev = offset;
      continue;
    }
    close();
    first = prev = offset;
  }
  close();
  return { acks: singles, nacks, ack_ranges: ranges };
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

type Call = ClientDuplexStream<ConsumerFrame, ProxyFrame>;

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
  /**
   * stop() began on an established stream: the next flush sends a Release even if it lists
   * nothing, because the Release is what sets the stream's credits to 0. Without it the
   * proxy refills the credits each final settlement frees, and what it sends then arrives
   * after the half-close: held at the stream's end, each counts as a failed attempt.
   */
  private releaseDue = false;
  private dropped = 0;

  private call: Call | null = null;
  private batchLimit = 1;
  private held = 0; // delivered on this stream and not yet settled
  private turn: Ticket | null = null; // this stream's isolated delivery holding the turn
  private overWarned = false;
  private halfClosed = false;
  /**
   * A Welcome arrived during stop(): flush() does not half-close until holdTimer has waited
   * STOP_WELCOME_WAIT_MS. A flag cleared by that timer, not a Date.now() deadline: a timer
   * may fire a millisecond before Date.now() reaches its due time (libuv measures from its
   * cached loop time) and the wall clock may step back, and a flush that found the deadline
   * not yet passed was the last one: nothing scheduled another, so stop() never resolved.
   */
  private halfCloseHeld = false;
  private holdTimer: NodeJS.Timeout | null = null;
  private fatal: Error | null = null; // raised by a frame handler: ends the Consumer
  private flushTimer: NodeJS.Timeout | null = null;
  private flushSoon: NodeJS.Immediate | null = null;
  private extendTimer: NodeJS.Timeout | null = null;
  private closeTimer: NodeJS.Timeout | null = null;
  private woken = false; // a new endpoint, or stop(): cut a backoff short
  private wake: (() => void) | null = null;

  private delivered = 0;
  private acked = 0;
  private nacked = 0;
  private rejected = 0;
  private opened = 0;
  private extended = 0;

  constructor(
    private readonly ctx: StreamContext,
    partition: number | null,
    endpoint: string | null,
  ) {
    this.named = partition !== null;
    this.partition = partition;
    this.endpoint = endpoint;
    this.account = ctx.pool.ledger.open(this);
  }

  /** How logs name this stream's partition. */
  get label(): string {
    return this.partition === null ? "the proxy's only partition" : `partition ${this.partition}`;
  }

  stats(): PartitionStats {
    return {
      ...emptyStats(),
      delivered: this.delivered,
      acked: this.acked,
      nacked: this.nacked,
      rejected: this.rejected,
      dropped: this.dropped + this.account.dropped,
      reconnects: Math.max(0, this.opened - 1),
      extended: this.extended,
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
    const turn = this.turn;
    if (turn !== null && !turn.started) {
      this.turn = null;
      GATE.leave(turn); // given back unstarted
    }
    GATE.dropWaiting(this);
    this.ctx.pool.ledger.release(this.account, taken);
    this.dropped += taken.length;
    this.releaseDue = this.call !== null;
    const call = this.call;
    if (call !== null && !this.established && this.closeTimer === null) {
      // Connecting: the Release follows the Hello; wait a little for the Welcome, and do not
      // wait long for a slow connect.
      this.closeTimer = setTimeout(() => {
        if (!this.established) {
          call.cancel();
        }
      }, STOP_CONNECT_GRACE_MS);
    }
    this.scheduleFlush();
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
    this.halfClosed = false;
    this.halfCloseHeld = false;
    this.credits = ctx.credits(this);
    this.batchLimit = Math.min(SETTLE_BATCH, this.credits);
    const call = client.makeBidiStreamRequest(
      CONSUME.path,
      CONSUME.requestSerialize,
      CONSUME.responseDeserialize,
      ctx.metadata,
      {},
    );
    this.call = call;
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
    this.call = null;
    for (const timer of [this.flushTimer, this.extendTimer, this.closeTimer, this.holdTimer]) {
      if (timer !== null) {
        clearTimeout(timer);
      }
    }
    if (this.flushSoon !== null) {
      clearImmediate(this.flushSoon);
    }
    this.flushTimer = this.extendTimer = this.closeTimer = this.holdTimer = null;
    this.flushSoon = null;
    const leases = this.account.leases; // the ended connection's: a handler leaves it when done
    const taken = this.ctx.pool.takeBack(this.account, true);
    const released = taken.length;
    GATE.dropWaiting(this); // the proxy redelivers them (a pending turn sees its epoch)
    const turn = this.turn;
    this.turn = null;
    if (turn !== null) {
      if (turn.started && leases.has(turn.message.offset) && !taken.includes(turn.message)) {
        leaveWhenDone(turn, leases); // its handler still runs
      } else {
        GATE.leave(turn);
      }
    }
    // unsent releases were counted as dropped when they were released
    const unsent = this.ctx.pool.ledger.forget(this.account);
    this.releaseDue = false;
    this.dropped += released + unsent;
    this.held = 0;
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
      this.onStarted(frame.started.offsets ?? []);
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
    if (ctx.stopping() && this.holdTimer === null) {
      if (this.closeTimer !== null) {
        clearTimeout(this.closeTimer);
        this.closeTimer = null;
      }
      // Release what the proxy sent behind the Welcome, then half-close (flush()).
      this.halfCloseHeld = true;
      this.holdTimer = setTimeout(() => {
        this.holdTimer = null;
        this.halfCloseHeld = false;
        this.flush();
      }, STOP_WELCOME_WAIT_MS);
    }
    const deadline = welcome.ack_deadline_ms ?? 0;
    if (deadline > 0 && this.extendTimer === null) {
      this.extendTimer = setInterval(() => this.extend(), deadline / 3);
    }
    ctx.logger.info(
      `consumer ${ctx.consumerId} connected to ${this.endpoint}: ${welcome.topic ?? ""}[${partition}], ` +
        `credits ${this.credits}, ack deadline ${deadline} ms, max attempts ${welcome.max_attempts ?? 0}`,
    );
  }

  /** The lease ticker: one Extend listing every offset this stream holds right now. */
  private extend(): void {
    const call = this.call;
    const leases = this.account.leases;
    if (call === null || this.halfClosed || leases.size === 0) {
      return;
    }
    const offsets = [...leases].sort((a, b) => a - b);
    call.write({ extend: { offsets } });
    this.extended += offsets.length;
  }

  private onDeliveries(batch: Deliveries): void {
    const topic = batch.topic ?? "";
    const partition = batch.partition ?? 0;
    const deliveries = batch.deliveries ?? [];
    // The packed ones first, then the repeated ones appended, as the Python client does:
    // a frame from a current proxy is all packed, and its array is used as it is.
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
    const count = messages.length;
    this.established = true;
    this.delivered += count;
    this.held += count;
    if (this.held > this.credits && !this.overWarned) {
      this.overWarned = true;
      this.ctx.logger.warn(
        `consumer ${this.ctx.consumerId}: proxy sent ${this.held} unsettled deliveries, more than the ${this.credits} credits`,
      );
    }
    if (this.ctx.stopping()) {
      this.dropped += count; // released: the proxy redelivers them
      this.ctx.pool.ledger.release(this.account, messages);
      this.scheduleFlush();
      return;
    }
    const isolated = batch.isolated;
    if (isolated !== undefined && isolated.length > 0) {
      this.isolate(messages, isolated);
      return;
    }
    this.ctx.pool.submit(this.account, messages);
  }

  /**
   * Deliveries of a frame that flags some isolated: those wait for the process's turn
   * (isolation.ts), the rest go to the pool as usual.
   */
  private isolate(messages: Message[], isolated: readonly number[]): void {
    const flagged = new Set(isolated);
    const held = messages.filter((m) => flagged.has(m.offset));
    this.ctx.pool.submit(
      this.account,
      messages.filter((m) => !flagged.has(m.offset)),
    );
    if (held.length === 0) {
      return;
    }
    this.ctx.pool.isolate(this.account, held);
    const epoch = this.account.epoch;
    for (const message of held) {
      GATE.enter(new Ticket(this, message, epoch, (ticket) => this.onTurn(ticket)));
    }
  }

  /** `ticket`'s turn came: ask the proxy to record it started. */
  private onTurn(ticket: Ticket): void {
    const call = this.call;
    if (
      ticket.epoch !== this.account.epoch ||
      call === null ||
      this.halfClosed ||
      this.ctx.stopping()
    ) {
      GATE.leave(ticket); // its connection ended (the proxy redelivers it), or stop() began
      return;
    }
    this.turn = ticket;
    call.write({ started: { offsets: [ticket.message.offset] } });
  }

  /** The proxy recorded the Started: the delivery takes the next handler slot. */
  private onStarted(offsets: readonly number[]): void {
    const turn = this.turn;
    if (turn === null || turn.started || !offsets.includes(turn.message.offset)) {
      return;
    }
    turn.started = true;
    if (!this.ctx.pool.runIsolated(this.account, turn.message)) {
      this.turn = null; // given back meanwhile
      GATE.leave(turn);
    }
  }

  // -- settlements ----------------------------------------------------------------------------

  /** A handler of this stream finished: send now if the batch is full, soon otherwise. */
  afterSettle(queueDrained: boolean): void {
    const account = this.account;
    const pending = account.acks.length + account.nacks.length;
    if (pending === 0) {
      if (this.ctx.stopping() && account.outstanding === 0) {
        this.scheduleFlush(); // let the stream half-close
      }
      return;
    }
    if (pending >= this.batchLimit) {
      this.flush();
    } else if (queueDrained || this.ctx.stopping()) {
      this.scheduleFlush();
    } else if (this.flushTimer === null && this.call !== null) {
      this.flushTimer = setTimeout(() => {
        this.flushTimer = null;
        this.flush();
      }, SETTLE_DELAY_MS);
    }
  }

  /** Flush on the next turn of the event loop: every result of this turn shares the frame. */
  private scheduleFlush(): void {
    if (this.flushSoon === null && this.call !== null) {
      this.flushSoon = setImmediate(() => {
        this.flushSoon = null;
        this.flush();
      });
    }
  }

  private flush(): void {
    const call = this.call;
    if (call === null || this.halfClosed) {
      return;
    }
    const account = this.account;
    const ledger = this.ctx.pool.ledger;
    if (account.releases.length > 0 || this.releaseDue) {
      const offsets = ledger.takeReleases(account);
      this.releaseDue = false;
      this.held -= offsets.length;
      call.write({ release: { offsets } });
    }
    if (account.acks.length > 0 || account.nacks.length > 0) {
      const [acks, nacks] = ledger.takeSettlements(account);
      if (this.flushTimer !== null) {
        clearTimeout(this.flushTimer);
        this.flushTimer = null;
      }
      this.held -= acks.length + nacks.length;
      call.write({ settle: this.ackRanges ? settleFrame(acks, nacks) : { acks, nacks } });
      this.acked += acks.length;
      this.nacked += nacks.length;
      const turn = this.turn;
      if (turn !== null && turn.started) {
        const offset = turn.message.offset;
        if (acks.includes(offset) || nacks.some((n) => n.offset === offset)) {
          this.turn = null;
          GATE.leave(turn); // its result is on the wire: the next one's turn
        }
      }
    }
    if (
      this.ctx.stopping() &&
      account.outstanding === 0 &&
      this.established &&
      !this.halfCloseHeld
    ) {
      this.halfClosed = true;
      call.end();
      this.ctx.logger.debug(
        `consumer ${this.ctx.consumerId}: ${this.label}: final settlements sent, half-closed`,
      );
      this.closeTimer = setTimeout(() => {
        this.ctx.logger.warn(
          `consumer ${this.ctx.consumerId}: proxy did not end the stream for ${this.label} ` +
            `${CLOSE_TIMEOUT_MS / 1000} s after half-close`,
        );
        call.cancel();
      }, CLOSE_TIMEOUT_MS);
    }
  }
}
