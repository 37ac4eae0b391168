"""Responses API answers: a chat reply as output items, the response object around them, and the
typed server-sent events of a streamed response, in OpenAI's order, each with its
`sequence_number`.

A plain text reply streams token by token in one `message` item. A reply under tools is a
grammar-constrained JSON document that only means something whole (router/http/tools.py), so its
items (`function_call`s, or a `message` under `auto`) are sent once it is finished, each with the
full sequence of events its type has.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable

from engine.batch import Generation
from router.http.openai_render import StreamedText
from router.http.responses_request import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict, reason: str, message_id: str) -> list[dict]:
    """The output items of a chat reply `message` (role, content, tool_calls) that ended for
    `reason`: the one place they are assembled. Text comes as a `message` item with one
    `output_text` part, each tool call as a `function_call` item."""
    status = "incomplete" if reason == "length" else "completed"
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    thought = message.get("reasoning_content")
    items = [reasoning_item(thought, status)] if thought else []
    items += [message_item(message_id, text, status)] if text or not calls else []
    return items + [function_call_item(call) for call in calls]


def reasoning_item(text: str, status: str) -> dict:
    """A reasoning model's thinking (router/http/reasoning.py), as its text: no summary."""
    content = [{"type": "reasoning_text", "text": text}]
    return {
        "id": new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": content,
        "status": status,
    }


def message_item(item_id: str, text: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [text_part(text)],
    }


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: dict) -> dict:
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


def usage(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


class Draft:
    """What every version of one response carries: its id, creation time, model, and the request's
    settings echoed back, as OpenAI's response object does."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.id, self.created_at = new_id("resp"), int(time.time())
        self.body, self.model = body, model
        self.message_id = new_id("msg")  # the reply's message item, streamed before it is finished

    def response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        reasoning = body.reasoning.model_dump() if body.reasoning else {}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": (body.text.format if body.text else None) or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def finished(
        self, message: dict, reason: str, input_tokens: int, output_tokens: int, thought: int = 0
    ) -> dict:
        """`thought`: the output tokens that wrote the reasoning."""
        status = "incomplete" if reason == "length" else "completed"
        output = output_items(message, reason, self.message_id)
        return self.response(status, output, usage(input_tokens, output_tokens, thought))


class ResponseEvents:
    """Renders one response's generations as typed events. `finish(generation)` turns the last
    generation into the finished response object (and stores it)."""

    def __init__(self, draft: Draft, streams_text: bool, finish: Callable[[Generation], dict]):
        self.draft, self.streams_text, self.finish = draft, streams_text, finish
        self.sequence, self.text, self.opened = itertools.count(), StreamedText(), False

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": next(self.sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def opening(self) -> list[str]:
        response = self.draft.response("in_progress", [])
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def error(self, payload: dict) -> str:
        """A last `error` event for a failure after the stream began (`payload`: OpenAI's error)."""
        error = payload["error"]
        return self.event(
            "error", code=error["code"], message=error["message"], param=error["param"]
        )

    def __call__(self, item: tuple[int, Generation]) -> list[str]:
        _, generation = item
        out = []
        if self.streams_text:
            out += self.open_message() + self.deltas(generation)
        if generation.generated_text is not None:
            out += self.close(self.finish(generation))
        return out

    def open_message(self) -> list[str]:
        if self.opened:
            return []
        self.opened = True
        return self.item_opening(message_item(self.draft.message_id, "", "in_progress"), 0)

    def deltas(self, generation: Generation) -> list[str]:
        tokens = generation.tokens
        texts = [t for t, special in zip(tokens.texts, tokens.is_special) if not special]
        return [self.text_delta(0, self.text.add(t)) for t in texts if t]

    def text_delta(self, index: int, delta: str) -> str:
        return self.event(
            "response.output_text.delta",
            item_id=self.draft.message_id,
            output_index=index,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def close(self, response: dict) -> list[str]:
        out = []
        for index, item in enumerate(response["output"]):
            if not (self.opened and item["id"] == self.draft.message_id):
                out += self.item_opening(item, index)
            out += self.item_closing(item, index)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return out + [self.event(kind, response=response)]

    def item_opening(self, item: dict, index: int) -> list[str]:
        """`output_item.added` with the item as it starts (empty), and its empty text part."""
        if item["type"] == "function_call":
            started = {**item, "arguments": "", "status": "in_progress"}
            return [self.event("response.output_item.added", output_index=index, item=started)]
        started = {**item, "content": [], "status": "in_progress"}
        if item["type"] == "reasoning":
            return [self.event("response.output_item.added", output_index=index, item=started)]
        return [
            self.event("response.output_item.added", output_index=index, item=started),
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def item_closing(self, item: dict, index: int) -> list[str]:
        """What the item's text or arguments still lack, their `done` events, `output_item.done`."""
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            arguments = item["arguments"]
            out = [self.event("response.function_call_arguments.delta", **where, delta=arguments)]
            out.append(
                self.event("response.function_call_arguments.done", **where, arguments=arguments)
            )
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out = [
                self.event("response.reasoning_text.delta", **where, content_index=0, delta=text),
                self.event("response.reasoning_text.done", **where, content_index=0, text=text),
            ]
        else:
            text = item["content"][0]["text"]
            rest = self.text.rest(text) if item["id"] == self.draft.message_id else text
            out = [self.text_delta(index, rest)] if rest else []
            out += [
                self.event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                ),
                self.event(
                    "response.content_part.done", **where, content_index=0, part=text_part(text)
                ),
            ]
        return out + [self.event("response.output_item.done", output_index=index, item=item)]
