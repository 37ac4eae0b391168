"""Anthropic's server-sent events for one message.

`message_start` and a `ping` come at once; then each content block as `content_block_start`,
`content_block_delta` (`text_delta`, `input_json_delta`) and `content_block_stop`; then
`message_delta` (the stop reason, the stop sequence, the output tokens) and `message_stop`. A
failure after the status line is an `error` event with Anthropic's error body.

Free text streams as its tokens come, less a tail that may be the beginning of a stop sequence:
the text never holds the stop sequence that ended it. A reply written under the tools' grammar is
JSON that becomes blocks only once it is whole, so its blocks come at its end, each tool's input
as one `input_json_delta`.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from engine.batch import Generation
from router.http.errors import anthropic_error, classify, error_message


def event(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"


def error_event(error: Exception) -> str:
    status = classify(error)[0]
    return event(anthropic_error(status, error_message(error))[1])


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` may be the beginning of a stop sequence."""
    return max(
        (k for stop in stops for k in range(len(stop) - 1, 0, -1) if text.endswith(stop[:k])),
        default=0,
    )


def block_events(index: int, block: dict) -> list[str]:
    """A whole block: its start (empty), one delta with its content, its stop."""
    if block["type"] == "tool_use":
        start, delta = {**block, "input": {}}, input_delta(block["input"])
    elif block["type"] == "thinking":
        start = {**block, "thinking": ""}
        delta = {"type": "thinking_delta", "thinking": block["thinking"]}
    else:
        start, delta = {"type": "text", "text": ""}, text_delta(block["text"])
    return [
        event({"type": "content_block_start", "index": index, "content_block": start}),
        *delta_events(index, delta),
        event({"type": "content_block_stop", "index": index}),
    ]


def text_delta(text: str) -> dict | None:
    return {"type": "text_delta", "text": text} if text else None


def input_delta(value: dict) -> dict:
    return {"type": "input_json_delta", "partial_json": json.dumps(value)}


def delta_events(index: int, delta: dict | None) -> list[str]:
    return (
        []
        if delta is None
        else [event({"type": "content_block_delta", "index": index, "delta": delta})]
    )


class MessageEvents:
    """Renders one message's generations as Anthropic's events. `reply(body, generation)` turns
    the last generation into (content blocks, stop reason, stop sequence), as a whole reply does."""

    def __init__(
        self, envelope: dict, body, prompt_tokens: int, reply: Callable, whole: bool = False
    ):
        self.envelope, self.body, self.prompt_tokens, self.reply = (
            envelope,
            body,
            prompt_tokens,
            reply,
        )
        # a grammar's JSON, or a reply with thinking before its text (`whole`): sent at its end
        self.whole = whole or body.tool_plan().active
        self.stops = [] if self.whole else list(body.stop or [])
        self.seen, self.sent, self.started = "", "", False

    def opening(self) -> list[str]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        start = {**self.envelope, "content": [], "stop_reason": None, "stop_sequence": None}
        return [
            event({"type": "message_start", "message": {**start, "usage": usage}}),
            event({"type": "ping"}),
        ]

    def __call__(self, generation: Generation) -> list[str]:
        last = generation.generated_text is not None
        if self.whole:
            return self.ending(generation) if last else []
        out = [] if self.started else [self._text_start()]
        self.started = True
        if not last:
            return out + delta_events(0, text_delta(self._release(generation)))
        return out + self.ending(generation)

    def ending(self, generation: Generation) -> list[str]:
        blocks, reason, stop = self.reply(self.body, generation)
        if self.whole:
            out = [e for index, block in enumerate(blocks) for e in block_events(index, block)]
        else:  # the text block is open: what it has not sent yet, and its stop
            final = blocks[0]["text"]
            rest = final[len(self.sent) :] if final.startswith(self.sent) else ""
            out = [
                *delta_events(0, text_delta(rest)),
                event({"type": "content_block_stop", "index": 0}),
            ]
        delta = {"stop_reason": reason, "stop_sequence": stop}
        usage = {"output_tokens": generation.generated_text.generated_tokens}
        return out + [
            event({"type": "message_delta", "delta": delta, "usage": usage}),
            event({"type": "message_stop"}),
        ]

    def _text_start(self) -> str:
        block = {"type": "text", "text": ""}
        return event({"type": "content_block_start", "index": 0, "content_block": block})

    def _release(self, generation: Generation) -> str:
        """The text of the generation's tokens that may be sent now."""
        tokens = generation.tokens
        self.seen += "".join(
            t for t, special in zip(tokens.texts, tokens.is_special) if not special
        )
        safe = len(self.seen) - held_back(self.seen, self.stops)
        new = self.seen[len(self.sent) : safe] if safe > len(self.sent) else ""
        self.sent += new
        return new
