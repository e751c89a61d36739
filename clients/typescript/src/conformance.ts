#!/usr/bin/env node
/**
 * The client command the conformance kit drives (see the kit's contract): reads
 * TRIAGE_ENDPOINT, TRIAGE_TOKEN, TRIAGE_CONSUMER_ID and TRIAGE_CONCURRENCY, consumes with a
 * handler that does what each message's `x-triage-action` header says (absent: ack), and
 * prints one JSON line per handler start and one per settled handler on stdout:
 *
 *     {"event":"start","partition":P,"offset":O,"attempt":A,"key":b64|null,"value":b64|null,
 *      "headers":[[name, b64|null], ...]}
 *     {"event":"settled","partition":P,"offset":O,"outcome":"ack"|"nack"|"retry"}
 *
 * Actions: `ack`; `fail` (throw an Error whose message is the value as UTF-8); `retry` (throw
 * Retry while attempt < 3, then ack); `sleep:<ms>` (wait, then ack; leases are extended);
 * `hang` (never settle). SIGTERM or SIGINT drains (Consumer.stop()) and exits 0; a consumer
 * that fails (a wrong token, say) exits 1 with the reason on stderr.
 *
 *     node clients/typescript/dist/conformance.js
 */

import { Consumer, Retry, type Logger, type Message } from "./index";

const ACTION_HEADER = "x-triage-action";

function b64(value: Buffer | null): string | null {
  return value === null ? null : value.toString("base64");
}

/** One JSON line on stdout. A line over the pipe's capacity (a 1 MB record's event) may
 * still be queued when the client stops: `exit` flushes before it leaves. */
function emit(record: object): void {
  process.stdout.write(`${JSON.stringify(record)}\n`);
}

/** process.exit(code) once every line written so far left stdout: exiting at once cut a
 * queued line short (the kit then saw a half event, under load). */
async function exit(code: number): Promise<never> {
  await new Promise<void>((resolve) => {
    process.stdout.write("", () => resolve());
  });
  process.exit(code);
}

function action(message: Message): string {
  for (const [name, value] of message.headers) {
    if (name === ACTION_HEADER) {
      return value === null ? "ack" : value.toString("utf8");
    }
  }
  return "ack";
}

/** Every log line, timestamped, on stderr: the kit keeps each client's stderr as its log. */
function stderrLine(level: string): (message: string) => void {
  return (message) => process.stderr.write(`${new Date().toISOString()} ${level} ${message}\n`);
}

const LOGGER: Logger = {
  debug: stderrLine("DEBUG"),
  info: stderrLine("INFO"),
  warn: stderrLine("WARN"),
  error: stderrLine("ERROR"),
};

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

async function handle(message: Message): Promise<void> {
  const { partition, offset, attempt } = message;
  emit({
    event: "start",
    partition,
    offset,
    attempt,
    key: b64(message.key),
    value: b64(message.value),
    headers: message.headers.map(([name, value]) => [name, b64(value)]),
  });
  const settled = (outcome: string): void => emit({ event: "settled", partition, offset, outcome });
  const what = action(message);
  if (what === "fail") {
    settled("nack");
    throw new Error((message.value ?? Buffer.alloc(0)).toString("utf8"));
  }
  if (what === "retry") {
    if (attempt < 3) {
      settled("retry");
      throw new Retry(`attempt ${attempt}`);
    }
  } else if (what.startsWith("sleep:")) {
    await sleep(Number(what.slice("sleep:".length)));
  } else if (what === "hang") {
    await new Promise<never>(() => {});
  }
  settled("ack");
}

function required(name: string): string {
  const value = process.env[name];
  if (value === undefined) {
    process.stderr.write(`conformance client: ${name} is not set\n`);
    process.exit(2);
  }
  return value;
}

async function main(): Promise<void> {
  let consumer: Consumer;
  try {
    consumer = new Consumer({
      endpoint: required("TRIAGE_ENDPOINT"),
      token: required("TRIAGE_TOKEN"),
      consumerId: process.env["TRIAGE_CONSUMER_ID"] || undefined,
      concurrency: Number(process.env["TRIAGE_CONCURRENCY"] ?? "16"),
      handler: handle,
      logger: LOGGER,
    });
  } catch (error) {
    process.stderr.write(`conformance client: ${(error as Error).message}\n`);
    process.exit(2);
  }
  const stop = (): void => {
    void consumer.stop();
  };
  process.on("SIGTERM", stop);
  process.on("SIGINT", stop);
  try {
    await consumer.run();
  } catch (error) {
    process.stderr.write(`conformance client: ${(error as Error).name}: ${(error as Error).message}\n`);
    await exit(1);
  }
  process.stderr.write(`conformance client: stopped, ${JSON.stringify(consumer.stats)}\n`);
  await exit(0);
}

void main();
