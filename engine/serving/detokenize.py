"""Incremental detokenization: text of each new token without splitting multi-byte characters."""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


def decode_next(
    tokenizer, token_ids: list[int], prefix_offset: int, read_offset: int
) -> tuple[str, int, int]:
    """Text added by the tokens after `read_offset`, and the new (prefix_offset, read_offset).

    Decoding a token alone loses the spaces and bytes that depend on its neighbours, so the text of
    a window that starts a few tokens back is compared with and without the new tokens. While the
    tail is an incomplete UTF-8 sequence, nothing is emitted and the window waits for more tokens.
    """
    prefix = tokenizer.decode(token_ids[prefix_offset:read_offset], skip_special_tokens=False)
    full = tokenizer.decode(token_ids[prefix_offset:], skip_special_tokens=False)
    if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
        return full[len(prefix) :], read_offset, len(token_ids)
    return "", prefix_offset, read_offset
