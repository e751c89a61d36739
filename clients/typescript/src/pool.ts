/**
 * The handler pool: `concurrency` slots shared by every partition stream of one Consumer.
 *
 * Each stream keeps its own local queue of deliveries waiting for a slot. When a slot frees,
 * the pool takes the next delivery from the stream with the fewest handlers running right
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
import type { Message } from "./message";
import type { Nack } from "./proto";
import type { PartitionStream } from "./stream";

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
  /** Deliveries queued or running, of any stream and epoch. */
  outstanding = 0;
  private running = 0;
  private readonly ready: PartitionStream[] = []; // streams with queued deliveries
  private turn = 0; // where the next tie-break starts, for round-robin among equals
  private pumping = false; // pump() is on the stack: a handler settling inside it must not recurse
  private drainedWaiters: (() => void)[] = [];

  constructor(
    private readonly handler: Handler,
    private readonly concurrency: number,
    private readonly retryOn: readonly ErrorClass[],
  ) {}

  /** Resolves once nothing is queued or running (at once if nothing is). */
  drained(): Promise<void> {
    if (this.outstanding === 0) {
      return Promise.resolve();
    }
    return new Promise((resolve) => this.drainedWaiters.push(resolve));
  }

  /** Queue a stream's new deliveries for the slots. */
  submit(stream: PartitionStream, messages: Message[]): void {
    const count = messages.length;
    if (count === 0) {
      return;
    }
    this.outstanding += count;
    stream.outstanding += count;
    if (stream.queued === 0) {
      this.ready.push(stream);
    }
    // Leases cover queued deliveries too: they are in this instance's hands and will start
    // as soon as a slot frees, however long the running ones take.
    const leases = stream.leases;
    const queue = stream.queue;
    for (let i = 0; i < count; i++) {
      const message = messages[i]!;
      leases.add(message.offset);
      queue.push(message);
    }
    this.pump();
  }

  /**
   * Remove a stream's queued, unstarted deliveries: at stop(), or, with `nextEpoch`, because
   * its stream ended (then, in one step, results of handlers still running on it are marked
   * stale and the next stream gets a fresh lease set).
   */
  takeBack(stream: PartitionStream, nextEpoch = false): Message[] {
    if (nextEpoch) {
      stream.epoch += 1;
      stream.leases = new Set();
    }
    const taken = stream.queue.slice(stream.head);
    if (taken.length > 0) {
      stream.queue = [];
      stream.head = 0;
      const index = this.ready.indexOf(stream);
      if (index >= 0) {
        this.ready.splice(index, 1);
      }
      for (const message of taken) {
        stream.leases.delete(message.offset);
      }
    }
    this.outstanding -= taken.length;
    stream.outstanding -= taken.length;
    this.checkDrained();
    return taken;
  }

  /** Start handlers while slots are free and deliveries are queued. */
  private pump(): void {
    if (this.pumping) {
      return;
    }
    this.pumping = true;
    try {
      while (this.running < this.concurrency && this.ready.length > 0) {
        const stream = this.pick();
        this.start(stream, stream.take());
        if (stream.queued === 0) {
          const index = this.ready.indexOf(stream);
          if (index >= 0) {
            this.ready.splice(index, 1);
          }
        }
      }
    } finally {
      this.pumping = false;
    }
  }

  /** The stream whose queue gives the next delivery: fewest running handlers, ties round-robin. */
  private pick(): PartitionStream {
    const ready = this.ready;
    const count = ready.length;
    if (count === 1) {
      return ready[0]!;
    }
    const start = this.turn % count;
    let index = start;
    let fewest = ready[start]!.busy;
    for (let step = 1; step < count; step++) {
      const i = (start + step) % count;
      if (ready[i]!.busy < fewest) {
        index = i;
        fewest = ready[i]!.busy;
      }
    }
    this.turn = index + 1;
    return ready[index]!;
  }

  private start(stream: PartitionStream, message: Message): void {
    this.running += 1;
    stream.busy += 1;
    const epoch = stream.epoch;
    const leases = stream.leases; // this stream's: see PartitionStream.leases
    const offset = message.offset;
    let result: unknown;
    try {
      result = this.handler(message);
    } catch (error) {
      this.finish(stream, epoch, leases, offset, this.nack(offset, error));
      return;
    }
    if (isThenable(result)) {
      result.then(
        () => this.finish(stream, epoch, leases, offset, null),
        (error: unknown) => this.finish(stream, epoch, leases, offset, this.nack(offset, error)),
      );
    } else {
      this.finish(stream, epoch, leases, offset, null);
    }
  }

  private nack(offset: number, error: unknown): Nack {
    const retry =
      error instanceof Retry ||
      this.retryOn.some((cls) => error instanceof (cls as unknown as typeof Error));
    return { offset, reason: nackReason(error), retry };
  }

  private finish(
    stream: PartitionStream,
    epoch: number,
    leases: Set<number>,
    offset: number,
    nack: Nack | null,
  ): void {
    this.running -= 1;
    this.outstanding -= 1;
    stream.busy -= 1;
    leases.delete(offset);
    if (epoch !== stream.epoch) {
      stream.dropped += 1; // its stream broke: the proxy redelivers it
    } else {
      stream.outstanding -= 1;
      if (nack === null) {
        stream.acks.push(offset);
      } else {
        stream.nacks.push(nack);
      }
    }
    stream.afterSettle(stream.queued === 0);
    this.checkDrained();
    this.pump();
  }

  private checkDrained(): void {
    if (this.outstanding === 0 && this.drainedWaiters.length > 0) {
      const waiters = this.drainedWaiters;
      this.drainedWaiters = [];
      for (const resolve of waiters) {
        resolve();
      }
    }
  }
}
