"""OpenAI response pieces: finish reasons, usage, logprobs, and the server-sent events of a stream.

A stream of `n` choices reads its sequences concurrently (`merged`) and renders each one's
generations with its own renderer, which numbers its chunks with the choice's index; the usage chunk
(when asked) and `[DONE]` come once, after the last choice has finished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import jsonschema

from engine.batch import FinishReason, Generation
from router.http import tools
from router.http.reasoning import Delta, ReplyReasoning
from router.http.state import finite

log = logging.getLogger(__name__)


def finish_reason(generation: Generation) -> str:
    return "length" if generation.generated_text.finish_reason == FinishReason.LENGTH else "stop"


def reply_problem(response_format: dict | None, text: str) -> str | None:
    """Why a finished reply does not match its `response_format` (None: it does, or the format
    asks for no JSON): json_object wants a JSON object, json_schema (and TGI's `json`) its
    schema."""
    kind = (response_format or {}).get("type")
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
    elif kind == "json":
        schema = response_format.get("value")
    elif kind == "json_object":
        schema = {"type": "object"}
    else:
        return None
    try:
        reply = json.loads(text)
    except ValueError as error:
        return f"it is not JSON ({error})"
    if not isinstance(schema, dict):  # TGI's `json` may send a schema the grammar reads otherwise
        return None
    error = jsonschema.exceptions.best_match(
        jsonschema.validators.validator_for(schema)(schema).iter_errors(reply)
    )
    return None if error is None else f"it does not validate against its schema: {error.message}"


class ReplyCheck:
    """Checks a finished reply against its `response_format`. The grammar builds replies that match,
    so a mismatch is a fault worth seeing: it is logged, naming the request, and counted; the text
    is still returned as it is. A reply cut by the token limit is not checked: it may be unfinished.
    """

    def __init__(self, response_format: dict | None, request_id: str, count: Callable[[], None]):
        self.response_format, self.request_id, self.count = response_format, request_id, count

    def __call__(self, text: str, reason: str | None) -> None:
        if reason != "stop":
            return
        problem = reply_problem(self.response_format, text)
        if problem is not None:
            self.count()
            log.warning(
                "request %s: its finished reply does not match its response_format: %s",
                self.request_id,
                problem,
            )


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict:
    """`reasoning_tokens`: of the completion's tokens, those that wrote its reasoning (None: the
    model's reasoning is not parsed)."""
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if reasoning_tokens is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counts


def logprob_entry(text: str, logprob: float | None) -> dict:
    return {
        "token": text,
        "logprob": finite(logprob) if logprob is not None else None,
        "bytes": list(text.encode()),
    }


def chat_logprobs(generation: Generation, top: bool) -> list[dict]:
    entries = []
    for i, text in enumerate(generation.tokens.texts):
        entry = logprob_entry(text, generation.tokens.logprobs[i])
        alternatives = generation.top_tokens[i] if top and i < len(generation.top_tokens) else None
        entry["top_logprobs"] = (
            [logprob_entry(t, lp) for t, lp in zip(alternatives.texts, alternatives.logprobs)]
            if alternatives
            else []
        )
        entries.append(entry)
    return entries


class StreamedText:
    """What a stream has sent so far. Token texts hold back an incomplete UTF-8 character; the final
    text is decoded whole, so the last chunk carries whatever the token texts had not sent yet."""

    def __init__(self):
        self.sent = ""

    def add(self, text: str) -> str:
        self.sent += text
        return text

    def rest(self, final_text: str) -> str:
        return self.add(final_text[len(self.sent) :]) if final_text.startswith(self.sent) else ""


class Envelope:
    """The id, timestamps and model name every response and chunk of one request carries."""

    def __init__(self, model: str, kind: str, prefix: str):
        self.id, self.created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        self.model, self.kind = model, kind

    def wrap(self, choices: list[dict], **extra) -> dict:
        return {
            "id": self.id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "bucketserve",
            "choices": choices,
            **extra,
        }


def sse(payload: Any) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class ChatChunks:
    """Renders one choice's generations as `chat.completion.chunk` events: the role first, a chunk
    per token, the finish reason on the last (ChoiceStreams adds usage and `[DONE]`). A reasoning
    model's reasoning goes as `reasoning_content` deltas, split from the answer as it comes."""

    def __init__(
        self,
        envelope: Envelope,
        body,
        index: int = 0,
        check: ReplyCheck | None = None,
        reasoning: ReplyReasoning | None = None,
    ):
        self.envelope, self.body, self.index, self.started = envelope, body, index, False
        self.text, self.tools, self.check = StreamedText(), body.tool_plan().active, check
        self.reasoning = reasoning
        self.split = reasoning.stream() if reasoning is not None else None

    @property
    def reasoning_tokens(self) -> int | None:
        return self.split.tokens if self.split is not None else None

    def delta(self, text: str, pieces: int = 1, last: bool = False) -> dict:
        """A token's delta: its text, or what of it is certain to be reasoning and answer."""
        if self.split is None:
            return {"content": text}
        part = self.split.feed(text, pieces)
        if last:
            rest = self.split.finish()
            part = Delta(part.reasoning + rest.reasoning, part.content + rest.content)
        delta = {"reasoning_content": part.reasoning} if part.reasoning else {}
        if part.content or not part.reasoning:
            delta["content"] = "" if self.tools else part.content  # tools: the answer at the end
        return delta

    def answer(self, text: str) -> str:
        return self.reasoning.split(text).content if self.reasoning is not None else text

    def chunk(self, delta: dict, logprobs=None, reason=None) -> str:
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": reason,
        }
        return sse(self.envelope.wrap([choice]))

    def __call__(self, generation: Generation) -> list[str]:
        out = [] if self.started else [self.chunk({"role": "assistant", "content": ""})]
        self.started = True
        if self.tools:  # a constrained reply is sent once whole, as content or as tool_calls deltas
            return out + self.thinking(generation) + self.tool_reply(generation)
        tokens, logprobs = (
            generation.tokens,
            chat_logprobs(generation, bool(self.body.top_logprobs)),
        )
        for i, text in enumerate(tokens.texts):
            delta = self.delta(self.text.add("" if tokens.is_special[i] else text))
            out.append(
                self.chunk(delta, {"content": [logprobs[i]]} if self.body.logprobs else None)
            )
        last = generation.generated_text
        if last is not None:
            reason = finish_reason(generation)
            out.append(self.chunk(self.delta(self.text.rest(last.text), 0, True), reason=reason))
            if self.check is not None:
                self.check(self.answer(last.text), reason)
        return out

    def thinking(self, generation: Generation) -> list[str]:
        """A constrained reply's reasoning, streamed as it comes (its answer comes whole)."""
        if self.split is None:
            return []
        tokens, last = generation.tokens, generation.generated_text
        deltas = [
            self.delta(self.text.add("" if s else t))
            for t, s in zip(tokens.texts, tokens.is_special)
        ]
        if last is not None:
            deltas.append(self.delta(self.text.rest(last.text), 0, True))
        return [self.chunk(d) for d in deltas if d.get("reasoning_content")]

    def tool_reply(self, generation: Generation) -> list[str]:
        last = generation.generated_text
        if last is None:
            return []
        deltas, reason = tools.reply_deltas(
            self.answer(last.text), finish_reason(generation), self.body.tool_plan()
        )
        return [self.chunk(delta) for delta in deltas] + [self.chunk({}, reason=reason)]


class CompletionChunks:
    """Renders one choice's generations as `text_completion` events, the finish reason on the
    last."""

    def __init__(self, envelope: Envelope, choice, index: int = 0):
        self.envelope, self.choice, self.index, self.text = envelope, choice, index, StreamedText()

    def __call__(self, generation: Generation) -> list[str]:
        last = generation.generated_text
        reason = finish_reason(generation) if last is not None else None
        text = self.text.add(
            "".join(
                t
                for t, special in zip(generation.tokens.texts, generation.tokens.is_special)
                if not special
            )
        )
        text += self.text.rest(last.text) if last is not None else ""
        return [sse(self.envelope.wrap([self.choice([generation], text, reason, self.index)]))]


class ChoiceStreams:
    """The events of `n` choices read together: each (index, generation) goes to its choice's
    renderer; once every choice has its last generation, usage (when asked) and `[DONE]`."""

    def __init__(
        self, envelope: Envelope, renderers: list, prompt_tokens: int, include_usage: bool
    ):
        self.envelope, self.renderers, self.prompt_tokens = envelope, renderers, prompt_tokens
        self.include_usage, self.generated, self.open = include_usage, 0, len(renderers)

    def __call__(self, item: tuple[int, Generation]) -> list[str]:
        index, generation = item
        out = self.renderers[index](generation)
        if generation.generated_text is None:
            return out
        self.generated += generation.generated_text.generated_tokens
        self.open -= 1
        if self.open:
            return out
        if self.include_usage:
            thought = [getattr(r, "reasoning_tokens", None) for r in self.renderers]
            counted = sum(thought) if None not in thought else None
            counts = usage(self.prompt_tokens, self.generated, counted)
            out.append(sse(self.envelope.wrap([], usage=counts)))
        return out + [sse("[DONE]")]


async def merged(streams: list):
    """(index, generation) from every stream as each arrives; the first failure ends it."""
    if (
        len(streams) == 1
    ):  # n = 1, nearly every request: read it directly, no task and queue hop per token
        async for generation in streams[0]:
            yield 0, generation
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for generation in stream:
                await queue.put((index, generation, None))
            await queue.put((index, None, None))
        except Exception as error:  # noqa: BLE001 - handed to the reader
            await queue.put((index, None, error))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, generation, error = await queue.get()
            if error is not None:
                raise error
            if generation is None:
                running -= 1
                continue
            yield index, generation
    finally:
        for task in tasks:
            task.cancel()
