"""Offline generation through an in-process shard and the router's scheduler: the `generate` and
`bench` commands use it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.batch import ImageInput, Request, StoppingCriteriaParameters, WarmupResult
from engine.errors import InvalidRequestError
from engine.serving.recompute import recompute_length
from engine.serving.shard import Shard


@dataclass
class Completion:
    prompt: str
    token_ids: list[int]
    text: str
    finish_reason: str


def chat_prompt(tokenizer, prompt: str) -> str:
    """The prompt as one user turn of the model's chat template, ready for the assistant's
    answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("--chat: this model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def token_count(shard: Shard, text: str, add_special_tokens: bool) -> int:
    return len(shard.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def request_length(shard: Shard, request: Request) -> int:
    """The prompt's tokens, a vision-language model's images expanded to their image tokens."""
    if request.chunks is not None and shard.vision is not None:
        return len(shard.vision.prompt_ids(request))
    return token_count(shard, request.inputs, request.add_special_tokens)


def prompt_lengths(shard: Shard, texts: list[str], add_special_tokens: bool) -> list[int]:
    return [token_count(shard, t, add_special_tokens) for t in texts]


def warm_for(
    shard: Shard,
    texts: list[str],
    max_new_tokens: int,
    add_special_tokens: bool,
    lengths: list[int] | None = None,
) -> WarmupResult:
    """Warm only the buckets this workload can use: generation knows its prompts in advance
    (`lengths`: the prompts' token counts where the texts alone do not say, as with images)."""
    if max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    lengths = lengths or prompt_lengths(shard, texts, add_special_tokens)
    limit = shard.config.max_input_tokens
    if max(lengths) > limit:
        raise InvalidRequestError(
            f"a prompt of {max(lengths)} tokens exceeds --max-input-tokens {limit}"
        )
    # A model that recomputes a sequence's cache at some position (Phi-3 longrope) prefills it
    # whole.
    longest = max(max(lengths), recompute_length(shard.model, max(lengths) + max_new_tokens))
    return shard.warmup(
        max_input_tokens=longest,
        max_total_tokens=longest + max_new_tokens,
        max_prefill_tokens=max(longest, min(shard.config.max_prefill_tokens, sum(lengths))),
        max_batch_size=min(len(texts), shard.config.max_batch_size),
    )


def run_requests(
    shard: Shard, requests: list[Request], seconds: dict | None = None
) -> dict[int, Completion]:
    """The completion of every request, through the router's continuous-batching scheduler in this
    process (the same batching as serving). `seconds`, when given, accumulates the shard's time in
    "prefill" and "decode"."""
    from router.offline import run_scheduled  # the router builds on the engine: imported on use

    lengths = [request_length(shard, r) for r in requests]
    outputs = run_scheduled(
        shard, requests, lengths, shard.runner.kv_cache.capacity_tokens, seconds
    )
    done = {}
    for request in requests:
        generations = outputs[request.id]
        last = generations[-1].generated_text
        done[request.id] = Completion(
            request.inputs,
            [t for g in generations for t in g.tokens.ids],
            last.text,
            last.finish_reason.name.lower(),
        )
    return done


def with_images(pieces: list[str], images) -> list:
    """Text pieces with an image between each two, empty pieces left out."""
    chunks = []
    for piece, image in zip(pieces, [*images, None]):
        chunks += [piece] if piece else []
        chunks += [image] if image is not None else []
    return chunks


def generate(
    shard: Shard,
    prompts: list[str],
    max_new_tokens: int,
    chat: bool = False,
    ignore_eos: bool = False,
    images: list[ImageInput] = (),
) -> list[Completion]:
    """`images`: given to every prompt, before its text (a vision-language model's)."""
    if images and shard.vision is None:
        raise InvalidRequestError("--image: this model does not take images (a text-only model)")
    marker = "\x00image\x00"
    contents = [marker * len(images) + p for p in prompts]
    texts = [chat_prompt(shard.tokenizer, c) for c in contents] if chat else contents
    # A chat template writes its own special tokens; a plain prompt gets the tokenizer's.
    add_special = not chat
    stopping = StoppingCriteriaParameters(
        max_new_tokens=max_new_tokens, ignore_eos_token=ignore_eos
    )
    requests = []
    for i, text in enumerate(texts):
        chunks = with_images(text.split(marker), images) if images else None
        text = text.replace(marker, "")
        requests.append(
            Request(
                i, text, stopping_parameters=stopping, add_special_tokens=add_special, chunks=chunks
            )
        )
    lengths = [request_length(shard, r) for r in requests]
    warm_for(shard, texts, max_new_tokens, add_special, lengths)
    done = run_requests(shard, requests)
    for i, prompt in enumerate(prompts):
        done[i].prompt = prompt
    return [done[i] for i in range(len(prompts))]
