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
import type { Nack } from "./proto";
import type { PartitionStream, StreamContext } from "./stream";
import type { StreamWriter } from "./writer";

/**
 * How often a stream whose connection ended looks whether its isolated delivery's handler,
 * still running, is done (then the process's turn passes on).
 */
const TURN_POLL_MS = 50;

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

/**
 * One stream's side of the gate: its isolated deliveries wait here for the process's turn,
 * then Started is sent; the turn passes on when its Settle is written, or when the connection
 * ends (once a handler still running on it is done). As the Python client's StreamTurn.
 */
export class StreamTurn {
  /** This stream's isolated delivery holding the turn. */
  private turn: Ticket | null = null;

  constructor(
    private readonly stream: PartitionStream,
    private readonly ctx: StreamContext,
    private readonly writer: StreamWriter,
  ) {}

  /**
   * Deliveries of a frame that flags some isolated: those wait for the process's turn, the
   * rest go to the pool as usual.
   */
  isolate(messages: Message[], isolated: readonly number[]): void {
    const account = this.stream.account;
    const flagged = new Set(isolated);
    const held = messages.filter((m) => flagged.has(m.offset));
    this.ctx.pool.submit(
      account,
      messages.filter((m) => !flagged.has(m.offset)),
    );
    if (held.length === 0) {
      return;
    }
    this.ctx.pool.isolate(account, held);
    const epoch = account.epoch;
    for (const message of held) {
      GATE.enter(new Ticket(this.stream, message, epoch, (ticket) => this.onTurn(ticket)));
    }
  }

  /** `ticket`'s turn came: ask the proxy to record it started. */
  private onTurn(ticket: Ticket): void {
    if (
      ticket.epoch !== this.stream.account.epoch ||
      this.ctx.stopping() ||
      !this.writer.started(ticket.message.offset)
    ) {
      GATE.leave(ticket); // its connection ended (the proxy redelivers it), or stop() began
      return;
    }
    this.turn = ticket;
  }

  /** The proxy recorded the Started: the delivery takes the next handler slot. */
  onStarted(offsets: readonly number[]): void {
    const turn = this.turn;
    if (turn === null || turn.started || !offsets.includes(turn.message.offset)) {
      return;
    }
    turn.started = true;
    if (!this.ctx.pool.runIsolated(this.stream.account, turn.message)) {
      this.turn = null; // given back meanwhile
      GATE.leave(turn);
    }
  }

  /** The writer sent these results: an isolated delivery among them passes its turn on. */
  settled(acks: readonly number[], nacks: readonly Nack[]): void {
    const turn = this.turn;
    if (turn !== null && turn.started) {
      const offset = turn.message.offset;
      if (acks.includes(offset) || nacks.some((n) => n.offset === offset)) {
        this.turn = null;
        GATE.leave(turn); // its result is on the wire: the next one's turn
      }
    }
  }

  /** stop() began: a turn not started yet, and the tickets waiting, go. */
  giveBack(): void {
    const turn = this.turn;
    if (turn !== null && !turn.started) {
      this.turn = null;
      GATE.leave(turn); // given back unstarted
    }
    GATE.dropWaiting(this.stream);
  }

  /**
   * The connection ended (`leases`: its running offsets, `taken`: the queued ones taken
   * back): the proxy redelivers the waiting tickets; a started turn passes on once its
   * handler, if it still runs, is done.
   */
  connectionEnded(leases: ReadonlySet<number>, taken: readonly Message[]): void {
    GATE.dropWaiting(this.stream); // a pending turn sees its epoch
    const turn = this.turn;
    this.turn = null;
    if (turn !== null) {
      if (turn.started && leases.has(turn.message.offset) && !taken.includes(turn.message)) {
        leaveWhenDone(turn, leases); // its handler still runs
      } else {
        GATE.leave(turn);
      }
    }
  }
}

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
