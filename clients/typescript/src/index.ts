/**
 * Triage client for Node.js: consume a Kafka topic through the Triage proxies with a plain
 * handler.
 *
 *     import { Consumer, Retry } from "@triage/client";
 *
 *     const consumer = new Consumer({
 *       endpoint: "proxy:7700",           // any proxy of the deployment: every partition
 *       token: process.env.TRIAGE_TOKEN!,
 *       concurrency: 32,
 *       handler: async (message) => {     // resolve to ack; throw to nack (dead-letter);
 *         ...                             // throw new Retry() to redeliver later
 *       },
 *     });
 *     await consumer.start();
 *     process.on("SIGTERM", () => void consumer.stop());
 */

export { Consumer, type ConsumerOptions } from "./consumer";
export {
  AuthenticationError,
  EndpointError,
  PartitionError,
  Retry,
  StateError,
  StreamError,
  TriageClientError,
} from "./errors";
export type { Logger } from "./log";
export type { ConsumerStats, Headers, Message, PartitionStats } from "./message";
export { MAX_REASON_CHARS, type ErrorClass, type Handler } from "./pool";
