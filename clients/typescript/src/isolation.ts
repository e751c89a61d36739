/**
 * The isolation gate: one isolated delivery at a time in the whole process (the same design
 * as the Python client's isolation.py).
 *
 * A proxy flags a suspect (a record whose earlier holder vanished) as isolated
 * (`Deliveries.isolated`) to a client whose Hello set `isolation`. When this process crashes,
 * each of its streams' proxies blames only the isolated delivery that stream reported started;
 * so the process runs at most one isolated delivery at a time, across all its streams and
 * Consumers (one process holds streams to several proxies, and a crash pill on one partition
 * takes down the handlers of every other one):
 *
 *     Deliveries.isolated -> Ticket -> GATE.enter -> (its turn) stream's onTurn
 *         -> Started(offset) -> the proxy records it and answers Started -> handler slot
 *         -> its Settle written -> GATE.leave -> the next ticket's turn
 *
 * The others wait here, queued and leased (their offsets are in the Extend), never started:
 * if the process dies meanwhile, nobody blames them. A ticket leaves early when its stream ends
 * (the proxy redelivers what it held) or gives it back unstarted.
 */

import type { Message } from "./message";

/** One isolated delivery waiting for (or holding) the process's turn. */
export class Ticket {
  /** The proxy answered its Started: it is in (or next for) a handler slot. */
  started = false;

  constructor(
    /** The stream it came on (`drop` removes a stream's tickets). */
    readonly owner: object,
    readonly message: Message,
    /** The stream's connection it came on: stale once that connection ended. */
    readonly epoch: number,
    /** Called (on a later microtask) when the ticket's turn comes. */
    readonly onTurn: (ticket: Ticket) => void,
  ) {}
}

/** At most one ticket holds the turn; the rest wait in arrival order. */
export class IsolationGate {
  private waitingList: Ticket[] = [];
  private holding: Ticket | null = null;

  /** The ticket whose turn it is (null: nobody's). */
  get holder(): Ticket | null {
    return this.holding;
  }

  /** Tickets waiting for their turn. */
  get waiting(): number {
    return this.waitingList.length;
  }

  /** Queue `ticket`; its turn comes when every ticket before it has left. */
  enter(ticket: Ticket): void {
    this.waitingList.push(ticket);
    this.next();
  }

  /**
   * `ticket` is done (its result was sent, or it will never start): the next one's turn. A
   * ticket that does not hold the turn is just taken out of the queue.
   */
  leave(ticket: Ticket): void {
    if (this.holding === ticket) {
      this.holding = null;
      this.next();
    } else {
      const index = this.waitingList.indexOf(ticket);
      if (index >= 0) {
        this.waitingList.splice(index, 1);
      }
    }
  }

  /** `owner` is stopping: its waiting tickets go (it gave them back unstarted). */
  dropWaiting(owner: object): void {
    this.waitingList = this.waitingList.filter((t) => t.owner !== owner);
  }

  /** `owner`'s connection ended: its tickets go (the proxy redelivers them). */
  drop(owner: object): void {
    this.dropWaiting(owner);
    if (this.holding !== null && this.holding.owner === owner) {
      this.holding = null;
      this.next();
    }
  }

  private next(): void {
    if (this.holding !== null) {
      return;
    }
    const ticket = this.waitingList.shift();
    if (ticket === undefined) {
      return;
    }
    this.holding = ticket;
    queueMicrotask(() => ticket.onTurn(ticket));
  }
}

/** The process's gate, shared by every Consumer in it. */
export const GATE = new IsolationGate();
