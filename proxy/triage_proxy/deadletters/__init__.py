"""Dead letters on their way out: the durable writer and the aggregated notifier."""
