"""What the scheduler refuses at submit: a request that could never run, and one the wire cannot
carry. Both are checked for each request alone, before it can share a batch with others: a value
that fails to serialize inside a Prefill would otherwise fail every request of that batch.
"""

from __future__ import annotations

import dataclasses
import math

from google.protobuf.descriptor import FieldDescriptor as F

from engine.batch import Request, kv_tokens
from engine.config import ServingLimits
from engine.wire import generate_pb2 as pb
from router.sched.allocator import BlockAllocator


class Overloaded(Exception):
    """Too many requests are queued or running: the caller should retry later (HTTP 429)."""


class ShardsUnavailable(Exception):
    """The shards cannot be reached (restarting, or gone): nothing new is accepted (HTTP 503)."""


FLOAT32_MAX = 3.4028234663852886e38
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def check_lengths(
    input_length: int, max_new_tokens: int, max_input_tokens: int, max_total_tokens: int
) -> None:
    """The length rules, in TGI's words (its clients parse them): the one place the router checks
    them, called by the HTTP validation and by the scheduler at submit (so the offline path, which
    skips HTTP, is checked the same). Raises ValueError."""
    if input_length < 1:
        raise ValueError("`inputs` cannot be empty")
    if input_length > max_input_tokens:
        raise ValueError(f"`inputs` tokens must be <= {max_input_tokens}. Given: {input_length}")
    if max_new_tokens < 1:
        raise ValueError("`max_new_tokens` must be strictly positive")
    if input_length + max_new_tokens > max_total_tokens:
        raise ValueError(
            f"`inputs` tokens + `max_new_tokens` must be <= {max_total_tokens}. "
            f"Given: {input_length} `inputs` tokens and {max_new_tokens} `max_new_tokens`"
        )


def check_request(
    request: Request,
    input_length: int,
    limits: ServingLimits,
    allocator: BlockAllocator,
    chunking: bool = False,
) -> None:
    """Refuse what could never run: such a request would otherwise wait at the head forever.
    `chunking`: the shards compute a prompt beyond the prefill budget in chunks."""
    max_new = request.stopping_parameters.max_new_tokens
    if request.blocks or request.slots:
        raise ValueError(f"request {request.id}: blocks and slots are the scheduler's to assign")
    longest = (
        limits.max_input_tokens
        if chunking
        else min(limits.max_input_tokens, limits.max_prefill_tokens)
    )
    check_lengths(input_length, max_new, longest, limits.max_total_tokens)
    needed = allocator.blocks_for(kv_tokens(input_length, max_new))
    usable = allocator.num_blocks - 1
    if needed > usable:  # block 0 is reserved
        raise ValueError(f"request {request.id} needs {needed} KV blocks, the cache has {usable}")
    check_wire(request)


def check_wire(request: Request) -> None:
    """Refuse what a Prefill could not serialize, field by field against the protocol's types:
    integers past their wire type and text that is not valid Unicode; float fields must be finite
    float32 (protobuf would quietly send 1e300 as inf). Nothing is serialized here: the client
    does that once, for the batch it sends."""
    for name in FLOAT_FIELDS:
        value = getattr(request.parameters, name)
        if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            raise ValueError(
                f"request {request.id}: parameters.{name} must be a finite float32, got {value}"
            )
    problem = wire_problem(request) or _logit_bias_problem(request.parameters.logit_bias)
    if problem:
        raise ValueError(f"request {request.id} cannot be sent to the shards: {problem}")


INT_RANGES = {
    F.TYPE_UINT32: (0, 2**32),
    F.TYPE_UINT64: (0, 2**64),
    F.TYPE_INT32: (-(2**31), 2**31),
    F.TYPE_INT64: (-(2**63), 2**63),
}


def wire_problem(message, kind=pb.Request, prefix: str = "") -> str:
    """Why the first field of `message` (a Request or one of its parts) that its wire type cannot
    hold does not fit ("" when every field fits)."""
    for item in dataclasses.fields(message):
        descriptor = kind.DESCRIPTOR.fields_by_name.get(item.name)
        if descriptor is None:
            continue  # carried in other wire fields (logit_bias: ids and values), checked apart
        value = getattr(message, item.name)
        if dataclasses.is_dataclass(value):
            nested = wire_problem(value, getattr(pb, type(value).__name__), f"{prefix}{item.name}.")
            if nested:
                return nested
            continue
        for one in value if isinstance(value, (list, tuple)) else [value]:
            why = _unfit(descriptor, one)
            if why:
                return f"{prefix}{item.name} does not fit the wire ({why})"
    return ""


def _unfit(descriptor, value) -> str:
    if value is None:
        return ""  # an unset optional field
    if descriptor.type in INT_RANGES:
        low, high = INT_RANGES[descriptor.type]
        if not isinstance(value, int) or not low <= value < high:
            return f"{value!r} is not an integer in [{low}, {high})"
    elif descriptor.type == F.TYPE_ENUM:
        if int(value) not in descriptor.enum_type.values_by_number:
            return f"{value!r} is not one of {descriptor.enum_type.name}"
    elif descriptor.type == F.TYPE_STRING:
        if not isinstance(value, str):
            return f"{value!r} is not text"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "the text is not valid Unicode (an unpaired surrogate)"
    elif descriptor.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE) and not isinstance(value, (int, float)):
        return f"{value!r} is not a number"
    return ""


def _logit_bias_problem(logit_bias: dict) -> str:
    for token, bias in logit_bias.items():
        if not (isinstance(token, int) and 0 <= token < 2**32):
            return f"parameters.logit_bias does not fit the wire (token id {token!r}: not a uint32)"
        finite = isinstance(bias, (int, float)) and math.isfinite(bias) and abs(bias) <= FLOAT32_MAX
        if not finite:
            return f"parameters.logit_bias does not fit the wire ({bias!r}: not a finite float32)"
    return ""
