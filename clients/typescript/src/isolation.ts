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
 *     Deliveries.isolated -> Ticket -> GATE.enter -> (its turn) GATE.hush
 *         -> (no other handler runs, or HUSH_MS passed)
 *         -> Started(offset) -> the proxy records it and answers Started -> handler slot
 *         -> its Settle written -> GATE.leave -> the next ticket's turn
 *
 * The others wait here, queued and leased (their offsets are in the Extend), never started:
 * if the process dies meanwhile, nobody blames them. A ticket leaves early when its stream ends
 * (the proxy redelivers what it held) or gives it back unstarted.
 *
 * The hush: from a ticket's turn until it leaves (its Settle written, or its stream ended or
 * gave it back), the process's handler pools start no other delivery (`IsolationGate.hushed`),
 * and the Started waits until the handlers already running are done; each wait HUSH_MS at
 * most. Why: a crash while the isolated delivery is started is blamed on it, and a crash pill
 * on its first delivery (not isolated: nobody suspects it yet) would otherwise crash the
 * process in that time: one already running that crashes late, or one the process picks from
 * a batch arriving meanwhile. In a crash storm (each restarted process gets the same
 * smallest-offset suspect and a batch holding a new pill) one healthy suspect would be blamed
 * again and again until dead-lettered. With the hush, a pill that was running has crashed the
 * process before the Started was sent, and one that arrives later waits.
 */

import type { Message } from "./message";
import type { Nack } from "./proto";
import type { PartitionStream, StreamContext } from "./stream";
import type { StreamWriter } from "./writer";

/**
 * Longest the process starts nothing new for an isolated delivery (`IsolationGate.hush`), and
 * longest its Started waits for the handlers already running (`StreamTurn.whenQuiet`). A
 * suspect of up to about a second runs alone, so a crash pill on its first delivery can neither
 * start beside it nor, already running, crash after its Started and get it blamed. A slower one
 * runs on beside the others after it, so a process working through a crash's suspects of many
 * seconds each keeps its throughput. The price is time after a crash (the Python client's
 * HUSH_S, measured there).
 */
export const HUSH_MS = 1000;

/**
 * How often an isolated delivery whose turn came looks whether the handlers already running in
 * the process are done (then its Started goes out).
 */
const QUIET_POLL_MS = 5;

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
  private hushing: Message | null = null;
  private hushFor: Ticket | null = null;
  private hushTimer: NodeJS.Timeout | null = null;
  private readonly listeners = new Map<object, { onUnhush: () => void; running: () => number }>();

  /** `hushMs`: the longest hush (HUSH_MS; a test that must not see it end sets more). */
  constructor(readonly hushMs = HUSH_MS) {}

  /**
   * The isolated delivery the process is hushed for (`hush`): the pools start only it; null:
   * they start anything.
   */
  get hushed(): Message | null {
    return this.hushing;
  }

  /** The ticket whose turn it is (null: nobody's). */
  get holder(): Ticket | null {
    return this.holding;
  }

  /** Tickets waiting for their turn. */
  get waiting(): number {
    return this.waitingList.length;
  }

  /**
   * `owner` (a handler pool) wants `onUnhush` called (on a later microtask) when a hush ends;
   * `running` says how many handlers it runs (`quiet`).
   */
  listen(owner: object, onUnhush: () => void, running: () => number = () => 0): void {
    this.listeners.set(owner, { onUnhush, running });
  }

  /** No handler runs in any pool of the process. */
  quiet(): boolean {
    for (const { running } of this.listeners.values()) {
      if (running() > 0) {
        return false;
      }
    }
    return true;
  }

  unlisten(owner: object): void {
    this.listeners.delete(owner);
  }

  /**
   * `ticket`'s turn came: the process starts nothing else until it leaves, or for HUSH_MS from
   * now. Unbounded (`bounded` false) for a caller that bounds the wait itself and then hushes
   * again with the bound (StreamTurn: the Started's wait, then the run).
   */
  hush(ticket: Ticket, bounded = true): void {
    if (this.holding !== ticket) {
      return;
    }
    this.hushFor = ticket;
    this.hushing = ticket.message;
    if (bounded) {
      this.hushTimer = setTimeout(() => this.unhush(ticket), this.hushMs);
      this.hushTimer.unref(); // a hush never keeps the process alive
    }
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
      this.unhush(ticket);
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
    const holder = this.holding;
    if (holder !== null && holder.owner === owner) {
      this.holding = null;
      this.unhush(holder);
      this.next();
    }
  }

  /** `ticket`'s hush is over (it left, or HUSH_MS passed): every pool's idle slots go to work. */
  private unhush(ticket: Ticket | null): void {
    if (ticket === null || this.hushFor !== ticket) {
      return;
    }
    if (this.hushTimer !== null) {
      clearTimeout(this.hushTimer);
      this.hushTimer = null;
    }
    this.hushFor = null;
    this.hushing = null;
    for (const { onUnhush } of this.listeners.values()) {
      queueMicrotask(onUnhush); // not inside the caller: a pool may be mid-pump
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
    /** The process's isolation gate (a test gives its own). */
    private readonly gate: IsolationGate = GATE,
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
      this.gate.enter(new Ticket(this.stream, message, epoch, (ticket) => this.onTurn(ticket)));
    }
  }

  /** `ticket`'s turn came: ask the proxy to record it started. */
  private onTurn(ticket: Ticket): void {
    if (ticket.epoch !== this.stream.account.epoch || this.ctx.stopping()) {
      this.gate.leave(ticket); // its connection ended (the proxy redelivers it), or stop() began
      return;
    }
    this.gate.hush(ticket, false); // nothing new starts; `whenQuiet` bounds the wait
    this.turn = ticket;
    this.whenQuiet(ticket, performance.now() + this.gate.hushMs);
  }

  /**
   * Send `ticket`'s Started once no other handler runs in the process, or at `deadline`. Why
   * wait: a crash is blamed on the started isolated delivery, and a crash pill already running
   * (on its first delivery, so not isolated) that crashes late would get this one blamed. While
   * it waits the process is hushed, so the handlers running can only finish; one that crashes
   * costs this one nothing.
   */
  private whenQuiet(ticket: Ticket, deadline: number): void {
    if (this.turn !== ticket || ticket.started) {
      return; // given back, or its connection ended, meanwhile
    }
    if (ticket.epoch !== this.stream.account.epoch || this.ctx.stopping()) {
      this.turn = null;
      this.gate.leave(ticket);
      return;
    }
    if (!this.gate.quiet() && performance.now() < deadline) {
      setTimeout(() => this.whenQuiet(ticket, deadline), QUIET_POLL_MS).unref();
      return;
    }
    this.gate.hush(ticket); // the bound, for its own run
    if (!this.writer.started(ticket.message.offset)) {
      this.turn = null;
      this.gate.leave(ticket); // its connection ended: the proxy redelivers it
    }
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
      this.gate.leave(turn);
    }
  }

  /** The writer sent these results: an isolated delivery among them passes its turn on. */
  settled(acks: readonly number[], nacks: readonly Nack[]): void {
    const turn = this.turn;
    if (turn !== null && turn.started) {
      const offset = turn.message.offset;
      if (acks.includes(offset) || nacks.some((n) => n.offset === offset)) {
        this.turn = null;
        this.gate.leave(turn); // its result is on the wire: the next one's turn
      }
    }
  }

  /** stop() began: a turn not started yet, and the tickets waiting, go. */
  giveBack(): void {
    const turn = this.turn;
    if (turn !== null && !turn.started) {
      this.turn = null;
      this.gate.leave(turn); // given back unstarted
    }
    this.gate.dropWaiting(this.stream);
  }

  /**
   * The connection ended (`leases`: its running offsets, `taken`: the queued ones taken
   * back): the proxy redelivers the waiting tickets; a started turn passes on once its
   * handler, if it still runs, is done.
   */
  connectionEnded(leases: ReadonlySet<number>, taken: readonly Message[]): void {
    this.gate.dropWaiting(this.stream); // a pending turn sees its epoch
    const turn = this.turn;
    this.turn = null;
    if (turn !== null) {
      if (turn.started && leases.has(turn.message.offset) && !taken.includes(turn.message)) {
        leaveWhenDone(this.gate, turn, leases); // its handler still runs
      } else {
        this.gate.leave(turn);
      }
    }
  }
}

/**
 * The turn passes on once `turn`'s handler, still running though its connection ended, is
 * done (its offset leaves the ended connection's lease set): until then it is the process's
 * one started isolated delivery, and may still crash it.
 */
function leaveWhenDone(gate: IsolationGate, turn: Ticket, leases: ReadonlySet<number>): void {
  if (!leases.has(turn.message.offset)) {
    gate.leave(turn);
    return;
  }
  setTimeout(() => leaveWhenDone(gate, turn, leases), TURN_POLL_MS).unref();
}
