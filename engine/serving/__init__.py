"""Serving one shard: the Shard object implementing generate.v3's operations on dataclasses
(shard.py, steps.py, sequence.py, detokenize.py) and its thin gRPC server (server.py;
the protobuf conversion is engine/wire/). The top of the engine: it may import any engine folder."""
