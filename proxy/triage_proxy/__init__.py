"""Triage proxy: one process per Kafka partition, fanning messages out over gRPC."""
