/** A flag that can be awaited, with a timeout: the consumer's events (stopping, refresh). */
export class Flag {
  private value = false;
  private waiters: (() => void)[] = [];

  get isSet(): boolean {
    return this.value;
  }

  set(): void {
    this.value = true;
    const waiters = this.waiters;
    this.waiters = [];
    for (const wake of waiters) {
      wake();
    }
  }

  clear(): void {
    this.value = false;
  }

  /** Resolves when set, or after `ms`. */
  wait(ms = Infinity): Promise<void> {
    if (this.value) {
      return Promise.resolve();
    }
    return new Promise((resolve) => {
      const done = (): void => {
        if (timer !== null) {
          clearTimeout(timer);
        }
        // set() has already taken the list it wakes; a timeout leaves the current one.
        const index = this.waiters.indexOf(done);
        if (index >= 0) {
          this.waiters.splice(index, 1);
        }
        resolve();
      };
      const timer = ms === Infinity ? null : setTimeout(done, ms);
      this.waiters.push(done);
    });
  }
}
