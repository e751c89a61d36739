"""Push delivery: the proxy calls a consumer's HTTP or gRPC endpoint instead of waiting for
a client to stream. A push target is, to the dispatcher, one more instance whose credits
are its adaptive concurrency limit: same window, leases, attempts and dead letters.
"""
