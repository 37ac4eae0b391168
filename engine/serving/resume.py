"""A request resumed after a shard restart: its prompt and the tokens it had generated are
prefilled together, and its state is put back where it was after those tokens, so the next token
is the one the shard would have chosen without the restart (preemption resumes the same way:
docs/architecture.md#resuming). The router sends the generated tokens in the Prefill request
(`Request.resume_tokens`, proto/CONTRACT.md).
"""

from __future__ import annotations

from engine.errors import InvalidRequestError
from engine.sampling.sampler import skip_draws
from engine.serving.detokenize import decode_next
from engine.serving.sequence import Sequence


def check_resumed(
    request_id: int,
    prompt_len: int,
    generated: list[int],
    max_new_tokens: int,
    max_input_tokens: int,
    vocab_size: int,
) -> None:
    where = f"request {request_id}: resumed tokens"
    if not generated or len(generated) >= max_new_tokens:
        raise InvalidRequestError(
            f"{where}: {len(generated)} tokens, it may generate {max_new_tokens}: "
            "a resumed request has between 1 and max_new_tokens - 1"
        )
    if prompt_len + len(generated) > max_input_tokens:
        raise InvalidRequestError(
            f"{where}: the prompt and its {len(generated)} generated tokens exceed "
            f"max_input_tokens={max_input_tokens}, the longest prefill"
        )
    bad = next((t for t in generated if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"{where}: token id {bad} is not in the vocabulary of {vocab_size}"
        )


def replay(tokenizer, seq: Sequence, generated: list[int]) -> None:
    """Append `generated` to a new sequence as its steps would have: detokenized text (for stop
    sequences), the grammar's state, and the random draws of a sampled request."""
    for token in generated:
        seq.token_ids.append(token)
        text, seq.prefix_offset, seq.read_offset = decode_next(
            tokenizer, seq.token_ids, seq.prefix_offset, seq.read_offset
        )
        seq.output_text += text
        if seq.grammar is not None:
            seq.grammar.advance(token)
    skip_draws(seq.sampling, len(generated))
