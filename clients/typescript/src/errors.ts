/**
 * Errors the client raises, grouped by what the caller does next.
 *
 *     TriageClientError            root; `retriable` says whether running again can help
 *     +-- StreamError              the proxy refused the stream for good (bad Hello): fix the
 *     |   |                        settings (not retriable)
 *     |   +-- AuthenticationError  the proxy refused the token: fix the token
 *     |   +-- EndpointError        the endpoint is not a Triage proxy: fix the endpoint
 *     +-- PartitionError           `partitions: [...]` names a partition the topic lacks
 *     +-- StateError               start() called twice on one Consumer (a bug)
 *
 * Transient failures (a proxy restarting, a partition failing over, the network) are never
 * raised: the consumer reconnects. `errorForStatus` and `speaksGrpc` decide which gRPC
 * outcome is which, in one place (the same rules as the Python client's errors.py).
 *
 * `Retry` is not an error the client raises: a handler throws it to ask for redelivery.
 */

import { status as Status } from "@grpc/grpc-js";

/** Root of every error the client raises on purpose. */
export class TriageClientError extends Error {
  /** Whether running again, unchanged, can help. */
  readonly retriable: boolean = false;

  constructor(message: string) {
    super(message);
    this.name = new.target.name;
  }
}

/** The proxy ended the stream with a status that reconnecting will not fix. */
export class StreamError extends TriageClientError {
  /** The gRPC status code the proxy ended the stream with. */
  readonly code: Status;
  /** The proxy's explanation, if it gave one. */
  readonly details: string;

  constructor(code: Status, details: string, message?: string) {
    super(message ?? `proxy refused the stream: ${statusName(code)}: ${details || "no details"}`);
    this.code = code;
    this.details = details;
  }
}

/** The proxy refused the token (missing, wrong or not allowed). */
export class AuthenticationError extends StreamError {
  constructor(code: Status, details: string) {
    super(
      code,
      details,
      `authentication failed: the proxy refused the token (${statusName(code)}: ${details || "no details"})`,
    );
  }
}

/** The endpoint the Consumer was given is not a Triage proxy. */
export class EndpointError extends StreamError {
  /** The endpoint as the Consumer was given it. */
  readonly endpoint: string;

  constructor(endpoint: string, code: Status, details: string, why: string) {
    super(
      code,
      details,
      `${endpoint} is not a Triage proxy: ${why} (${statusName(code)}: ${details || "no details"})`,
    );
    this.endpoint = endpoint;
  }
}

/** `partitions: [...]` names partitions this deployment's topic does not have. */
export class PartitionError extends TriageClientError {
  /** The partitions asked for that the topic lacks, sorted. */
  readonly missing: number[];

  constructor(missing: Iterable<number>, message: string) {
    super(message);
    this.missing = [...missing].sort((a, b) => a - b);
  }
}

/** A lifecycle method was called in a state that does not allow it. */
export class StateError extends TriageClientError {}

/**
 * Throw from a handler to nack with retry: the proxy redelivers the message after its
 * backoff (until its attempt limit) instead of dead-lettering it now. Named as an
 * instruction rather than FooError: `throw new Retry("downstream busy")`.
 */
export class Retry extends Error {
  constructor(message = "retry requested") {
    super(message);
    this.name = "Retry";
  }
}

/** "UNAUTHENTICATED" for 16: how logs and errors name a status code. */
export function statusName(code: Status): string {
  return Status[code] ?? `status ${code}`;
}

const AUTH_CODES: ReadonlySet<Status> = new Set([Status.UNAUTHENTICATED, Status.PERMISSION_DENIED]);
// Statuses that mean "this stream can never work as configured". Everything else (UNAVAILABLE,
// CANCELLED, INTERNAL, FAILED_PRECONDITION ...) is a proxy or network hiccup, or a partition
// that moved, and is retried: a long-running consumer outlives a proxy restart or a failover.
const FATAL_CODES: ReadonlySet<Status> = new Set([Status.INVALID_ARGUMENT]);
// grpc-js's words when the peer answered, but not as a gRPC server (an HTTP/1 server such
// as the proxy's metrics port, or an HTTP/2 server answering a plain error page).
const NOT_GRPC = ["Protocol error", "Received HTTP status code", "http1.x server"];

/** False when a failed call's details show that the peer is not a gRPC server at all. */
export function speaksGrpc(details: string | undefined): boolean {
  const text = details ?? "";
  return !NOT_GRPC.some((words) => text.includes(words));
}

/** The error to raise for a failed stream, or null when reconnecting may help. */
export function errorForStatus(
  code: Status,
  details: string,
  endpoint = "the endpoint",
): StreamError | null {
  if (AUTH_CODES.has(code)) {
    return new AuthenticationError(code, details);
  }
  if (code === Status.UNIMPLEMENTED) {
    return new EndpointError(endpoint, code, details, "it does not serve Triage's Consume");
  }
  if (FATAL_CODES.has(code)) {
    return new StreamError(code, details);
  }
  return null;
}
