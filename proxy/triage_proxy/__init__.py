"""Triage proxy: fetches a topic's partitions and fans their records out to consumers."""
