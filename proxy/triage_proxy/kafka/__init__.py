"""The Kafka edge: the client factory, the process's reader, group assignment.

librdkafka's errors become the proxy's own here and nowhere else.
"""
