/** The gRPC clients (channels) of one Consumer: one per endpoint, shared by its streams and topology reads. */

import { Client, type ChannelCredentials } from "@grpc/grpc-js";

import { CLIENT_MAX_FRAME_BYTES } from "./generated/constants";
import { INITIAL_BACKOFF_MS } from "./stream";

/** Opens a client to an endpoint when first asked, and closes them all at the end. */
export class Channels {
  private readonly clients = new Map<string, Client>();

  constructor(
    private readonly credentials: ChannelCredentials,
    private readonly maxBackoffMs: number,
  ) {}

  /** The endpoints a client is open to. */
  endpoints(): string[] {
    return [...this.clients.keys()];
  }

  /** The one client to `target`. */
  client(target: string): Client {
    let client = this.clients.get(target);
    if (client === undefined) {
      client = new Client(target, this.credentials, {
        "grpc.max_receive_message_length": CLIENT_MAX_FRAME_BYTES,
        "grpc.max_send_message_length": CLIENT_MAX_FRAME_BYTES,
        // gRPC's own reconnect backoff defaults to 1 s growing to 120 s; keep it in step
        // with ours so a restarted proxy is found again within maxBackoffMs.
        "grpc.initial_reconnect_backoff_ms": INITIAL_BACKOFF_MS,
        "grpc.max_reconnect_backoff_ms": this.maxBackoffMs,
      });
      this.clients.set(target, client);
    }
    return client;
  }

  close(): void {
    for (const client of this.clients.values()) {
      client.close();
    }
  }
}
