"""The gRPC side: the Consume/Topology service, the frame grammar and the wire encoding."""
