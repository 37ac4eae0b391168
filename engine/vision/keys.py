"""Prefix-cache keys of a prompt with images. An image's tokens are one placeholder id repeated,
so two prompts with the same text and different images have equal token ids: hashing the ids
alone would let one reuse the other's KV (wrong tokens). Here each image token is replaced by a
key made of the image's content hash and the token's index inside the image, and the KV blocks
are hashed over these keyed ids (engine.wire.contract.chain_hashes), on the router and on the
shard alike: a repeated image finds its KV, a different image never does.

Keys are negative, so they never equal a token id; the index inside the image tells where the
image begins (`image_start`), which the router uses so that what it registers never ends inside
an image whose tokens the shard computes in one forward (engine/serving/chunks.py)."""

from __future__ import annotations

import hashlib

INDEX_BITS = 24  # an image's tokens are counted in the key's low bits (16M tokens at most)
DIGEST_BYTES = 8


def image_digest(data: bytes) -> int:
    """The image's content hash (of its file's bytes, as sent)."""
    return int.from_bytes(hashlib.sha256(data).digest()[:DIGEST_BYTES], "big")


def image_key(digest: int, index: int) -> int:
    """The key of the `index`-th token of the image with content hash `digest`."""
    return -1 - ((digest << INDEX_BITS) | index)


def is_image_key(value: int) -> bool:
    return value < 0


def image_start(keyed: list[int], position: int) -> int:
    """Where the image holding `position` begins (position itself for a text token)."""
    value = keyed[position]
    return position - ((-1 - value) & ((1 << INDEX_BITS) - 1)) if value < 0 else position


def image_spans(ids: list[int], image_token_id: int, counts: list[int]) -> list[tuple[int, int]]:
    """Each image's [first, last) positions, for images of `counts` tokens in prompt order (an
    image's placeholder is its image token `count` times; a model may put other tokens, such as
    row ends, between them: they belong to the image's span)."""
    places = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(places) != sum(counts):
        raise ValueError(f"{len(places)} image tokens in the prompt, {sum(counts)} expected")
    spans, taken = [], 0
    for count in counts:
        spans.append((places[taken], places[taken + count - 1] + 1))
        taken += count
    return spans


def keyed_ids(ids: list[int], image_token_id: int, images: list[tuple[bytes, int]]) -> list[int]:
    """`ids` with each image token replaced by its image's key: `images` is (bytes, tokens) of
    every image in prompt order. Tokens after the prompt (generated ones) stay as they are."""
    keyed = list(ids)
    places = iter(i for i, t in enumerate(ids) if t == image_token_id)
    for data, count in images:
        digest = image_digest(data)
        for index in range(count):
            keyed[next(places)] = image_key(digest, index)
    return keyed
