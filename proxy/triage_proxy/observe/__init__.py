"""What a proxy says about itself: snapshots, Prometheus metrics, the HTTP endpoint,
and log throttling."""
