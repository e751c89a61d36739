/**
 * The ledger of one Consumer's deliveries in hand: for each stream, what waits for a handler
 * slot, what runs, and what finished and waits to be sent in a Settle or Release.
 *
 * The handler pool owns the ledger; the streams ask it. A delivery's life is a sequence of
 * ledger calls:
 *
 *     stream's Deliveries -> pool.submit -> queue()   queued, leased, outstanding
 *     (an isolated one)   -> pool.isolate -> hold()   held back (isolation.ts), leased,
 *     its turn            -> pool.runIsolated         outstanding; then queued first
 *                            -> admit()
 *     a slot frees        -> pick() + take()          running (busy)
 *     handler done        -> finished()               acks / nacks, no longer outstanding
 *     stream's flush      -> takeSettlements() / takeReleases()
 *
 * Why one object: the pool and the stream both need these counts (the pool to choose the
 * next delivery and to know when everything drained, the stream to batch settlements, list
 * leases and stop), and when each changed the other's fields no one place said what the
 * counts mean or kept them consistent. Here only the ledger changes them: the `Account` the
 * others hold is read-only to them (the same design as the Python client's ledger.py).
 *
 * Costs: the per-delivery calls (`pick`, `take`, `finished`) work on the account the caller
 * already holds: no allocation and no lookup per delivery (V8 usually inlines hot calls this
 * small).
 */

import { GATE, type IsolationGate } from "./isolation";
import type { Message } from "./message";
import type { Nack } from "./proto";
import type { PartitionStream } from "./stream";

/** One stream's entries in the ledger, as the pool and the stream see them: read-only. */
export interface Account {
  /** The stream the entries are for (the pool tells it when results arrive). */
  readonly stream: PartitionStream;
  /** Bumped when the stream's connection ends: results of handlers started before are stale. */
  readonly epoch: number;
  /** Deliveries of the current epoch queued or running. */
  readonly outstanding: number;
  /** Deliveries waiting for a handler slot. */
  readonly queued: number;
  /** Handlers running in the pool's slots for this stream, any epoch. */
  readonly busy: number;
  /**
   * Offsets the stream holds, running or queued: the next Extend lists them. A new epoch gets
   * a new set, and a handler removes its offset from the set it started in, so one that
   * outlives its connection never touches the next one's leases.
   */
  readonly leases: ReadonlySet<number>;
  /** Offsets handled and not yet sent in a Settle. */
  readonly acks: readonly number[];
  /** Nacks not yet sent in a Settle. */
  readonly nacks: readonly Nack[];
  /** Deliveries given back unstarted at stop(), not yet sent in a Release. */
  readonly releases: readonly number[];
  /** Results dropped because their handler finished after its connection ended. */
  readonly dropped: number;
}

/** The ledger's own, writable view of an account. */
class Entry implements Account {
  epoch = 0;
  outstanding = 0;
  /** Isolated deliveries waiting for the process's turn (isolation.ts): not queued. */
  heldBack: Message[] = [];
  /** Deliveries waiting for a slot, from `head` on (taken from the front). */
  queue: Message[] = [];
  head = 0;
  busy = 0;
  leases = new Set<number>();
  acks: number[] = [];
  nacks: Nack[] = [];
  releases: number[] = [];
  dropped = 0;

  constructor(readonly stream: PartitionStream) {}

  get queued(): number {
    return this.queue.length - this.head;
  }
}

/** The counts the handler pool and its streams share (see the module doc). */
export class Ledger {
  private outstandingCount = 0;
  private readonly readyList: Entry[] = []; // accounts with queued deliveries
  private turn = 0; // where the next tie-break starts, for round-robin among equals
  /** The stream whose queue an isolated delivery was last admitted to the front of. */
  private admitted: Entry | null = null;

  constructor(
    /** While it is hushed for an isolated delivery, `pick` gives only that one. */
    private readonly gate: IsolationGate = GATE,
  ) {}

  /** Deliveries queued or running, of any stream and epoch. */
  get outstanding(): number {
    return this.outstandingCount;
  }

  /**
   * A free slot may start a delivery now: some stream has deliveries queued and, while the
   * process is hushed for an isolated delivery (isolation.ts), it is first in its stream's
   * queue here.
   */
  get ready(): boolean {
    return this.readyList.length > 0 && (this.gate.hushed === null || this.hushedReady());
  }

  /** A new stream's account. */
  open(stream: PartitionStream): Account {
    return new Entry(stream);
  }

  // -- the pool's side -----------------------------------------------------------------------

  /**
   * A stream's new deliveries wait for a slot. Leases cover queued deliveries too: they are in
   * this instance's hands and start as soon as a slot frees, however long the running ones take.
   */
  queue(account: Account, messages: readonly Message[]): void {
    const entry = account as Entry;
    const count = messages.length;
    if (count === 0) {
      return; // an empty queue must not be ready
    }
    this.outstandingCount += count;
    entry.outstanding += count;
    if (entry.queued === 0) {
      this.readyList.push(entry);
    }
    const leases = entry.leases;
    const queue = entry.queue;
    for (let i = 0; i < count; i++) {
      const message = messages[i]!;
      leases.add(message.offset);
      queue.push(message);
    }
  }

  /**
   * A stream's isolated deliveries wait for their turn (isolation.ts), leased and outstanding
   * like queued ones, but no slot takes them until `admit`.
   */
  hold(account: Account, messages: readonly Message[]): void {
    const entry = account as Entry;
    this.outstandingCount += messages.length;
    entry.outstanding += messages.length;
    for (const message of messages) {
      entry.leases.add(message.offset);
      entry.heldBack.push(message);
    }
  }

  /**
   * An isolated delivery's turn came: it goes first in its stream's queue. False when it is no
   * longer held back (its stream gave it back or its connection ended).
   */
  admit(account: Account, message: Message): boolean {
    const entry = account as Entry;
    const index = entry.heldBack.indexOf(message);
    if (index < 0) {
      return false;
    }
    entry.heldBack.splice(index, 1);
    if (entry.queued === 0) {
      this.readyList.push(entry);
    }
    if (entry.head > 0) {
      entry.head -= 1;
      entry.queue[entry.head] = message;
    } else {
      entry.queue.unshift(message);
    }
    this.admitted = entry;
    return true;
  }

  /**
   * The account whose queue gives the next delivery: fewest running handlers, ties
   * round-robin; while the process is hushed, the one whose queue starts with the isolated
   * delivery. Only while `ready`.
   */
  pick(): Account {
    if (this.gate.hushed !== null) {
      return this.admitted!;
    }
    const ready = this.readyList;
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

  /** The next queued delivery of `account` (one `pick` chose), counted as running. */
  take(account: Account): Message {
    const entry = account as Entry;
    const message = entry.queue[entry.head]!;
    entry.head += 1;
    if (entry.head === entry.queue.length) {
      entry.queue = [];
      entry.head = 0;
      this.unready(entry);
    } else if (entry.head >= 1024 && entry.head * 2 >= entry.queue.length) {
      entry.queue = entry.queue.slice(entry.head);
      entry.head = 0;
    }
    entry.busy += 1;
    return message;
  }

  /**
   * A handler is done with `offset`, taken at `epoch` with the lease set `leases`: its slot
   * frees and its result waits to be sent (null: ack), unless its connection ended meanwhile.
   * True when the stream has nothing queued behind it.
   */
  finished(
    account: Account,
    epoch: number,
    leases: ReadonlySet<number>,
    offset: number,
    nack: Nack | null,
  ): boolean {
    const entry = account as Entry;
    this.outstandingCount -= 1;
    entry.busy -= 1;
    (leases as Set<number>).delete(offset);
    if (epoch !== entry.epoch) {
      entry.dropped += 1; // its connection ended: the proxy redelivers it
    } else {
      entry.outstanding -= 1;
      if (nack === null) {
        entry.acks.push(offset);
      } else {
        entry.nacks.push(nack);
      }
    }
    return entry.queued === 0;
  }

  // -- the stream's side ---------------------------------------------------------------------

  /**
   * Remove a stream's queued and held-back, unstarted deliveries: at stop(), or, with `nextEpoch`, because
   * its connection ended; then, in one step, results of handlers still running on it are
   * marked stale and the next connection gets a fresh lease set.
   */
  takeBack(account: Account, nextEpoch = false): Message[] {
    const entry = account as Entry;
    if (this.admitted === entry) {
      this.admitted = null; // whatever it held back goes now
    }
    if (nextEpoch) {
      entry.epoch += 1;
      entry.leases = new Set();
    }
    const taken = entry.queue.slice(entry.head);
    if (taken.length > 0) {
      entry.queue = [];
      entry.head = 0;
      this.unready(entry);
    }
    if (entry.heldBack.length > 0) {
      taken.push(...entry.heldBack);
      entry.heldBack = [];
    }
    for (const message of taken) {
      entry.leases.delete(message.offset);
    }
    this.outstandingCount -= taken.length;
    // handlers still running belong to the ended epoch now
    entry.outstanding = nextEpoch ? 0 : entry.outstanding - taken.length;
    return taken;
  }

  /**
   * The stream's connection ended: its unsent results go (the proxy redelivers what it held);
   * how many acks and nacks were dropped.
   */
  forget(account: Account): number {
    const entry = account as Entry;
    const unsent = entry.acks.length + entry.nacks.length;
    entry.acks = [];
    entry.nacks = [];
    entry.releases = [];
    return unsent;
  }

  /** Deliveries the stream gives back unstarted (stop()): the next Release lists them. */
  release(account: Account, messages: readonly Message[]): void {
    const releases = (account as Entry).releases;
    for (const message of messages) {
      releases.push(message.offset);
    }
  }

  /** The offsets for the stream's next Release frame. */
  takeReleases(account: Account): number[] {
    const entry = account as Entry;
    const releases = entry.releases;
    entry.releases = [];
    return releases;
  }

  /** The acks and nacks for the stream's next Settle frame. */
  takeSettlements(account: Account): [number[], Nack[]] {
    const entry = account as Entry;
    const settlements: [number[], Nack[]] = [entry.acks, entry.nacks];
    entry.acks = [];
    entry.nacks = [];
    return settlements;
  }

  private hushedReady(): boolean {
    const entry = this.admitted;
    return entry !== null && entry.queued > 0 && entry.queue[entry.head] === this.gate.hushed;
  }

  private unready(entry: Entry): void {
    const index = this.readyList.indexOf(entry);
    if (index >= 0) {
      this.readyList.splice(index, 1);
    }
  }
}
