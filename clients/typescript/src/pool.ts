/**
 * The handler pool: `concurrency` slots shared by every partition stream of one Consumer.
 *
 * Each stream keeps its own local queue of deliveries waiting for a slot, in the pool's ledger
 * (ledger.ts: the counts the pool and the streams share, changed only by its methods). When a
 * slot frees, the pool takes the next delivery from the stream with the fewest handlers running right
 * now (ties go round-robin), so a partition with a backlog of slow messages holds at most
 * its fair share of the slots while another partition has work: it never starves the others.
 *
 * A handler is called on the event loop; a returned promise (any thenable) is awaited, a
 * plain return value settles at once, so a synchronous no-op handler costs no promise at
 * all. Results go to the stream the delivery came on, which batches them into Settle frames;
 * a result whose stream broke meanwhile (an older epoch) is dropped and counted: the proxy
 * redelivers whatever a broken stream held.
 */

import { Retry } from "./errors";
import { MAX_REASON_CHARS } from "./generated/constants";
import { GATE, type IsolationGate } from "./isolation";
import { type Account, Ledger } from "./ledger";
import type { Message } from "./message";
import type { Nack } from "./proto";

/** Returning (or resolving) acks the message; throwing (or rejecting) nacks it. */
export type Handler = (message: Message) => unknown;

/** A class of errors that nack with retry (as `Retry` always does). */
export type ErrorClass = abstract new (...args: never[]) => unknown;

/** The proxy keeps the first 4,000 characters of a nack reason; longer ones are cut here. */
export { MAX_REASON_CHARS };

/** The nack reason for what a handler threw: `Name: message`, bounded and valid UTF-8. */
export function nackReason(error: unknown): string {
  let text: string;
  try {
    if (error instanceof Error) {
      text = `${errorName(error)}: ${error.message}`;
    } else {
      text = `Error: ${String(error)}`;
    }
  } catch {
    text = "Error: <unprintable>"; // a throwing toString must not lose the nack
  }
  // protobuf strings are UTF-8: a lone surrogate would make the frame invalid for the proxy
  text = toWellFormed(text);
  if (text.length > MAX_REASON_CHARS) {
    // Cut by code points, as the proxy counts characters, never inside a surrogate pair.
    const points = Array.from(text);
    if (points.length > MAX_REASON_CHARS) {
      text = points.slice(0, MAX_REASON_CHARS - 3).join("") + "...";
    }
  }
  return text;
}

/** `error.name`, or its class's name when a subclass left `name` as the inherited "Error". */
function errorName(error: Error): string {
  const own = error.name;
  if (own && own !== "Error") {
    return own;
  }
  const cls = (error.constructor as { name?: unknown } | undefined)?.name;
  return typeof cls === "string" && cls ? cls : own || "Error";
}

function toWellFormed(text: string): string {
  const native = (text as { toWellFormed?: () => string }).toWellFormed;
  if (native !== undefined) {
    return native.call(text);
  }
  return text.replace(
    /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/g,
    "\uFFFD",
  );
}

function isThenable(value: unknown): value is PromiseLike<unknown> {
  return (
    value !== null &&
    (typeof value === "object" || typeof value === "function") &&
    typeof (value as { then?: unknown }).then === "function"
  );
}

/** `concurrency` handler slots fed by every stream's local queue (see the module doc). */
export class HandlerPool {
  /** What each stream has queued, running and finished (ledger.ts). */
  readonly ledger: Ledger;
  private running = 0;
  private pumping = false; // pump() is on the stack: a handler settling inside it must not recurse
  private drainedWaiters: (() => void)[] = [];

  constructor(
    private readonly handler: Handler,
    private readonly concurrency: number,
    private readonly retryOn: readonly ErrorClass[],
    /** The process's isolation gate (a test gives its own). */
    private readonly gate: IsolationGate = GATE,
  ) {
    this.ledger = new Ledger(gate);
  }

  /** The Consumer starts: a hush ending (isolation.ts) puts idle slots to work on what waited. */
  start(): void {
    this.gate.listen(
      this,
      () => this.pump(),
      () => this.running,
    );
  }

  /** The Consumer stopped: no more hush ends to hear of. Safe twice. */
  close(): void {
    this.gate.unlisten(this);
  }

  /** Deliveries queued or running, of any stream and epoch. */
  get outstanding(): number {
    return this.ledger.outstanding;
  }

  /** Resolves once nothing is queued or running (at once if nothing is). */
  drained(): Promise<void> {
    if (this.ledger.outstanding === 0) {
      return Promise.resolve();
    }
    return new Promise((resolve) => this.drainedWaiters.push(resolve));
  }

  /** Queue a stream's new deliveries for the slots. */
  submit(account: Account, messages: Message[]): void {
    if (messages.length === 0) {
      return;
    }
    this.ledger.queue(account, messages);
    this.pump();
  }

  /** Hold a stream's isolated deliveries back until their turn (`runIsolated`). */
  isolate(account: Account, messages: Message[]): void {
    this.ledger.hold(account, messages);
  }

  /**
   * An isolated delivery's turn came and the proxy recorded it started: it takes the next free
   * slot of its stream. False if its stream no longer holds it back.
   */
  runIsolated(account: Account, message: Message): boolean {
    if (!this.ledger.admit(account, message)) {
      return false;
    }
    this.pump();
    return true;
  }

  /** Remove a stream's queued, unstarted deliveries (`Ledger.takeBack`). */
  takeBack(account: Account, nextEpoch = false): Message[] {
    const taken = this.ledger.takeBack(account, nextEpoch);
    this.checkDrained();
    return taken;
  }

  /** Start handlers while slots are free and deliveries are queued. */
  private pump(): void {
    if (this.pumping) {
      return;
    }
    this.pumping = true;
    const ledger = this.ledger;
    try {
      while (this.running < this.concurrency && ledger.ready) {
        const account = ledger.pick();
        this.startHandler(account, ledger.take(account));
      }
    } finally {
      this.pumping = false;
    }
  }

  private startHandler(account: Account, message: Message): void {
    this.running += 1;
    const epoch = account.epoch;
    const leases = account.leases; // this epoch's: see Account.leases
    const offset = message.offset;
    let result: unknown;
    try {
      result = this.handler(message);
    } catch (error) {
      this.finish(account, epoch, leases, offset, this.nack(offset, error));
      return;
    }
    if (isThenable(result)) {
      result.then(
        () => this.finish(account, epoch, leases, offset, null),
        (error: unknown) => this.finish(account, epoch, leases, offset, this.nack(offset, error)),
      );
    } else {
      this.finish(account, epoch, leases, offset, null);
    }
  }

  private nack(offset: number, error: unknown): Nack {
    const retry =
      error instanceof Retry ||
      this.retryOn.some((cls) => error instanceof (cls as unknown as typeof Error));
    return { offset, reason: nackReason(error), retry };
  }

  private finish(
    account: Account,
    epoch: number,
    leases: ReadonlySet<number>,
    offset: number,
    nack: Nack | null,
  ): void {
    this.running -= 1;
    account.stream.afterSettle(this.ledger.finished(account, epoch, leases, offset, nack));
    this.checkDrained();
    this.pump();
  }

  private checkDrained(): void {
    if (this.ledger.outstanding === 0 && this.drainedWaiters.length > 0) {
      const waiters = this.drainedWaiters;
      this.drainedWaiters = [];
      for (const resolve of waiters) {
        resolve();
      }
    }
  }
}
