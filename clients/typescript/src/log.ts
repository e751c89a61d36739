/**
 * Where the client's log lines go. The default writes warnings and errors to stderr and
 * drops the rest (as an unconfigured Python logger does); pass `logger: console` for all
 * of them, or any object with these four methods. Payloads and tokens are never logged.
 */

export interface Logger {
  debug(message: string): void;
  info(message: string): void;
  warn(message: string): void;
  error(message: string): void;
}

const quiet = (): void => {};

export const DEFAULT_LOGGER: Logger = {
  debug: quiet,
  info: quiet,
  warn: (message) => console.error(`triage: ${message}`),
  error: (message) => console.error(`triage: ${message}`),
};
