/**
 * What one partition stream sends after its Hello: Release, Settle, Extend and the half-close
 * (Started is the isolation turn's, isolation.ts). The same rules as the Python client's
 * writer.py.
 *
 * Settlements are batched, never one frame per result: a batch goes out when it is full
 * (SETTLE_BATCH, or the stream's credits if fewer), when the stream's local queue drains
 * (the moment the proxy's next batch is needed; sent on the next turn of the event loop, so
 * every handler that finished in this turn shares the frame), or SETTLE_DELAY_MS after its
 * first result otherwise. When the Welcome says the proxy understands them (`ack_ranges`),
 * runs of consecutive acks go as offset ranges (`settleFrame`).
 *
 * Leases: every third of the Welcome's ack deadline one Extend lists the offsets the stream
 * holds right then. An offset leaves the lease set before its result joins a batch, so it is
 * never extended after its settlement was sent.
 *
 * Shutdown: queued deliveries go back in a Release (sent even when empty: it also stops the
 * proxy sending more) -> the last settlements -> half-close -> the proxy ends the stream
 * (cancelled after CLOSE_TIMEOUT_MS if it does not).
 */

import type { ClientDuplexStream } from "@grpc/grpc-js";

import type { ConsumerFrame, Nack, OffsetRange, ProxyFrame, Settle } from "./proto";
import type { PartitionStream, StreamContext } from "./stream";

export type Call = ClientDuplexStream<ConsumerFrame, ProxyFrame>;

/** Settlements sent at once without waiting for the queue to drain. */
export const SETTLE_BATCH = 256;
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

/** The sending side of one PartitionStream, kept across its connections. */
export class StreamWriter {
  /** The connection's call (null between connections). */
  call: Call | null = null;
  /** The half-close was sent: nothing more is written on this connection. */
  halfClosed = false;
  /** Offsets settled or released on this connection (the stream's `held` subtracts them). */
  settled = 0;
  acked = 0;
  nacked = 0;
  extended = 0;

  private batchLimit = 1;
  /**
   * stop() began on an established stream: the next flush sends a Release even if it lists
   * nothing, because the Release is what sets the stream's credits to 0. Without it the
   * proxy refills the credits each final settlement frees, and what it sends then arrives
   * after the half-close: held at the stream's end, each counts as a failed attempt.
   */
  private releaseDue = false;
  /**
   * A Welcome arrived during stop(): flush() does not half-close until holdTimer has waited
   * STOP_WELCOME_WAIT_MS. A flag cleared by that timer, not a Date.now() deadline: a timer
   * may fire a millisecond before Date.now() reaches its due time (libuv measures from its
   * cached loop time) and the wall clock may step back, and a flush that found the deadline
   * not yet passed was the last one: nothing scheduled another, so stop() never resolved.
   */
  private halfCloseHeld = false;
  private holdTimer: NodeJS.Timeout | null = null;
  private flushTimer: NodeJS.Timeout | null = null;
  private flushSoon: NodeJS.Immediate | null = null;
  private extendTimer: NodeJS.Timeout | null = null;
  private closeTimer: NodeJS.Timeout | null = null;

  constructor(
    private readonly stream: PartitionStream,
    private readonly ctx: StreamContext,
  ) {}

  /** A new connection with `credits` said Hello on `call`. */
  connected(call: Call, credits: number): void {
    this.call = call;
    this.halfClosed = false;
    this.halfCloseHeld = false;
    this.settled = 0;
    this.batchLimit = Math.min(SETTLE_BATCH, credits);
  }

  /** The connection ended: its timers stop, what was due on it is void. */
  ended(): void {
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
    this.releaseDue = false;
  }

  /** stop() began: send a Release (even empty) and drain; a connection still waiting for its
   * Welcome is cancelled after STOP_CONNECT_GRACE_MS. */
  beginStop(): void {
    const call = this.call;
    this.releaseDue = call !== null;
    if (call !== null && !this.stream.established && this.closeTimer === null) {
      // Connecting: the Release follows the Hello; wait a little for the Welcome, and do not
      // wait long for a slow connect.
      this.closeTimer = setTimeout(() => {
        if (!this.stream.established) {
          call.cancel();
        }
      }, STOP_CONNECT_GRACE_MS);
    }
    this.scheduleFlush();
  }

  /** The Welcome came: extend leases every third of `deadlineMs` (0: never); during stop(),
   * release what the proxy sent behind it before half-closing. */
  welcomed(deadlineMs: number): void {
    if (this.ctx.stopping() && this.holdTimer === null) {
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
    if (deadlineMs > 0 && this.extendTimer === null) {
      this.extendTimer = setInterval(() => this.extend(), deadlineMs / 3);
    }
  }

  /** Send a Started for the isolated delivery at `offset`; false when nothing can be sent. */
  started(offset: number): boolean {
    const call = this.call;
    if (call === null || this.halfClosed) {
      return false;
    }
    call.write({ started: { offsets: [offset] } });
    return true;
  }

  /** The lease ticker: one Extend listing every offset the stream holds right now. */
  private extend(): void {
    const call = this.call;
    const leases = this.stream.account.leases;
    if (call === null || this.halfClosed || leases.size === 0) {
      return;
    }
    const offsets = [...leases].sort((a, b) => a - b);
    call.write({ extend: { offsets } });
    this.extended += offsets.length;
  }

  /** A handler of the stream finished: send now if the batch is full, soon otherwise. */
  afterSettle(queueDrained: boolean): void {
    const account = this.stream.account;
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
  scheduleFlush(): void {
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
    const stream = this.stream;
    const account = stream.account;
    const ledger = this.ctx.pool.ledger;
    if (account.releases.length > 0 || this.releaseDue) {
      const offsets = ledger.takeReleases(account);
      this.releaseDue = false;
      this.settled += offsets.length;
      call.write({ release: { offsets } });
    }
    if (account.acks.length > 0 || account.nacks.length > 0) {
      const [acks, nacks] = ledger.takeSettlements(account);
      if (this.flushTimer !== null) {
        clearTimeout(this.flushTimer);
        this.flushTimer = null;
      }
      this.settled += acks.length + nacks.length;
      call.write({ settle: stream.ackRanges ? settleFrame(acks, nacks) : { acks, nacks } });
      this.acked += acks.length;
      this.nacked += nacks.length;
      stream.settlementsSent(acks, nacks);
    }
    if (
      this.ctx.stopping() &&
      account.outstanding === 0 &&
      stream.established &&
      !this.halfCloseHeld
    ) {
      this.halfClosed = true;
      call.end();
      this.ctx.logger.debug(
        `consumer ${this.ctx.consumerId}: ${stream.label}: final settlements sent, half-closed`,
      );
      this.closeTimer = setTimeout(() => {
        this.ctx.logger.warn(
          `consumer ${this.ctx.consumerId}: proxy did not end the stream for ${stream.label} ` +
            `${CLOSE_TIMEOUT_MS / 1000} s after half-close`,
        );
        call.cancel();
      }, CLOSE_TIMEOUT_MS);
    }
  }
}
