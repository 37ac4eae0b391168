"""What a bucketserve router and shard agree on besides the generate.v3 messages themselves.

proto/CONTRACT.md lists all of it for readers; this module is its code, imported by both sides:
the one gRPC metadata key that remains (W3C `traceparent`, a standard, not our extension: every
extension of ours is a proto field numbered from 1000), the error -> status code mapping, the
message limits, the reserved KV block, and the hash chain that keys a KV block by its tokens.
"""

from __future__ import annotations

import grpc

from engine.errors import CapacityError, InvalidRequestError, UnwarmedShapeError

# A Prefill of a large batch with prompt logprobs is big: both sides raise gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

# OpenAI's cap on `logit_bias` entries per request; graph devices apply the bias as a
# [rows, MAX_LOGIT_BIAS] sparse input (engine/sampling/static.py), so it is a hard limit:
# the router answers more with HTTP 422, the shard with INVALID_ARGUMENT.
MAX_LOGIT_BIAS = 300

# Block 0 of the KV cache is never handed out: padding tokens write there and padding blocks read
# from it, and TGI's router health-probes a shard with a 1-token Prefill on blocks=[0], slots=[0].
RESERVED_BLOCK = 0

# The W3C trace context of a traced step (one per RPC), as OpenTelemetry's gRPC instrumentation
# reads it, TGI's shards included. Our shards read the per-request contexts of the step requests'
# `traceparents` field instead, since one step carries many traced requests.
TRACEPARENT_METADATA_KEY = "traceparent"
# A multi-node group's shard secret, as gRPC's standard `authorization: Bearer SECRET` on every
# call to a shard's TCP port (engine/serving/remote.py): authentication, not a protocol extension
SHARD_SECRET_HEADER = "authorization"


def shard_secret_metadata(secret: str | None) -> tuple[tuple[str, str], ...]:
    return ((SHARD_SECRET_HEADER, f"Bearer {secret}"),) if secret else ()


# Checked in order: InvalidRequestError is a ValueError, and a subclass must win over its base.
ERROR_STATUS = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (KeyError, grpc.StatusCode.NOT_FOUND),  # the shard's "batch N not found"
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnwarmedShapeError, grpc.StatusCode.FAILED_PRECONDITION),
)
# Anything else is a fault of the shard, not of the request.
UNEXPECTED_STATUS = grpc.StatusCode.INTERNAL


def status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and details of a shard error (the same in process and over gRPC)."""
    for kind, code in ERROR_STATUS:
        if isinstance(error, kind):
            # str(KeyError("x")) is "'x'": take the message itself.
            keyed = isinstance(error, KeyError) and error.args
            return code, str(error.args[0]) if keyed else str(error)
    return UNEXPECTED_STATUS, f"{type(error).__name__}: {error}"


def chain_hashes(
    token_ids: list[int], block_size: int, adapter: str | None, count: int
) -> list[int]:
    """Hash of each of the first `count` full blocks, each covering every token before it too.

    What a KV block's contents depend on: its tokens, every token before them, and the LoRA adapter.
    The router keys its prefix cache with it and the shard checks a router's `cache_len` with it;
    each side compares only hashes it computed itself (Python salts str hashes per process)."""
    hashes, previous = [], hash(("bucketserve-kv", adapter or ""))
    for block in range(count):
        previous = hash((previous, tuple(token_ids[block * block_size : (block + 1) * block_size])))
        hashes.append(previous)
    return hashes
