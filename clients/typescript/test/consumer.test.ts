/**
 * Topic-level behaviour against fake proxies: Topology discovery, one stream per partition,
 * the credit split, one shared pool, owner redirects, topology refresh, `partitions`, final
 * statuses vs reconnect with backoff, the old-proxy fallback and the lifecycle.
 */

import assert from "node:assert/strict";
import * as http from "node:http";
import { test } from "node:test";

import * as grpc from "@grpc/grpc-js";

import {
  AuthenticationError,
  Consumer,
  EndpointError,
  PartitionError,
  StateError,
  StreamError,
  type ConsumerOptions,
  type Message,
} from "../src/index.js";
import { FakeProxy, STOP_LIMIT_MS, TOKEN, sleep, stopped, track, until, within, withProxies } from "./fake.js";

const quiet = { debug() {}, info() {}, warn() {}, error() {} };

/** A logger that keeps every line: the tests read the client's decisions from it, not the clock. */
function recording(): { lines: string[]; debug(m: string): void; info(m: string): void; warn(m: string): void; error(m: string): void } {
  const lines: string[] = [];
  const keep = (m: string): void => {
    lines.push(m);
  };
  return { lines, debug: keep, info: keep, warn: keep, error: keep };
}

function consumer(endpoint: string, options: Partial<ConsumerOptions>): Consumer {
  return track(
    new Consumer({ endpoint, token: TOKEN, handler: () => {}, logger: quiet, consumerId: "topic", ...options }),
  );
}

function hellos(...proxies: FakeProxy[]): { partition: number | undefined; credits: number }[] {
  return proxies
    .flatMap((p) => p.streams)
    .map((s) => ({ partition: s.hello?.partition, credits: s.hello?.credits ?? 0 }))
    .sort((a, b) => (a.partition ?? -1) - (b.partition ?? -1));
}

test("Topology discovery: one stream per partition at its endpoint, credits split to sum concurrency + prefetch", async () => {
  await withProxies(2, async (a, b) => {
    const layout = FakeProxy.serving("orders", [a.endpoint, b.endpoint, a.endpoint]);
    await a.setTopology(layout);
    await b.setTopology(layout);
    const c = consumer(b.endpoint, { concurrency: 5, prefetch: 5 });
    await c.start();
    await until(() => hellos(a, b).length === 3);
    assert.deepEqual(hellos(a, b), [
      { partition: 0, credits: 4 },
      { partition: 1, credits: 3 },
      { partition: 2, credits: 3 },
    ]);
    assert.deepEqual(a.streams.map((s) => s.hello?.partition).sort(), [0, 2]);
    assert.deepEqual(b.streams.map((s) => s.hello?.partition), [1]);
    await stopped(c);
  });
});

test("one pool of `concurrency` slots is shared by every partition, and stats are per partition and total", async () => {
  await withProxies(1, async (a) => {
    await a.setTopology(FakeProxy.serving("t", [a.endpoint, a.endpoint, a.endpoint]));
    a.onStream = (s) => {
      s.welcome();
      const p = s.hello!.partition!;
      s.deliver([0, 1, 2, 3].map((i) => i + 100 * p));
    };
    let running = 0;
    let most = 0;
    const partitionsSeen = new Set<number>();
    const c = consumer(a.endpoint, {
      concurrency: 3,
      prefetch: 12,
      handler: async (m: Message) => {
        running += 1;
        most = Math.max(most, running);
        partitionsSeen.add(m.partition);
        await sleep(20);
        running -= 1;
      },
    });
    await c.start();
    await until(() => c.stats.acked === 12, 5000, "12 acks");
    assert.equal(most, 3, "never more handlers than concurrency, over all partitions");
    assert.deepEqual([...partitionsSeen].sort(), [0, 1, 2]);
    await stopped(c);
    const stats = c.stats;
    assert.deepEqual(Object.keys(stats.partitions), ["0", "1", "2"]);
    for (const p of [0, 1, 2]) {
      assert.equal(stats.partitions[p]!.delivered, 4);
      assert.equal(stats.partitions[p]!.acked, 4);
    }
    assert.equal(stats.delivered, 12);
    assert.equal(stats.acked, 12);
  });
});

test("a partition with a backlog of slow messages does not starve another", async () => {
  await withProxies(1, async (a) => {
    await a.setTopology(FakeProxy.serving("t", [a.endpoint, a.endpoint]));
    a.onStream = (s) => {
      s.welcome();
      if (s.hello!.partition === 0) {
        s.deliver([0, 1, 2, 3, 4, 5, 6, 7]); // slow
      } else {
        setTimeout(() => s.deliver([0, 1, 2, 3]), 30); // fast, arriving after the backlog
      }
    };
    const finished: [number, number][] = [];
    const c = consumer(a.endpoint, {
      concurrency: 2,
      prefetch: 20,
      handler: async (m: Message) => {
        await sleep(m.partition === 0 ? 150 : 1);
        finished.push([m.partition, Date.now()]);
      },
    });
    await c.start();
    await until(() => finished.filter(([p]) => p === 1).length === 4, 5000, "partition 1 handled");
    // Judged by order, not by the clock (a loaded machine stretches every sleep): starved,
    // partition 1 would finish behind all 8 of partition 0's slow messages; taking turns, it
    // finishes while the first slow ones run.
    const lastFast = finished.map(([p]) => p).lastIndexOf(1);
    const slowBefore = finished.slice(0, lastFast).filter(([p]) => p === 0).length;
    assert.ok(slowBefore <= 4, `partition 1 finished behind ${slowBefore} of partition 0's 8 slow messages`);
    await stopped(c);
  });
});

test("FAILED_PRECONDITION with triage-owner-endpoint: the stream follows the owner at once", async () => {
  await withProxies(2, async (a, b) => {
    await a.setTopology(FakeProxy.serving("t", [a.endpoint])); // stale: b serves it now
    a.onStream = (s) =>
      s.fail(grpc.status.FAILED_PRECONDITION, "partition 0 is not served here", {
        "triage-owner-endpoint": b.endpoint,
      });
    const log = recording();
    const c = consumer(a.endpoint, { maxBackoffMs: 60_000, logger: log });
    await c.start();
    await until(() => b.streams.length === 1 && b.streams[0]!.hello !== undefined, 5000, "a stream at b");
    assert.equal(b.streams[0]!.hello!.partition, 0);
    // At once: the client logged the redirect and never a backoff (which would be >= 50 ms
    // here, and up to a minute later in the run); a clock bound would only measure the load.
    assert.ok(log.lines.some((l) => l.includes(`following it to ${b.endpoint}`)), log.lines.join("\n"));
    assert.ok(!log.lines.some((l) => l.includes("reconnecting in")), log.lines.join("\n"));
    assert.equal(a.streams.length, 1);
    await stopped(c);
  });
});

test("a failed stream asks for the topology at once and follows the partition to its new endpoint", async () => {
  await withProxies(2, async (a, b) => {
    await a.setTopology(FakeProxy.serving("t", [a.endpoint]));
    await b.setTopology(FakeProxy.serving("t", [a.endpoint]));
    const c = consumer(a.endpoint, { topologyIntervalMs: 60_000, maxBackoffMs: 60_000 });
    await c.start();
    await until(() => a.streams.length === 1 && a.streams[0]!.hello !== undefined);
    const reads = a.topologyCalls.length;
    await a.setTopology(FakeProxy.serving("t", [b.endpoint]));
    await b.setTopology(FakeProxy.serving("t", [b.endpoint]));
    a.onStream = (s) => s.fail(grpc.status.UNAVAILABLE, "going away");
    a.streams[0]!.fail(grpc.status.UNAVAILABLE, "going away");
    await until(() => b.streams.length === 1, 10_000, "the stream at the new endpoint");
    assert.ok(a.topologyCalls.length > reads, "the failure asked for the topology");
    await stopped(c);
  });
});

test("the topology is read again periodically and a partition added to the topic is consumed", async () => {
  await withProxies(1, async (a) => {
    await a.setTopology(FakeProxy.serving("t", [a.endpoint]));
    const c = consumer(a.endpoint, { topologyIntervalMs: 100 });
    await c.start();
    await until(() => a.streams.length === 1);
    await a.setTopology(FakeProxy.serving("t", [a.endpoint, a.endpoint]));
    await until(() => a.streams.some((s) => s.hello?.partition === 1), 10_000, "partition 1's stream");
    assert.ok(a.topologyCalls.length >= 2);
    await stopped(c);
  });
});

test("partitions: [...] restricts the streams; a partition the topic lacks is a clear error", async () => {
  await withProxies(1, async (a) => {
    await a.setTopology(FakeProxy.serving("orders", [a.endpoint, a.endpoint, a.endpoint]));
    const only = consumer(a.endpoint, { partitions: [2, 1] });
    await only.start();
    await until(() => a.streams.length === 2);
    assert.deepEqual(hellos(a).map((h) => h.partition), [1, 2]);
    await stopped(only);

    const wrong = consumer(a.endpoint, { partitions: [0, 5, 7] });
    await assert.rejects(wrong.start(), (error: Error) => {
      assert.ok(error instanceof PartitionError);
      assert.deepEqual(error.missing, [5, 7]);
      assert.match(error.message, /partitions \[5, 7\] are not in topic 'orders', which has 3 partitions \(0 to 2\)/);
      return true;
    });
    await assert.rejects(wrong.done, PartitionError);
  });
});

test("against a proxy without Topology: one stream with no partition, `partitions` checked against its Welcome", async () => {
  await withProxies(1, async (a) => {
    a.onStream = (s) => s.welcome(30_000, 0);
    const c = consumer(a.endpoint, { partitions: [1] });
    await c.start();
    await assert.rejects(c.done, (error: Error) => {
      assert.ok(error instanceof PartitionError);
      assert.match(error.message, /older proxy, without Topology\) serves only partition 0/);
      return true;
    });
    assert.equal(a.streams[0]!.hello!.partition, undefined);
  });
});

test("a broken stream reconnects with growing, capped backoff", async () => {
  await withProxies(1, async (a) => {
    a.onStream = (s) => s.fail(grpc.status.UNAVAILABLE, "not ready");
    const log = recording();
    const c = consumer(a.endpoint, { maxBackoffMs: 400, logger: log });
    await c.start();
    await until(() => a.streams.filter((s) => s.received.length > 0).length >= 6, 10_000, "six attempts");
    // The delays the client chose (from its log), so a loaded machine cannot fake or hide
    // the growth; the clock is only checked for the waits being kept (a lower bound).
    const delays = log.lines
      .map((l) => /reconnecting in (\d+) ms/.exec(l))
      .filter((m) => m !== null)
      .map((m) => Number(m![1]));
    assert.ok(delays.length >= 5, `${delays.length} backoffs logged`);
    assert.ok(delays[0]! <= 200, `first delay ${delays[0]} ms is short`);
    assert.ok(delays.every((d) => d <= 400), `delays ${delays.join(", ")} stay under the cap`);
    assert.ok(delays.slice(3).every((d) => d >= 200), `late delays ${delays.join(", ")} reach the cap's half`);
    // Streams whose Hello arrived so far: one opened just now may not have sent it yet.
    const opened = a.streams.filter((s) => s.received.length > 0).map((s) => s.received[0]!.at);
    const gaps = opened.slice(1).map((t, i) => t - opened[i]!);
    assert.ok(
      gaps.every((g, i) => g >= delays[i]! - 2),
      `gaps ${gaps.join(", ")} keep the delays ${delays.join(", ")}`,
    );
    await stopped(c);
    // Counted after stop(): a reconnect may open between the snapshot above and stop().
    assert.equal(c.stats.reconnects, a.streams.length - 1);
  });
});

for (const [code, cls] of [
  [grpc.status.UNAUTHENTICATED, AuthenticationError],
  [grpc.status.PERMISSION_DENIED, AuthenticationError],
  [grpc.status.INVALID_ARGUMENT, StreamError],
  [grpc.status.UNIMPLEMENTED, EndpointError],
] as const) {
  test(`${grpc.status[code]} on Consume is final: no reconnect, the consumer stops with ${cls.name}`, async () => {
    await withProxies(1, async (a) => {
      a.onStream = (s) => s.fail(code, "refused");
      const c = consumer(a.endpoint, { maxBackoffMs: 50 });
      await c.start();
      await assert.rejects(c.done, cls);
      await sleep(150);
      assert.equal(a.streams.length, 1, "no reconnect after a final status");
      await stopped(c); // safe after a failure
    });
  });
}

test("a wrong token on Topology rejects start() with an authentication error", async () => {
  await withProxies(1, async (a) => {
    await a.setTopology({ code: grpc.status.UNAUTHENTICATED, details: "bad token" });
    const c = consumer(a.endpoint, {});
    await assert.rejects(c.start(), (error: Error) => {
      assert.ok(error instanceof AuthenticationError);
      assert.match(error.message, /authentication failed/);
      return true;
    });
    assert.equal(a.streams.length, 0);
  });
});

test("an endpoint that does not speak gRPC is reported at once", async () => {
  const server = http.createServer((_req, res) => res.end("not grpc"));
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  try {
    const { port } = server.address() as { port: number };
    const c = new Consumer({ endpoint: `127.0.0.1:${port}`, token: TOKEN, handler: () => {}, logger: quiet });
    await assert.rejects(c.start(), (error: Error) => {
      assert.ok(error instanceof EndpointError);
      assert.match(error.message, /does not speak gRPC/);
      return true;
    });
  } finally {
    server.close();
  }
});

test("lifecycle: start() once, stop() twice is safe, stop() before start()", async () => {
  await withProxies(1, async (a) => {
    const c = consumer(a.endpoint, {});
    await c.start();
    await assert.rejects(c.start(), StateError);
    await within(Promise.all([c.stop(), c.stop()]), STOP_LIMIT_MS, "two stop()s");
    await stopped(c);
    await c.done;

    const never = consumer(a.endpoint, {});
    await stopped(never);
    await assert.rejects(never.start(), StateError);
  });
});

test("run() resolves after stop() from inside a handler", async () => {
  await withProxies(1, async (a) => {
    a.onStream = (s) => {
      s.welcome();
      s.deliver([0, 1, 2]);
    };
    let c: Consumer | null = null;
    c = consumer(a.endpoint, {
      concurrency: 1,
      handler: (m: Message) => {
        if (m.offset === 0) void c!.stop();
      },
    });
    await within(c.run(), STOP_LIMIT_MS, "run()");
    assert.deepEqual(a.streams[0]!.acks(), [0]);
    assert.deepEqual(a.streams[0]!.frames("release").flatMap((r) => r.value.offsets), [1, 2]);
  });
});
