/**
 * The fake proxy the TypeScript tests drive: the repo's one fake (tests/fakeproxy.py, which
 * the Python client's tests use too), run as `python -m tests.fakeproxy --control` and spoken
 * to over JSON lines. Its proxies start scripted: each stream gets what the test writes
 * (`onStream`, then the FakeStream methods) and nothing else. Every Consume call is mirrored
 * here as the fake reports it (metadata, every ConsumerFrame with its arrival time, the
 * half-close, a cancel), so tests read it synchronously.
 *
 * The interpreter is $TRIAGE_PYTHON (pytest passes its own), else `python3`; it needs the
 * project's environment (grpcio, triage-protocol).
 */

import { type ChildProcess, spawn } from "node:child_process";
import * as fs from "node:fs";
import * as path from "node:path";
import * as readline from "node:readline";

import * as grpc from "@grpc/grpc-js";

import type { ConsumerFrame, Delivery, ProxyFrame, TopologyReply } from "../src/proto.js";

export const TOKEN = "test-token";

export interface Received {
  at: number;
  frame: ConsumerFrame;
}

/** Poll `predicate` until it holds (or fail after `ms`). The bound is generous: these wait
 * for events that must come, and the suite shares 2 busy cores with the rest of CI. */
export async function until(predicate: () => boolean, ms = 10_000, what = "condition"): Promise<void> {
  const deadline = Date.now() + ms;
  while (!predicate()) {
    if (Date.now() > deadline) {
      throw new Error(`timed out waiting for ${what}`);
    }
    await sleep(5);
  }
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/**
 * How long a test waits for a Consumer's stop(): the longest drain a test scripts is the
 * client's CLOSE_TIMEOUT_MS (5 s) after a half-close the fake leaves unanswered.
 */
export const STOP_LIMIT_MS = 10_000;
/** How long withProxies() lets a test body run: under `npm test`'s 60 s per-test timeout. */
export const BODY_LIMIT_MS = 45_000;
/** How long the fake process may take to start (a loaded machine imports grpc slowly). */
const START_LIMIT_MS = 30_000;
/** How long a command to the fake may take to be answered. */
const REPLY_LIMIT_MS = 10_000;

function deadline(ms: number, what: string): { promise: Promise<never>; cancel(): void } {
  let timer: NodeJS.Timeout | undefined;
  const promise = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} did not finish within ${ms / 1000} s`)), ms);
  });
  return { promise, cancel: () => clearTimeout(timer) };
}

/**
 * `promise`, or a rejection naming `what` once `ms` passed. A hung await then fails its test
 * with a clear message and lets withProxies() clean up; unbounded, the live gRPC handles kept
 * node --test from exiting after the per-test timeout (a CI run hung that way).
 *
 * Once `promise` resolves, the mirrors of the running fakes have caught up with everything the
 * fake saw before: what the client did is then checked against complete records.
 */
export async function within<T>(promise: Promise<T>, ms: number, what: string): Promise<T> {
  const limit = deadline(ms, what);
  try {
    const value = await Promise.race([promise, limit.promise]);
    await Promise.race([FakeProcess.caughtUp(), limit.promise]);
    return value;
  } finally {
    limit.cancel();
  }
}

/** `consumer.stop()`, failing the test if it does not resolve within `ms`. */
export function stopped(consumer: { stop(): Promise<void> }, ms = STOP_LIMIT_MS): Promise<void> {
  return within(consumer.stop(), ms, "stop()");
}

/** One Consume call at a fake proxy. */
export class FakeStream {
  readonly received: Received[] = [];
  halfClosedAt: number | null = null;
  cancelled = false;
  finished = false;

  constructor(
    readonly proxy: FakeProxy,
    readonly number: number,
    readonly metadata: grpc.Metadata,
  ) {}

  get hello(): ConsumerFrame["hello"] {
    return this.received[0]?.frame.hello;
  }

  frames<K extends keyof ConsumerFrame>(kind: K): { at: number; value: NonNullable<ConsumerFrame[K]> }[] {
    return this.received
      .filter((r) => r.frame[kind] !== undefined)
      .map((r) => ({ at: r.at, value: r.frame[kind]! }));
  }

  acks(): number[] {
    return this.frames("settle").flatMap((s) => s.value.acks ?? []);
  }

  nacks(): { offset: number; reason: string; retry: boolean }[] {
    return this.frames("settle").flatMap((s) =>
      (s.value.nacks ?? []).map((n) => ({
        offset: n.offset ?? 0,
        reason: n.reason ?? "",
        retry: n.retry ?? false,
      })),
    );
  }

  settled(): number[] {
    return [...this.acks(), ...this.nacks().map((n) => n.offset)].sort((a, b) => a - b);
  }

  /** Send `frame` (after everything sent before it). */
  write(frame: ProxyFrame): void {
    this.proxy.post({ cmd: "write", stream: this.number, frame });
  }

  welcome(ackDeadlineMs = 30_000, partition = this.hello?.partition ?? 0, topic = "t"): void {
    this.write({ welcome: { topic, partition, ack_deadline_ms: ackDeadlineMs, max_attempts: 5 } });
  }

  deliver(offsets: number[], partition = this.hello?.partition ?? 0, extra: Partial<Delivery> = {}): void {
    this.deliverRaw(
      offsets.map((offset) => ({
        offset,
        value: Buffer.from(`v${offset}`),
        attempt: 1,
        timestamp_ms: 1000 + offset,
        ...extra,
      })),
      partition,
    );
  }

  deliverRaw(deliveries: Delivery[], partition = 0): void {
    this.write({ deliveries: { topic: "t", partition, deliveries } });
  }

  /** End the stream with OK. */
  end(): void {
    if (!this.finished) {
      this.finished = true;
      this.proxy.post({ cmd: "end", stream: this.number });
    }
  }

  /** End the stream with an error status (and trailers). */
  fail(code: grpc.status, details: string, trailers?: Record<string, string>): void {
    if (!this.finished) {
      this.finished = true;
      this.proxy.post({ cmd: "fail", stream: this.number, code, details, trailers: trailers ?? {} });
    }
  }
}

type Topology = TopologyReply | { code: grpc.status; details: string } | null;

interface Event {
  event: "topology" | "stream" | "frame" | "half-close" | "cancelled";
  proxy: number;
  stream?: number;
  at?: number;
  metadata?: Record<string, string[]>;
  frame?: ConsumerFrame;
}

/** One fake proxy of a FakeProcess. `onStream` scripts each new stream once its Hello came. */
export class FakeProxy {
  readonly streams: FakeStream[] = [];
  readonly topologyCalls: grpc.Metadata[] = [];
  onStream: (stream: FakeStream) => void = (s) => s.welcome();

  constructor(
    private readonly fake: FakeProcess,
    readonly index: number,
    readonly endpoint: string,
  ) {}

  /** What Topology answers from now on; null: UNIMPLEMENTED, like a proxy older than Topology. */
  async setTopology(answer: Topology): Promise<void> {
    if (answer === null) {
      await this.send({ cmd: "topology" });
    } else if ("code" in answer) {
      await this.send({ cmd: "topology", code: answer.code, details: answer.details });
    } else {
      await this.send({ cmd: "topology", reply: answer });
    }
  }

  /** Whether a half-close is answered by ending the stream with OK, as the proxy does (the
   * default). Turned back on, it ends the streams already half-closed. */
  async setEndOnHalfClose(on: boolean): Promise<void> {
    await this.send({ cmd: "configure", end_on_half_close: on });
  }

  send(command: Record<string, unknown>): Promise<Record<string, unknown>> {
    return this.fake.send({ ...command, proxy: this.index });
  }

  /** `send` without waiting: a failure fails the test at withProxies()'s end. */
  post(command: Record<string, unknown>): void {
    this.fake.post({ ...command, proxy: this.index });
  }

  handle(event: Event): void {
    const metadata = (): grpc.Metadata => {
      const md = new grpc.Metadata();
      for (const [key, values] of Object.entries(event.metadata ?? {})) {
        for (const value of values) {
          md.add(key, key.endsWith("-bin") ? Buffer.from(value, "base64") : value);
        }
      }
      return md;
    };
    if (event.event === "topology") {
      this.topologyCalls.push(metadata());
      return;
    }
    if (event.event === "stream") {
      // The fake reports a call with its Hello, so no test sees one without the other.
      const stream = new FakeStream(this, event.stream!, metadata());
      this.streams.push(stream);
      if (event.frame !== undefined) {
        stream.received.push({ at: event.at!, frame: event.frame });
        // Like the proxy: answer once the Hello arrived.
        this.onStream(stream);
      }
      return;
    }
    const stream = this.streams[event.stream! - 1]!;
    if (event.event === "frame") {
      stream.received.push({ at: event.at!, frame: event.frame! });
    } else if (event.event === "half-close") {
      stream.halfClosedAt = event.at!;
    } else {
      stream.cancelled = true;
    }
  }

  /** A Topology answer: every partition SERVING at the given endpoints. */
  static serving(topic: string, endpoints: (string | null)[]): TopologyReply {
    return {
      topic,
      partition_count: endpoints.length,
      partitions: endpoints.map((endpoint, partition) =>
        endpoint === null
          ? { partition, state: 3 }
          : { partition, endpoint, state: 1, owner_id: `owner-${partition}` },
      ),
      complete: true,
      problem: "",
    };
  }
}

/** The repo's root: the directory above this file holding tests/fakeproxy.py. */
function repoRoot(): string {
  for (let dir = __dirname; ; dir = path.dirname(dir)) {
    if (fs.existsSync(path.join(dir, "tests", "fakeproxy.py"))) {
      return dir;
    }
    if (path.dirname(dir) === dir) {
      throw new Error(`no tests/fakeproxy.py above ${__dirname}: the fake proxy is the repo's`);
    }
  }
}

const ENVIRONMENT_HINT =
  "the fake proxy is the repo's tests/fakeproxy.py and needs the project's Python environment " +
  "(grpcio, triage-protocol): set TRIAGE_PYTHON to the venv's interpreter, e.g. " +
  "TRIAGE_PYTHON=$(git rev-parse --show-toplevel)/.venv/bin/python npm test";

/** Buffers in commands go as base64, as proto3 JSON has bytes. */
function json(value: unknown): string {
  return JSON.stringify(value, (_key, v: unknown) => {
    const buffer = v as { type?: unknown; data?: unknown } | null;
    if (buffer !== null && typeof buffer === "object" && buffer.type === "Buffer" && Array.isArray(buffer.data)) {
      return Buffer.from(buffer.data as number[]).toString("base64");
    }
    return v;
  });
}

/**
 * One `python -m tests.fakeproxy --control` child serving `count` proxies. withProxies() owns
 * it: it starts it and kills it by PID when the test ends.
 */
export class FakeProcess {
  private static readonly running = new Set<FakeProcess>();
  readonly proxies: FakeProxy[] = [];
  /** Commands the fake refused that nobody awaited (FakeProxy.post). */
  readonly errors: Error[] = [];
  private readonly pending = new Map<number, { resolve(reply: Record<string, unknown>): void; reject(e: Error): void }>();
  private nextId = 1;
  private stderr = "";
  private readonly exited: Promise<void>;

  private constructor(private readonly child: ChildProcess) {
    this.exited = new Promise((resolve) => child.once("exit", () => resolve()));
    // Failures surface through exit and the replies; unhandled, these would crash the run.
    child.on("error", () => {});
    child.stdin!.on("error", () => {});
    child.stderr!.setEncoding("utf8");
    child.stderr!.on("data", (chunk: string) => {
      this.stderr = (this.stderr + chunk).slice(-8000);
    });
    child.once("exit", (code, signal) => {
      FakeProcess.running.delete(this);
      const error = new Error(`the fake proxy exited (${signal ?? code}):\n${this.stderr}`);
      for (const waiter of this.pending.values()) waiter.reject(error);
      this.pending.clear();
    });
  }

  static async start(count: number): Promise<FakeProcess> {
    const python = process.env.TRIAGE_PYTHON || "python3";
    const root = repoRoot();
    const child = spawn(python, ["-m", "tests.fakeproxy", "--control", "--proxies", String(count), "--token", TOKEN], {
      cwd: root,
      env: {
        ...process.env,
        PYTHONPATH: [root, process.env.PYTHONPATH].filter(Boolean).join(path.delimiter),
        PYTHONUNBUFFERED: "1",
      },
      stdio: ["pipe", "pipe", "pipe"],
    });
    const fake = new FakeProcess(child);
    FakeProcess.running.add(fake);
    const lines = readline.createInterface({ input: child.stdout! });
    const ready = new Promise<string[]>((resolve, reject) => {
      child.once("error", (error) => reject(new Error(`cannot run ${python} (${error.message}): ${ENVIRONMENT_HINT}`)));
      // "close", not "exit": by then stderr was read to its end, the traceback included.
      child.once("close", (code, signal) => {
        const hint = /ModuleNotFoundError|No module named/.test(fake.stderr) ? `\n${ENVIRONMENT_HINT}` : "";
        reject(new Error(`${python} -m tests.fakeproxy exited (${signal ?? code}) before it was ready:\n${fake.stderr}${hint}`));
      });
      lines.on("line", (line) => {
        const message = JSON.parse(line) as Record<string, unknown>;
        if (message.ready === true) {
          resolve(message.endpoints as string[]);
        } else {
          fake.receive(message);
        }
      });
    });
    const limit = deadline(START_LIMIT_MS, `starting ${python} -m tests.fakeproxy`);
    try {
      const endpoints = await Promise.race([ready, limit.promise]);
      endpoints.forEach((endpoint, index) => fake.proxies.push(new FakeProxy(fake, index, endpoint)));
      return fake;
    } catch (error) {
      await fake.stop();
      throw error;
    } finally {
      limit.cancel();
    }
  }

  /** Resolves once every running fake answered a command sent now: its reply comes after
   * every event the fake emitted before it. */
  static async caughtUp(): Promise<void> {
    await Promise.all([...FakeProcess.running].map((fake) => fake.send({ cmd: "sync" })));
  }

  send(command: Record<string, unknown>): Promise<Record<string, unknown>> {
    const id = this.nextId++;
    const limit = deadline(REPLY_LIMIT_MS, `the fake's answer to ${String(command.cmd)}`);
    const reply = new Promise<Record<string, unknown>>((resolve, reject) => {
      if (this.child.exitCode !== null || this.child.signalCode !== null) {
        reject(new Error(`the fake proxy is not running:\n${this.stderr}`));
        return;
      }
      this.pending.set(id, { resolve, reject });
      this.child.stdin!.write(json({ ...command, id }) + "\n");
    });
    return Promise.race([reply, limit.promise]).finally(() => limit.cancel());
  }

  post(command: Record<string, unknown>): void {
    this.send(command).catch((error: unknown) => {
      this.errors.push(error instanceof Error ? error : new Error(String(error)));
    });
  }

  private receive(message: Record<string, unknown>): void {
    if ("reply" in message) {
      const waiter = this.pending.get(message.reply as number);
      this.pending.delete(message.reply as number);
      if (message.error !== undefined) {
        waiter?.reject(new Error(`the fake proxy refused a command: ${String(message.error)}`));
      } else {
        waiter?.resolve(message);
      }
    } else {
      const event = message as unknown as Event;
      this.proxies[event.proxy]!.handle(event);
    }
  }

  /** Kill the child by its PID (SIGTERM, then SIGKILL if it lingers) and wait for its exit. */
  async stop(): Promise<void> {
    if (this.child.exitCode === null && this.child.signalCode === null) {
      this.child.kill("SIGTERM");
      const limit = deadline(3000, "the fake proxy's exit");
      try {
        await Promise.race([this.exited, limit.promise]);
      } catch {
        this.child.kill("SIGKILL");
        await this.exited;
      } finally {
        limit.cancel();
      }
    }
    FakeProcess.running.delete(this);
  }

  /** Last resort if node exits with a fake still running (a crashed test run). */
  static killAll(): void {
    for (const fake of FakeProcess.running) {
      fake.child.kill("SIGKILL");
    }
  }
}

process.on("exit", () => FakeProcess.killAll());

const live: { stop(): Promise<void> }[] = [];

/** Stop `consumer` when the test's withProxies() ends, even if the test failed. */
export function track<T extends { stop(): Promise<void> }>(consumer: T): T {
  live.push(consumer);
  return consumer;
}

/**
 * Start a fake with `count` proxies, run `body` (bounded by BODY_LIMIT_MS), always stop the
 * consumers it tracked (bounded by STOP_LIMIT_MS), then kill the fake, which ends any call
 * still open. A command the fake refused fails the test.
 */
export async function withProxies(
  count: number,
  body: (...proxies: FakeProxy[]) => Promise<void>,
): Promise<void> {
  const fake = await FakeProcess.start(count);
  try {
    await within(body(...fake.proxies), BODY_LIMIT_MS, "the test body");
  } finally {
    const consumers = live.splice(0);
    // A drain the body left waiting on the fake ends now, as the proxy would end it.
    await Promise.all(fake.proxies.map((p) => p.setEndOnHalfClose(true))).catch(() => {});
    const limit = new Promise<void>((resolve) => setTimeout(resolve, STOP_LIMIT_MS).unref());
    await Promise.race([Promise.all(consumers.map((c) => c.stop())), limit]);
    await fake.stop();
  }
  if (fake.errors.length > 0) {
    throw fake.errors[0];
  }
}
