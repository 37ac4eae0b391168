"""The wire contract between a router and a shard, in one place (proto/CONTRACT.md describes it):

- generate_pb2*.py: the stubs generated from proto/generate.proto (TGI generate.v3 plus our
  extension fields, numbered from 1000). Do not edit them: regenerate them with
  `python scripts/gen_proto.py`; tests/test_wire_contract.py fails when they are stale.
- convert.py: protobuf <-> the engine's dataclasses, for both sides.
- contract.py: what is agreed beyond the messages: status codes, limits, the reserved KV block,
  the one metadata key (W3C `traceparent`) and the hash chain that keys a KV block by its tokens.

The router imports this package, never the shard's serving code.
"""
