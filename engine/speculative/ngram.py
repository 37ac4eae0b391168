"""Prompt lookup (n-gram) proposals: where a sequence's newest n tokens occurred before, in its
prompt or its output, propose the tokens that followed them there.

Input-grounded work (rewriting, editing or quoting a given text) repeats long runs of the prompt,
so the continuation of an earlier occurrence is often exactly what the model writes next. The
index is built incrementally per sequence (a sequence's token list only ever grows: rejected
proposals are never appended), so each step costs a few dictionary operations, not a scan.
"""

from __future__ import annotations

MAX_NGRAM = 3  # the longest suffix looked up; longer matches first (a more specific context)
MIN_NGRAM = 1


class NgramIndex:
    """For every n-gram (MIN_NGRAM..MAX_NGRAM tokens) of one sequence, where it last ended, among
    the positions that have a following token."""

    def __init__(self) -> None:
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the index
        self.shadows: list[tuple[int, list[int]]] = []  # (where, proposal) not verified: below

    def shadow(self, tokens: list[int], count: int) -> None:
        """While speculation is off: note what would be proposed now, to compare with the tokens
        plain decoding then chooses (a proposal is accepted exactly while it matches them)."""
        proposal = self.propose(tokens, count)
        if proposal:
            self.shadows.append((len(tokens), proposal))

    def settle_shadows(self, tokens: list[int]) -> list[tuple[int, int]]:
        """(proposed, accepted) of every noted proposal whose outcome the tokens now tell: all of
        it matched, or a token differed. The others stay noted."""
        settled, waiting = [], []
        for start, proposal in self.shadows:
            chosen = tokens[start : start + len(proposal)]
            matched = 0
            while matched < len(chosen) and chosen[matched] == proposal[matched]:
                matched += 1
            if matched < len(chosen) or len(chosen) == len(proposal):
                settled.append((len(proposal), matched))
            else:
                waiting.append((start, proposal))
        self.shadows = waiting
        return settled

    def propose(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` found; [] when no suffix occurred before."""
        if count < 1:
            return []
        self._extend(tokens)
        for size in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
            end = self._last_end.get(tuple(tokens[-size:]))
            if end is not None:
                return tokens[end : end + count]
        return []

    def _extend(self, tokens: list[int]) -> None:
        """Index the n-grams ending at positions `_indexed`..len-1: each has a following token, and
        a later occurrence replaces an earlier one (the most recent context is the likeliest)."""
        for end in range(max(self._indexed, 1), len(tokens)):
            for size in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                self._last_end[tuple(tokens[end - size : end])] = end
        self._indexed = max(self._indexed, len(tokens))
