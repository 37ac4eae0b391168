"""The shard's side of prefix caching: what each full KV block holds, and the checks on cache_len.

A v3 router owns the blocks and tells the shard, with `cache_len`, that the first blocks of a
request already hold its first tokens' keys and values. The shard cannot take that on trust: a
block that holds other tokens (another prompt, another LoRA adapter, a block since reused) would
silently give wrong tokens. So the shard records, for every block a sequence has filled, a hash
chain over the tokens through that block and the adapter (engine.wire.contract.chain_hashes, the
router's prefix cache keys its blocks with it too), and refuses (INVALID_ARGUMENT) a prefix
block whose record differs from the request's own tokens.
"""

from __future__ import annotations

from engine.batch import Request
from engine.errors import InvalidRequestError
from engine.wire.contract import chain_hashes


class BlockContents:
    """block -> hash chain of the tokens it holds, for blocks filled by a completed forward."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._hashes: dict[int, int] = {}

    def forget(self, blocks) -> None:
        """Blocks about to be written with new tokens hold nothing reusable any more."""
        for block in blocks:
            self._hashes.pop(block, None)

    def record(
        self, blocks: list[int], token_ids: list[int], adapter: str | None, filled: int
    ) -> None:
        """After a forward: the sequence's first `filled` tokens are in its blocks."""
        full = filled // self.block_size
        for block, value in zip(
            blocks[:full], chain_hashes(token_ids, self.block_size, adapter, full)
        ):
            self._hashes[block] = value

    def check_prefix(self, request: Request, token_ids: list[int]) -> None:
        count = request.cache_len // self.block_size
        expected = chain_hashes(token_ids, self.block_size, request.adapter_id, count)
        for position, (block, value) in enumerate(zip(request.blocks, expected)):
            if self._hashes.get(block) != value:
                raise InvalidRequestError(
                    f"request {request.id}: cache_len={request.cache_len}: prefix block {block} (block {position} "
                    "of the request) does not hold this request's tokens: it was never filled with them, or "
                    "has been reused since"
                )


def check_cache_len(request: Request, total_tokens: int, block_size: int, enabled: bool) -> None:
    """`total_tokens`: the prompt (and a resumed request's generated tokens), all to be in the cache."""
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
