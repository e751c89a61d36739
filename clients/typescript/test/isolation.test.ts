/** The isolation gate (src/isolation.ts) and the ledger's held-back deliveries. */

import assert from "node:assert/strict";
import { test } from "node:test";

import { IsolationGate, Ticket } from "../src/isolation.js";
import { Ledger } from "../src/ledger.js";
import type { Message } from "../src/message.js";
import type { PartitionStream } from "../src/stream.js";

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
