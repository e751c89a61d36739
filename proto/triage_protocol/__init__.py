"""Triage's wire contract for Python: `triage_pb2` and `triage_pb2_grpc` (generated from
proto/triage/v1/triage.proto by proto/generate.py, with `.pyi` stubs) and `constants`.

The proxy and the Python client both depend on this distribution, so the wire format is
the contract's, not whichever client version is installed. This module imports nothing:
`from triage_protocol.constants import ...` loads neither grpc nor protobuf.
"""
