"""The shard's side of prefix caching: the checks on cache_len.

A v3 router owns the blocks and tells the shard, with `cache_len`, that the first blocks of a
request already hold its first tokens' keys and values. The shard cannot take that on trust: a
block that holds other tokens (another prompt, another LoRA adapter, a block since reused) would
silently give wrong tokens. So the shard records, for every block a sequence has filled, a hash
chain over the tokens through that block and the adapter (engine.kv_cache.BlockContents, with
engine.wire.contract.chain_hashes: the router's prefix cache keys its blocks with it too), and
refuses (INVALID_ARGUMENT) a prefix block whose record differs from the request's own tokens.
"""

from __future__ import annotations

from engine.batch import Request
from engine.errors import InvalidRequestError
from engine.kv_cache import BlockContents


def check_prefix(contents: BlockContents, request: Request, token_ids: list[int]) -> None:
    """Refuses a request whose cache_len names blocks that do not hold its tokens."""
    count = request.cache_len // contents.block_size
    position = contents.held(request.blocks, token_ids, request.adapter_id, count)
    if position < count:
        raise InvalidRequestError(
            f"request {request.id}: cache_len={request.cache_len}: prefix block "
            f"{request.blocks[position]} (block {position} of the request) does not hold this "
            "request's tokens: it was never filled with them, or has been reused since"
        )


def check_cache_len(request: Request, total_tokens: int, block_size: int, enabled: bool) -> None:
    """`total_tokens`: the prompt (and a resumed request's generated tokens), all to be in the
    cache."""
    cache_len = request.cache_len
    if not cache_len:
        return
    where = f"request {request.id}: cache_len={cache_len}"
    if not enabled:
        raise InvalidRequestError(
            f"{where}: this shard serves without prefix caching (--prefix-caching off)"
        )
    if cache_len % block_size:
        raise InvalidRequestError(
            f"{where} is not a whole number of KV blocks of {block_size} tokens"
        )
    if cache_len >= total_tokens:
        raise InvalidRequestError(
            f"{where} leaves nothing to compute of a prompt of {total_tokens} tokens "
            "(at least its last token must be computed)"
        )
    if len(request.blocks) * block_size < cache_len:
        raise InvalidRequestError(
            f"{where}: the request's {len(request.blocks)} blocks cannot hold the cached prefix"
        )
    if request.prefill_logprobs:
        raise InvalidRequestError(
            f"{where}: prefill_logprobs needs every prompt token computed; send cache_len=0"
        )
