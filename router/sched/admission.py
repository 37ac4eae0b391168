"""What the scheduler refuses at submit: a request that could never run, and one the wire cannot
carry. Both are checked for each request alone, before it can share a batch with others: a value
that fails to serialize inside a Prefill would otherwise fail every request of that batch.
"""
from __future__ import annotations

import dataclasses
import enum
import math

from engine.batch import Request, kv_tokens
from engine.config import ServingLimits
from engine.wire import generate_pb2 as pb
from engine.wire import convert
from router.sched.allocator import BlockAllocator


class Overloaded(Exception):
    """Too many requests are queued or running: the caller should retry later (HTTP 429)."""


class ShardsUnavailable(Exception):
    """The shards cannot be reached (restarting, or gone): nothing new is accepted (HTTP 503)."""


FLOAT32_MAX = 3.4028234663852886e38
FLOAT_FIELDS = ("temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def check_request(request: Request, input_length: int, limits: ServingLimits, allocator: BlockAllocator,
                  chunking: bool = False) -> None:
    """Refuse what could never run: such a request would otherwise wait at the head forever.
    `chunking`: the shards compute a prompt beyond the prefill budget in chunks."""
    max_new = request.stopping_parameters.max_new_tokens
    if request.blocks or request.slots:
        raise ValueError(f"request {request.id}: blocks and slots are the scheduler's to assign")
    if input_length < 1 or max_new < 1:
        raise ValueError(f"request {request.id}: need input_length >= 1 and max_new_tokens >= 1")
    longest = limits.max_input_tokens if chunking else min(limits.max_input_tokens, limits.max_prefill_tokens)
    if input_length > longest:
        raise ValueError(f"request {request.id}: {input_length} input tokens exceed the limit of {longest}")
    if input_length + max_new > limits.max_total_tokens:
        raise ValueError(f"request {request.id}: {input_length} + {max_new} tokens exceed "
                         f"max_total_tokens={limits.max_total_tokens}")
    needed, usable = allocator.blocks_for(kv_tokens(input_length, max_new)), allocator.num_blocks - 1
    if needed > usable:  # block 0 is reserved
        raise ValueError(f"request {request.id} needs {needed} KV blocks, the cache has {usable}")
    check_wire(request)


def check_wire(request: Request) -> None:
    """Serialize the request as a Prefill will: integers past their wire type and text that is not
    valid Unicode raise here; float fields must be finite float32 (protobuf would quietly send
    1e300 as inf)."""
    for name in FLOAT_FIELDS:
        value = getattr(request.parameters, name)
        if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            raise ValueError(f"request {request.id}: parameters.{name} must be a finite float32, got {value}")
    try:
        convert.request_to_pb(request)
    except (ValueError, TypeError) as error:  # UnicodeEncodeError is a ValueError
        raise ValueError(f"request {request.id} cannot be sent to the shards: "
                         f"{wire_field(request) or 'a field'} does not fit the wire ({error})") from None


def wire_field(message, kind=pb.Request, prefix: str = "") -> str:
    """The first field of `message` (a Request or one of its parts) that does not serialize."""
    for item in dataclasses.fields(message):
        if item.name not in kind.DESCRIPTOR.fields_by_name:
            continue  # carried in other wire fields (logit_bias: ids and values), checked at validation
        value = getattr(message, item.name)
        if dataclasses.is_dataclass(value):
            nested = wire_field(value, getattr(pb, type(value).__name__), f"{prefix}{item.name}.")
            if nested:
                return nested
            continue
        try:
            kind(**{item.name: int(value) if isinstance(value, enum.IntEnum) else value})
        except (ValueError, TypeError):
            return prefix + item.name
    return ""
