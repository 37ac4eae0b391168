"""Anthropic's Messages API over chat completions' machinery: `POST /v1/messages` and
`POST /v1/messages/count_tokens`.

A Messages body becomes an OpenAI chat body (messages_request.py), whose prompt, parameters,
tool grammar and reply parsing are chat completions' own (openai_api.py, tools.py); the same
scheduler, checks, limits, metrics and tracing serve it. What differs is the reply: content blocks
(`text`, `tool_use`), a `stop_reason`, `usage` in input and output tokens, Anthropic's streamed
events (messages_stream.py), and Anthropic's error body and statuses (router/http/errors.py).

As Anthropic's API does, the text of a reply ends before the stop sequence that ended it, which
`stop_sequence` names.
"""

from __future__ import annotations

import functools
import json
import uuid

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from engine.batch import FinishReason, Generation
from router.config import TGI_MODEL_ALIAS
from router.http import tools
from router.http.errors import error_json, error_response
from router.http.messages_request import CountRequest, MessagesRequest, chat_request
from router.http.messages_stream import MessageEvents, error_event
from router.http.openai_api import ChatRequest, answering_model, chat_parameters, chat_prompt
from router.http.reasoning import ReplyReasoning
from router.http.state import RouterState, collect, events, submit
from router.http.validation import Parameters, ValidationError, prompt_ids
from router.images.decode import ImageError
from router.images.prompt import image_prompt

# Why a generation ended, as Anthropic names it (a grammar's reply may end a tool call instead).
STOP_REASONS = {
    FinishReason.LENGTH: "max_tokens",
    FinishReason.EOS_TOKEN: "end_turn",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
}
TOOL_REASONS = {"tool_calls": "tool_use", "stop": "end_turn"}


# --- the reply ------------------------------------------------------------------------------------


def content_blocks(text: str | None, tool_calls: list[dict]) -> list[dict]:
    """The reply's content blocks: its text, then a `tool_use` block per call. A reply without
    calls always has its text block, empty or not."""
    blocks = [{"type": "text", "text": text or ""}] if text or not tool_calls else []
    return blocks + [tool_use_block(call) for call in tool_calls]


def tool_use_block(call: dict) -> dict:
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": json.loads(call["function"]["arguments"]),
    }


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The text before the first stop sequence in it, and that sequence (None: there is none)."""
    found = [(text.find(stop), stop) for stop in stops if stop and stop in text]
    if not found:
        return text, None
    position, stop = min(found)
    return text[:position], stop


def reply(
    body: ChatRequest, generation: Generation, reasoning: ReplyReasoning | None = None
) -> tuple[list[dict], str, str | None]:
    """The last generation's content blocks, stop reason and stop sequence; a reasoning model's
    thinking (router/http/reasoning.py) comes first, as a `thinking` block."""
    last = generation.generated_text
    split = reasoning.split(last.text) if reasoning is not None else None
    answer = split.content if split is not None else last.text
    thought = [thinking_block(split.reasoning)] if split is not None and split.reasoning else []
    reason = STOP_REASONS[FinishReason(last.finish_reason)]
    plan = body.tool_plan()
    if plan.active:  # JSON written under the tools' grammar, parsed as chat completions does
        message, tool_reason = tools.reply_message(answer, reason, plan)
        blocks = content_blocks(message["content"], message.get("tool_calls") or [])
        return thought + blocks, TOOL_REASONS.get(tool_reason, tool_reason), None
    text, stop = cut_at_stop(answer, body.stop if reason == "stop_sequence" else [])
    return thought + content_blocks(text, []), reason, stop


def thinking_block(text: str) -> dict:
    # no signature: the thinking is the model's own text, not Anthropic's encrypted record
    return {"type": "thinking", "thinking": text, "signature": ""}


def message(envelope: dict, blocks: list[dict], reason: str, stop: str | None, usage: dict) -> dict:
    return {
        **envelope,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": usage,
    }


def new_envelope(state: RouterState, body: ChatRequest) -> dict:
    """What every reply and stream of one request carries."""
    model = answering_model(state, body)
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model}


# --- the routes -----------------------------------------------------------------------------------


# The shared checks (router/http/validation.py) name TGI's fields; these are their names here.
FIELD_NAMES = {"`max_new_tokens`": "`max_tokens`", "`inputs` tokens": "prompt tokens"}


def anthropic_error(state: RouterState, error: Exception) -> JSONResponse:
    if isinstance(error, ValidationError):
        message = str(error)
        for name, ours in FIELD_NAMES.items():
            message = message.replace(name, ours)
        error = ValidationError(message)
    return error_response(state.metrics, error, anthropic=True)


def unknown_model(state: RouterState, name: str) -> JSONResponse | None:
    """404 for a `model` that is neither the served one, one of its adapters, nor `tgi`."""
    if name in (state.info["model_id"], TGI_MODEL_ALIAS, *state.limits.adapters):
        return None
    message = f"model: the model `{name}` is not served here"
    return error_json(
        state.metrics, 404, message, "not_found", "not_found", openai=True, anthropic=True
    )


def message_parameters(
    state: RouterState,
    body: MessagesRequest,
    chat: ChatRequest,
    reasoning: ReplyReasoning | None = None,
) -> Parameters:
    return chat_parameters(state, chat, reasoning).model_copy(update={"top_k": body.top_k})


async def create(state: RouterState, body: MessagesRequest, http_request: HttpRequest):
    try:
        chat = chat_request(body)
        state.scheduler.check_admission()  # before templating
        prompt = await state.offload(chat_prompt, state, chat)
        reasoning = ReplyReasoning.for_prompt(state.reasoning, prompt)
        parameters = message_parameters(state, body, chat, reasoning)
        # The chat template already wrote the special tokens the model expects.
        generations, length, stream = await submit(state, prompt, parameters, False)
        envelope = new_envelope(state, chat)
        if not body.stream:
            done = await collect(state, generations, stream)
            blocks, reason, stop = reply(chat, done[-1], reasoning)
            usage = {"input_tokens": length, "output_tokens": output_tokens(done)}
            return JSONResponse(message(envelope, blocks, reason, stop, usage))
    except Exception as error:  # noqa: BLE001 - every failure gets an error body
        return anthropic_error(state, error)
    # a reasoning model's reply is sent in whole blocks at its end: thinking, then text or tools
    answer = functools.partial(reply, reasoning=reasoning)
    render = MessageEvents(envelope, chat, length, answer, whole=reasoning is not None)
    return StreamingResponse(
        streamed(render, events(state, http_request, generations, stream, render, error_event)),
        media_type="text/event-stream",
    )


async def streamed(render: MessageEvents, rest):
    """`message_start` and a `ping` at once, before the first token; then the rest."""
    for event in render.opening():
        yield event
    async for event in rest:
        yield event


def output_tokens(generations: list[Generation]) -> int:
    return generations[-1].generated_text.generated_tokens


def prompt_length(state: RouterState, prompt: str) -> int:
    """The prompt's tokens as a request counts them (build_request's images and tokenization),
    with no limit on their number: a client asks to learn whether its conversation still fits."""
    try:
        pictured = image_prompt(prompt, state.images) if state.images is not None else None
    except ImageError as error:
        raise ValidationError(str(error)) from None
    counted = pictured.counted if pictured else prompt
    return len(prompt_ids(state.tokenizer, state.limits, counted, None, False))


async def count_tokens(state: RouterState, body: CountRequest) -> JSONResponse:
    try:
        chat = chat_request(body)
        prompt = await state.offload(chat_prompt, state, chat)
        length = await state.offload(prompt_length, state, prompt)
    except Exception as error:  # noqa: BLE001
        return anthropic_error(state, error)
    return JSONResponse({"input_tokens": length})


def messages_routes(app: FastAPI, state: RouterState) -> None:
    @app.post("/v1/messages")
    async def messages_route(body: MessagesRequest, http_request: HttpRequest):
        return unknown_model(state, body.model) or await create(state, body, http_request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens_route(body: CountRequest):
        return unknown_model(state, body.model) or await count_tokens(state, body)
