import { Consumer } from "@triage/client";

const consumer = new Consumer({
  endpoint: process.env.TRIAGE_ENDPOINT!, // what `triage dev` prints as the consumer endpoint
  token: process.env.TRIAGE_TOKEN!,
  concurrency: 32,
  handler: async (message) => { // resolve: ack; throw: nack (a dead letter)
    if (message.value?.toString() === "poison") throw new Error("cannot handle this one");
    console.log(`partition ${message.partition} offset ${message.offset}: ${message.value}`);
  },
});
for (const signal of ["SIGINT", "SIGTERM"]) process.on(signal, () => void consumer.stop());
await consumer.run(); // start() + wait until stop() has drained every stream
