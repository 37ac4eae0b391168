"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request is translated into the chat completions request it amounts to (responses_request.py)
and runs through chat completions' own prompt, parameters, queue and reply parsing
(openai_api.py), so the scheduler, sampling, grammars, tool calls, limits, metrics and tracing
are the same. Only the answer's shape differs (responses_render.py). Finished responses are kept,
unless `store` is false, in a bounded in-memory store (response_store.py) that
`previous_response_id` continues from. A request this API refuses gets a 400 in OpenAI's error
format with the field at fault as its `param`, as OpenAI answers.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse

from engine.batch import Generation
from router.http.openai_api import (
    answering_model,
    chat_choice,
    chat_parameters,
    chat_prompt,
    token_texts,
    unknown_model,
)
from router.http.openai_render import ReplyCheck, merged
from router.http.reasoning import ReplyReasoning
from router.http.response_store import ResponseStore
from router.http.responses_render import Draft, ResponseEvents
from router.http.responses_request import ResponsesRequest, Turn, turn
from router.http.state import (
    RouterState,
    collect_all,
    error_payload,
    error_response,
    events,
    submit_many,
)
from router.http.validation import ValidationError

# The shared checks name TGI's fields; a Responses client sent these (the first one named is the
# error's `param`: the length check names the token limit before the prompt).
FIELD_NAMES = {"`max_new_tokens`": "`max_output_tokens`", "`inputs`": "`input`"}


def error_reply(state: RouterState, error: Exception) -> JSONResponse:
    """400 with OpenAI's error object for a request at fault; any other failure as on /v1/*."""
    if not isinstance(error, ValidationError):
        return error_response(state, error, openai=True)
    state.metrics.outcome("validation")
    message, param = str(error), getattr(error, "param", None)
    for ours, theirs in FIELD_NAMES.items():
        if ours in message:
            message, param = message.replace(ours, theirs), param or theirs.strip("`")
    body = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return JSONResponse({"error": body}, status_code=400)


def not_found(state: RouterState, response_id: str) -> JSONResponse:
    state.metrics.outcome("not_found")
    message = f"No response with id {response_id!r} is stored here (evicted, deleted, or never)"
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return JSONResponse({"error": error}, status_code=404)


class Finisher:
    """Turns a request's last generation into its finished response object, checks a JSON reply
    against its format (as chat completions does), and stores the response and its conversation."""

    def __init__(
        self,
        state: RouterState,
        store: ResponseStore,
        draft: Draft,
        turn: Turn,
        reasoning: ReplyReasoning | None = None,
    ):
        self.store, self.draft, self.turn, self.prompt_tokens = store, draft, turn, 0
        self.reasoning, self.texts = reasoning, []  # the reply's token texts, for reasoning_tokens
        chat = turn.chat
        self.check = (
            ReplyCheck(chat.response_format, draft.id, state.metrics.invalid_replies.inc)
            if chat.response_format
            else None
        )

    def count(self, generation: Generation) -> Generation:
        """Note a generation's tokens (every one passes here, streamed or not)."""
        if self.reasoning is not None:
            self.texts += token_texts([generation])
        return generation

    def __call__(self, generation: Generation) -> dict:
        choice = chat_choice(self.turn.chat, 0, [generation], self.reasoning)
        message, reason = choice["message"], choice["finish_reason"]
        if self.check is not None and not self.turn.chat.tool_plan().active:
            self.check(message["content"], reason)
        done = generation.generated_text
        response = self.draft.finished(
            message, reason, self.prompt_tokens, done.generated_tokens, self.thought()
        )
        if self.draft.body.store:  # the reasoning is not replayed in the next turn's prompt
            reply = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
            self.store.put(response, [*self.turn.history, reply])
        return response

    def thought(self) -> int:
        return self.reasoning.tokens(self.texts) if self.reasoning is not None else 0


async def create(
    state: RouterState, store: ResponseStore, body: ResponsesRequest, http_request: HttpRequest
):
    draft = Draft(body, answering_model(state, body))
    try:
        current = turn(body, store)
        state.scheduler.check_admission()  # before templating
        prompt = await state.offload(chat_prompt, state, current.chat)
        reasoning = ReplyReasoning.for_prompt(state.reasoning, prompt)
        parameters = chat_parameters(state, current.chat, reasoning)
        # The chat template already wrote the special tokens the model expects.
        sequences, length, streams = await submit_many(
            state, prompt, parameters, 1, "n", add_special_tokens=False
        )
        finish = Finisher(state, store, draft, current, reasoning)
        finish.prompt_tokens = length
        if not body.stream:
            generations = (await collect_all(state, sequences, streams))[0]
            return JSONResponse(finish([finish.count(g) for g in generations][-1]))
    except Exception as error:  # noqa: BLE001 - every failure gets an error body
        return error_reply(state, error)
    # a reasoning model's items come whole at the end: its reasoning, then its text or calls
    streams_text = not current.chat.tool_plan().active and reasoning is None
    render = ResponseEvents(draft, streams_text, finish)
    return StreamingResponse(
        streamed(state, http_request, render, sequences, streams, finish.count),
        media_type="text/event-stream",
    )


async def streamed(state: RouterState, http_request: HttpRequest, render, sequences, streams, note):
    """`note(generation)`: sees every generation before it is rendered (Finisher.count)."""
    for event in render.opening():
        yield event
    on_error = lambda error: render.error(error_payload(error, openai=True))  # noqa: E731
    draw = lambda item: render((item[0], note(item[1])))  # noqa: E731
    async for event in events(state, http_request, merged(sequences), streams, draw, on_error):
        yield event


def responses_routes(app: FastAPI, state: RouterState, store: ResponseStore | None = None) -> None:
    store = store if store is not None else ResponseStore()

    @app.post("/v1/responses")
    async def create_route(body: ResponsesRequest, http_request: HttpRequest):
        return unknown_model(state, body) or await create(state, store, body, http_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_route(response_id: str):
        stored = store.get(response_id)
        return stored.response if stored is not None else not_found(state, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_route(response_id: str):
        if not store.delete(response_id):
            return not_found(state, response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
