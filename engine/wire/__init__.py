"""Generated gRPC stubs of proto/generate.proto (TGI generate.v3). Do not edit the generated modules:
regenerate them with `python scripts/gen_proto.py`; tests/test_wire_contract.py fails when they are stale."""
