/** The isolation gate (src/isolation.ts) and the ledger's held-back deliveries. */

import assert from "node:assert/strict";
import { test } from "node:test";

import { IsolationGate, StreamTurn, Ticket } from "../src/isolation.js";
import { Ledger } from "../src/ledger.js";
import type { Message } from "../src/message.js";
import { HandlerPool } from "../src/pool.js";
import type { PartitionStream, StreamContext } from "../src/stream.js";
import type { StreamWriter } from "../src/writer.js";
import { within } from "./fake.js";

function message(offset: number): Message {
  return {
    topic: "t",
    partition: 0,
    offset,
    key: null,
    value: null,
    headers: [],
    timestampMs: 0,
    attempt: 2,
  };
}

/** Microtasks run: a ticket's turn is handed over on one. */
function settle(): Promise<void> {
  return new Promise((resolve) => setImmediate(resolve));
}

test("isolation: one ticket at a time across every stream of the process", async () => {
  const gate = new IsolationGate();
  const turns: string[] = [];
  const streams = [{ name: "p0" }, { name: "p1" }, { name: "p2" }];
  const tickets = streams.map(
    (owner, i) => new Ticket(owner, message(10 + i), 0, () => turns.push(owner.name)),
  );
  for (const ticket of tickets) {
    gate.enter(ticket);
  }
  await settle();
  assert.deepEqual(turns, ["p0"]); // the others wait, unstarted
  assert.equal(gate.holder, tickets[0]);
  assert.equal(gate.waiting, 2);
  gate.leave(tickets[1]!); // not its turn: just out of the queue
  await settle();
  assert.deepEqual(turns, ["p0"]);
  gate.leave(tickets[0]!);
  await settle();
  assert.deepEqual(turns, ["p0", "p2"]);
  gate.leave(tickets[2]!);
  assert.equal(gate.holder, null);
});

test("isolation: a stream whose connection ended gives up its turn and its waiting tickets", async () => {
  const gate = new IsolationGate();
  const turns: number[] = [];
  const a = { name: "a" };
  const b = { name: "b" };
  const onTurn = (t: Ticket): void => {
    turns.push(t.message.offset);
  };
  gate.enter(new Ticket(a, message(1), 0, onTurn));
  gate.enter(new Ticket(a, message(2), 0, onTurn));
  gate.enter(new Ticket(b, message(3), 0, onTurn));
  await settle();
  assert.deepEqual(turns, [1]);
  gate.drop(a); // holder and waiting ticket of `a` go
  await settle();
  assert.deepEqual(turns, [1, 3]);
  assert.equal(gate.waiting, 0);
  gate.enter(new Ticket(a, message(4), 0, onTurn));
  gate.dropWaiting(a); // stopping: waiting ones go, the holder stays
  assert.equal(gate.waiting, 0);
  assert.equal(gate.holder?.message.offset, 3);
});

test("ledger: held-back deliveries are leased and outstanding, queued first when admitted", () => {
  const ledger = new Ledger();
  const a = ledger.open("a" as unknown as PartitionStream);
  ledger.queue(a, [message(1), message(2)]);
  const held = message(7);
  ledger.hold(a, [held]);
  assert.deepEqual([ledger.outstanding, a.outstanding, a.queued], [3, 3, 2]);
  assert.deepEqual([...a.leases].sort(), [1, 2, 7]);
  assert.equal(ledger.admit(a, held), true);
  assert.equal(ledger.admit(a, held), false); // once
  assert.equal(a.queued, 3);
  assert.equal(ledger.pick(), a);
  assert.equal(ledger.take(a).offset, 7); // first in its stream's queue
});

test("ledger: a stream's take-back includes what is held back for the turn", () => {
  const ledger = new Ledger();
  const a = ledger.open("a" as unknown as PartitionStream);
  const held = message(5);
  ledger.hold(a, [held]);
  ledger.queue(a, [message(6)]);
  const taken = ledger.takeBack(a, true);
  assert.deepEqual(taken.map((m) => m.offset).sort(), [5, 6]);
  assert.deepEqual([ledger.outstanding, a.outstanding, a.leases.size], [0, 0, 0]);
  assert.equal(ledger.admit(a, held), false); // given back: its turn passes
});

test("isolation: a hushed process starts only its isolated delivery until it leaves", async () => {
  // From an isolated delivery's turn until it leaves, no slot starts another delivery of any
  // stream: a crash meanwhile is its own, or a handler's already running.
  const gate = new IsolationGate();
  const ledger = new Ledger(gate);
  const a = ledger.open("a" as unknown as PartitionStream);
  const b = ledger.open("b" as unknown as PartitionStream);
  ledger.queue(a, [message(1)]);
  ledger.queue(b, [message(2)]);
  const held = message(7);
  ledger.hold(a, [held]);
  const pool = { name: "pool" };
  const unhushed: string[] = [];
  gate.listen(pool, () => unhushed.push("kick"));
  const ticket = new Ticket(a, held, 0, (t) => gate.hush(t));
  gate.enter(ticket);
  await settle(); // its turn: hushed
  assert.equal(gate.hushed, held);
  assert.equal(ledger.ready, false, "nothing else starts while the Started is on its way");
  assert.equal(ledger.admit(a, held), true);
  assert.equal(ledger.ready, true);
  assert.equal(ledger.take(ledger.pick()), held);
  assert.equal(ledger.ready, false, "nor while the isolated delivery runs");
  gate.leave(ticket);
  assert.equal(gate.hushed, null);
  await settle();
  assert.deepEqual(unhushed, ["kick"]);
  const picked = [ledger.take(ledger.pick()), ledger.take(ledger.pick())];
  assert.deepEqual(picked.map((m) => m.offset).sort(), [1, 2]);
});

test("isolation: a hush ends after its bound while a slow isolated delivery keeps the turn", async () => {
  const hushMs = 200; // the bound's logic, not HUSH_MS's length
  const gate = new IsolationGate(hushMs);
  const ledger = new Ledger(gate);
  const a = ledger.open("a" as unknown as PartitionStream);
  ledger.queue(a, [message(1)]);
  const pool = { name: "pool" };
  const ended = new Promise<void>((resolve) => gate.listen(pool, resolve));
  const ticket = new Ticket(a, message(7), 0, (t) => gate.hush(t));
  const began = performance.now();
  gate.enter(ticket);
  await within(ended, 30_000, "the hush's end");
  // libuv's timers count whole milliseconds from the loop's cached time: up to 1 ms early
  assert.ok(performance.now() - began >= hushMs - 1);
  assert.equal(gate.holder, ticket, "the turn stays with the slow delivery");
  assert.equal(ledger.ready, true);
  assert.equal(ledger.take(ledger.pick()).offset, 1);
  gate.unlisten(pool);
});

test("isolation: a pool runs no other handler while the process is hushed", async () => {
  // The real pool and a gate whose hush outlasts the test (a busy machine must not see the
  // HUSH_MS timer end it early): deliveries queued during the hush wait for the isolated
  // one to leave, then run.
  const gate = new IsolationGate(600_000);
  const ran: number[] = [];
  let isolatedRan!: () => void;
  let allRan!: () => void;
  const isolated = new Promise<void>((resolve) => (isolatedRan = resolve));
  const all = new Promise<void>((resolve) => (allRan = resolve));
  const pool = new HandlerPool(
    async (m: Message) => {
      ran.push(m.offset);
      if (m.offset === 7) {
        isolatedRan();
      }
      if (ran.length === 4) {
        allRan();
      }
    },
    4,
    [],
    gate,
  );
  pool.start();
  const account = pool.ledger.open({ afterSettle() {} } as unknown as PartitionStream);
  const held = message(7);
  pool.isolate(account, [held]);
  const ticket = new Ticket(account, held, 0, (t) => gate.hush(t));
  gate.enter(ticket);
  await settle();
  try {
    assert.equal(gate.hushed, held);
    pool.submit(account, [message(1), message(2), message(3)]);
    assert.equal(pool.runIsolated(account, held), true);
    await within(isolated, 30_000, "the isolated handler");
    await settle(); // the handler's result: its slot frees and finds nothing to start
    assert.deepEqual(ran, [7]);
    gate.leave(ticket);
    await within(all, 30_000, "the other handlers");
    assert.deepEqual([...ran].sort(), [1, 2, 3, 7]);
  } finally {
    gate.leave(ticket);
    pool.close();
  }
});

/** A real pool on `gate` whose handler for offset 1 runs until `release`, and a stream turn. */
function slowNeighbour(gate: IsolationGate) {
  let release!: () => void;
  const released = new Promise<void>((resolve) => (release = resolve));
  let began!: () => void;
  const running = new Promise<void>((resolve) => (began = resolve));
  const pool = new HandlerPool(
    async (m: Message) => {
      if (m.offset === 1) {
        began();
        await released;
      }
    },
    4,
    [],
    gate,
  );
  pool.start();
  const stream = { afterSettle() {} } as unknown as PartitionStream;
  const account = pool.ledger.open(stream);
  (stream as unknown as { account: typeof account }).account = account;
  const sent: number[] = [];
  let onSent!: () => void;
  const started = new Promise<void>((resolve) => (onSent = resolve));
  const writer = {
    started(offset: number): boolean {
      sent.push(offset);
      onSent();
      return true;
    },
  } as unknown as StreamWriter;
  const ctx = { pool, stopping: () => false } as unknown as StreamContext;
  const turn = new StreamTurn(stream, ctx, writer, gate);
  const close = (): void => {
    release();
    turn.giveBack();
    if (gate.holder !== null) {
      gate.leave(gate.holder);
    }
    pool.close();
  };
  return { pool, account, turn, sent, started, running, release, close };
}

test("isolation: an isolated delivery's Started waits for the handlers already running", async () => {
  // A crash pill already running when a suspect's turn comes (its first delivery: not
  // isolated) may crash the process late: the Started waits until no handler runs, so that
  // crash cannot be blamed on the suspect. The gate's bound outlasts the test.
  const gate = new IsolationGate(600_000);
  let polls = 0;
  let onPolled!: () => void;
  const polled = new Promise<void>((resolve) => (onPolled = resolve));
  const quiet = gate.quiet.bind(gate);
  gate.quiet = () => {
    polls += 1;
    if (polls >= 3) {
      onPolled();
    }
    return quiet();
  };
  const { pool, account, turn, sent, started, running, release, close } = slowNeighbour(gate);
  try {
    pool.submit(account, [message(1)]);
    await within(running, 30_000, "the running handler");
    turn.isolate([message(7)], [7]);
    await within(polled, 30_000, "the gate's polls");
    assert.deepEqual(sent, [], "no Started while another handler runs");
    assert.notEqual(gate.hushed, null, "nothing new starts meanwhile");
    release();
    await within(started, 30_000, "the Started");
    assert.deepEqual(sent, [7]);
  } finally {
    close();
  }
});

test("isolation: an isolated delivery's Started waits no longer than the hush's bound", async () => {
  const gate = new IsolationGate(200);
  const { pool, account, turn, sent, started, running, close } = slowNeighbour(gate);
  try {
    pool.submit(account, [message(1)]);
    await within(running, 30_000, "the running handler");
    const turned = performance.now();
    turn.isolate([message(7)], [7]);
    await within(started, 30_000, "the Started");
    // libuv's timers count whole milliseconds from the loop's cached time: up to 1 ms early
    assert.ok(performance.now() - turned >= 200 - 1);
    assert.deepEqual(sent, [7]);
  } finally {
    close();
  }
});
