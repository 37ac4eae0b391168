"""OpenAI's API over the same scheduler: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

Each body is turned into TGI `Parameters` and goes through the same checks and the same queue as
`/generate`; only the request and response shapes differ. Errors keep TGI's body (`error`,
`error_type`), as TGI's own OpenAI routes do.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, PrivateAttr

from engine.batch import Generation
from engine.grammar_schema import UnsupportedSchema, check_schema
from router.config import TGI_MODEL_ALIAS
from router.http import chat, tools
from router.http.openai_render import (
    ChatChunks,
    ChoiceStreams,
    CompletionChunks,
    Envelope,
    ReplyCheck,
    chat_logprobs,
    finish_reason,
    merged,
    sse,
    usage,
)
from router.http.reasoning import ReplyReasoning
from router.http.state import (
    RouterState,
    collect_all,
    error_payload,
    error_response,
    events,
    finite,
    submit_many,
)
from router.http.tools import Tool, ToolChoice, ToolPlan
from router.http.validation import (
    AnswerGrammar,
    Grammar,
    Parameters,
    ValidationError,
    check,
    check_text,
)
from router.sched import fanout

MAX_TOP_LOGPROBS = 5
MAX_MESSAGES = 1024  # per chat request: the template renders every one of them
# OpenAI fields we do not implement are refused (422 naming them), not silently ignored, unless they
# hold their no-op value. These only label a request and change nothing in its answer:
LABELS = {"user", "metadata", "store", "service_tier"}
NO_OP_VALUES = (None, 0, 0.0, False, "", "none", [], {})
# vLLM's sampling extensions at values that are our behaviour anyway (the text skips special
# tokens); vllm-router adds `skip_special_tokens` to the requests it forwards
OUR_BEHAVIOUR = {"skip_special_tokens": True}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """The fields both completion APIs share; the others are kept to be refused
    (`check_implemented`)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[int, float] | None = (
        None  # OpenAI sends token ids as strings; pydantic reads them as ints
    )
    min_tokens: int | None = None  # vLLM's extensions, which serving benchmarks send
    ignore_eos: bool = False
    user: str | None = None  # accepted and not used


class ChatRequest(Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: the template's `enable_thinking`

    _plan: ToolPlan | None = PrivateAttr(default=None)

    def tool_plan(self) -> ToolPlan:
        """Checked and built once per request (the schemas are checked against the metaschema)."""
        if self._plan is None:
            self._plan = tools.plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        return self._plan


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int]  # token ids too, as OpenAI's API and vLLM take them
    logprobs: int | None = None
    echo: bool = False


# --- requests -> TGI parameters -------------------------------------------------------------------


def parameters(
    state: RouterState,
    body: Sampling,
    max_tokens: int | None,
    top_n: int,
    grammar: Grammar | None = None,
) -> Parameters:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    # OpenAI samples at temperature 1 by default; temperature 0 asks for greedy decoding.
    greedy = body.temperature == 0
    adapter = body.model if body.model in state.limits.adapters else None
    return Parameters(
        max_new_tokens=max_tokens,
        temperature=None if greedy else body.temperature,
        top_p=None if body.top_p == 1 else body.top_p,
        do_sample=not greedy,
        seed=body.seed,
        stop=stop,
        frequency_penalty=body.frequency_penalty,
        top_n_tokens=top_n or None,
        details=True,
        grammar=grammar,
        adapter_id=adapter,
        presence_penalty=body.presence_penalty,
        logit_bias=body.logit_bias,
        min_new_tokens=body.min_tokens,
        ignore_eos=body.ignore_eos,
    )


def check_n(state: RouterState, body: Sampling) -> None:
    """`n` sequences share one prefill (router/sched/fanout.py)."""
    problem = fanout.check_count("n", body.n, state.scheduler.limits.max_batch_size)
    check(problem is None, problem)


def response_grammar(response_format: dict | None) -> Grammar | None:
    """OpenAI's `response_format` (and TGI's `{"type": "json", "value": schema}`) as a grammar."""
    if not response_format or response_format.get("type") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return Grammar(type="json_object", value=None)
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        check(
            isinstance(schema, dict),
            "`response_format.json_schema.schema` must be a JSON schema object",
        )
        try:
            check_schema(schema)
        except UnsupportedSchema as error:
            raise ValidationError(f"`response_format.json_schema.schema`: {error}") from None
        return Grammar(type="json", value=schema)
    if kind in ("json", "regex"):
        return Grammar(type=kind, value=response_format.get("value"))
    raise ValidationError(
        f"`response_format.type` {kind!r} is not supported (text, json_object, json_schema)"
    )


def check_implemented(body: Sampling) -> None:
    unknown = sorted(
        name
        for name, value in (body.model_extra or {}).items()
        if name not in LABELS
        and not any(value == v and type(value) is type(v) for v in NO_OP_VALUES)
        and not (name in OUR_BEHAVIOUR and value is OUR_BEHAVIOUR[name])
    )
    check(
        not unknown,
        f"not implemented: {', '.join(f'`{name}`' for name in unknown)} "
        "(leave them out, or send their default)",
    )


def chat_prompt(state: RouterState, body: ChatRequest) -> str:
    """The prompt of a conversation, its tools included (on a validation thread: templating is CPU
    work)."""
    check(
        len(body.messages) <= MAX_MESSAGES,
        f"`messages` may hold up to {MAX_MESSAGES} messages. Given: {len(body.messages)}",
    )
    messages = [
        chat.template_message(
            m.role, message_text(m, state.images), m.tool_calls, m.tool_call_id, m.name
        )
        for m in body.messages
    ]
    for message in messages:
        check_text("messages", message["role"] + message["content"])
    return chat.render(state.tokenizer, messages, body.tool_plan().tools, body.chat_template_kwargs)


def message_text(message: Message, images=None) -> str:
    """The message's text; an image part becomes TGI's markdown image, which validation reads
    (router/images/prompt.py) where the model takes images, and refuses where it does not."""
    if isinstance(message.content, list):  # content parts: text, and images for a VLM
        return "".join(content_part_text(p, images) for p in message.content)
    return message.content or ""


def content_part_text(part: dict, images) -> str:
    kind = part.get("type")
    if kind == "image_url":
        check(
            images is not None and images.spec is not None,
            "this model does not take images (it is a text-only model): send text content only",
        )
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        check(isinstance(url, str) and url != "", "an `image_url` part needs `image_url.url`")
        check(
            url.startswith(("data:", "http://", "https://")),
            "an image URL must be data:, http: or https:",
        )
        return f"![]({url})"
    check(
        kind == "text" and isinstance(part.get("text", ""), str),
        "only text and image_url content parts are supported",
    )
    return part.get("text", "")


# --- responses ------------------------------------------------------------------------------------


def envelope_for(state: RouterState, body: Sampling, kind: str, prefix: str) -> Envelope:
    return Envelope(answering_model(state, body), kind, prefix)


# --- the model a request names --------------------------------------------------------------------


def answering_model(state: RouterState, body: Sampling) -> str:
    """The name a response carries: the adapter the request picked, else the served model's."""
    return body.model if body.model in state.limits.adapters else state.info["model_id"]


def unknown_model(state: RouterState, body: Sampling) -> JSONResponse | None:
    """404 in OpenAI's shape for a `model` that is neither the served one, an adapter, nor `tgi`
    (TGI's clients send that name); None when the request may go on. No `model` is fine."""
    if body.model in (None, state.info["model_id"], TGI_MODEL_ALIAS, *state.limits.adapters):
        return None
    state.metrics.outcome("not_found")
    message = f"The model `{body.model}` does not exist."
    error = {"message": message, "type": "NotFoundError", "param": "model", "code": 404}
    return JSONResponse({"error": error}, status_code=404)


def error_event(error: Exception) -> str:
    return sse(error_payload(error, openai=True))


# --- chat completions -----------------------------------------------------------------------------


def chat_parameters(
    state: RouterState, body: ChatRequest, reasoning: ReplyReasoning | None = None
) -> Parameters:
    top = body.top_logprobs or 0
    check(
        0 <= top <= MAX_TOP_LOGPROBS,
        f"`top_logprobs` must be >= 0 and <= {MAX_TOP_LOGPROBS}. Given: {top}",
    )
    check(top == 0 or body.logprobs, "`top_logprobs` needs `logprobs: true`")
    plan = body.tool_plan()
    check(
        not (plan.active and body.response_format),
        "`response_format` cannot be combined with `tools`",
    )
    return parameters(
        state,
        body,
        body.max_completion_tokens or body.max_tokens,
        top,
        answer_grammar(plan.grammar or response_grammar(body.response_format), reasoning),
    )


def answer_grammar(grammar: Grammar | None, reasoning: ReplyReasoning | None) -> Grammar | None:
    """The grammar of a reasoning model's answer: its reasoning block goes first, unconstrained
    (router/http/reasoning.py)."""
    block = reasoning.grammar_block if reasoning is not None else None
    if grammar is None or block is None:
        return grammar
    start, end = block
    return AnswerGrammar(
        type=grammar.type, value=grammar.value, reasoning_start=start, reasoning_end=end
    )


def chat_choice(
    body: ChatRequest,
    index: int,
    generations: list[Generation],
    reasoning: ReplyReasoning | None = None,
) -> dict:
    last = generations[-1]
    logprobs = None
    if body.logprobs:
        logprobs = {
            "content": [e for g in generations for e in chat_logprobs(g, bool(body.top_logprobs))]
        }
    split = reasoning.split(last.generated_text.text) if reasoning is not None else None
    answer = split.content if split is not None else last.generated_text.text
    message, reason = {"role": "assistant", "content": answer}, finish_reason(last)
    if body.tool_plan().active:
        message, reason = tools.reply_message(answer, reason, body.tool_plan())
    if split is not None:
        message["reasoning_content"] = split.reasoning or None
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def chat_response(
    envelope: Envelope,
    body: ChatRequest,
    sequences: list[list[Generation]],
    prompt_tokens: int,
    check: ReplyCheck | None = None,
    reasoning: ReplyReasoning | None = None,
) -> dict:
    """One choice per sequence; usage counts the prompt once and every sequence's tokens (and,
    for a reasoning model, those that wrote its reasoning)."""
    choices = [
        chat_choice(body, i, generations, reasoning) for i, generations in enumerate(sequences)
    ]
    if check is not None:
        for choice in choices:
            check(choice["message"]["content"], choice["finish_reason"])
    thought = None
    if reasoning is not None:
        thought = sum(reasoning.tokens(token_texts(generations)) for generations in sequences)
    return envelope.wrap(choices, usage=usage(prompt_tokens, generated_tokens(sequences), thought))


def token_texts(generations: list[Generation]) -> list[str]:
    return [
        "" if special else text
        for g in generations
        for text, special in zip(g.tokens.texts, g.tokens.is_special)
    ]


def reply_check(state: RouterState, envelope: Envelope, body: ChatRequest) -> ReplyCheck | None:
    """The check of finished replies, for a request with a JSON `response_format`."""
    if not body.response_format:
        return None
    return ReplyCheck(body.response_format, envelope.id, state.metrics.invalid_replies.inc)


def generated_tokens(sequences: list[list[Generation]]) -> int:
    return sum(generations[-1].generated_text.generated_tokens for generations in sequences)


async def chat_completions(state: RouterState, body: ChatRequest, http_request: HttpRequest):
    envelope = envelope_for(state, body, "chat.completion", "chatcmpl")
    try:
        check_implemented(body)
        check_n(state, body)
        state.scheduler.check_admission()  # before templating
        prompt = await state.offload(chat_prompt, state, body)
        reasoning = ReplyReasoning.for_prompt(state.reasoning, prompt)
        # The chat template already wrote the special tokens the model expects.
        sequences, length, streams = await submit_many(
            state,
            prompt,
            chat_parameters(state, body, reasoning),
            body.n,
            "n",
            add_special_tokens=False,
        )
        check = reply_check(state, envelope, body)
        if not body.stream:
            done = await collect_all(state, sequences, streams)
            return JSONResponse(chat_response(envelope, body, done, length, check, reasoning))
    except Exception as error:  # noqa: BLE001 - every failure gets an error body
        return error_response(state, error, openai=True)
    envelope.kind = "chat.completion.chunk"
    renderers = [ChatChunks(envelope, body, index, check, reasoning) for index in range(body.n)]
    return stream_choices(
        state, http_request, envelope, body, renderers, sequences, streams, length
    )


def stream_choices(
    state: RouterState,
    http_request: HttpRequest,
    envelope: Envelope,
    body: Sampling,
    renderers,
    sequences,
    streams,
    prompt_tokens: int,
) -> StreamingResponse:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    render = ChoiceStreams(envelope, renderers, prompt_tokens, include_usage)
    return StreamingResponse(
        events(state, http_request, merged(sequences), streams, render, error_event),
        media_type="text/event-stream",
    )


# --- completions ----------------------------------------------------------------------------------


def completion_prompt(state: RouterState, body: CompletionRequest) -> tuple[str, bool]:
    """The prompt's text, and whether tokenizing it adds the special tokens. Token ids (what
    KV-aware routers such as vllm-router's kv_aware send) are decoded to the text they spell and
    tokenized back without additions: ids that came from the model's tokenizer come back the
    same."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt):
        vocabulary = len(state.tokenizer)
        bad = next((x for x in prompt if not 0 <= x < vocabulary), None)
        check(
            bad is None, f"`prompt` token id {bad} is not in the vocabulary (0..{vocabulary - 1})"
        )
        return state.tokenizer.decode(prompt, skip_special_tokens=False), False
    if isinstance(prompt, list):
        check(len(prompt) == 1, f"`prompt` must be one string. Given: {len(prompt)}")
        return prompt[0], True
    return prompt, True


def completion_logprobs(generations: list[Generation], top: int) -> dict:
    tokens = [t for g in generations for t in g.tokens.texts]
    logprobs = [finite(lp) for g in generations for lp in g.tokens.logprobs]
    alternatives = (
        [dict(zip(t.texts, t.logprobs)) for g in generations for t in g.top_tokens] if top else None
    )
    offsets, position = [], 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": alternatives,
        "text_offset": offsets,
    }


def completion_choice(
    body: CompletionRequest,
    prompt: str,
    generations: list[Generation],
    text: str,
    reason: str | None,
    index: int = 0,
) -> dict:
    logprobs = (
        completion_logprobs(generations, body.logprobs) if body.logprobs is not None else None
    )
    return {
        "index": index,
        "text": (prompt if body.echo else "") + text,
        "logprobs": logprobs,
        "finish_reason": reason,
    }


async def completions(state: RouterState, body: CompletionRequest, http_request: HttpRequest):
    envelope = envelope_for(state, body, "text_completion", "cmpl")
    try:
        check_implemented(body)
        (prompt, special), top = completion_prompt(state, body), body.logprobs or 0
        check(not (body.echo and body.stream), "`echo` is not supported with `stream`")
        check(
            0 <= top <= MAX_TOP_LOGPROBS,
            f"`logprobs` must be >= 0 and <= {MAX_TOP_LOGPROBS}. Given: {top}",
        )
        check_n(state, body)
        sequences, length, streams = await submit_many(
            state, prompt, parameters(state, body, body.max_tokens, top), body.n, "n", special
        )
        if not body.stream:
            done = await collect_all(state, sequences, streams)
            choices = [
                completion_choice(
                    body, prompt, g, g[-1].generated_text.text, finish_reason(g[-1]), i
                )
                for i, g in enumerate(done)
            ]
            return JSONResponse(envelope.wrap(choices, usage=usage(length, generated_tokens(done))))
    except Exception as error:  # noqa: BLE001
        return error_response(state, error, openai=True)
    renderers = [
        CompletionChunks(
            envelope,
            lambda g, text, reason, i: completion_choice(body, "", g, text, reason, i),
            index,
        )
        for index in range(body.n)
    ]
    return stream_choices(
        state, http_request, envelope, body, renderers, sequences, streams, length
    )


# --- the routes -----------------------------------------------------------------------------------


def models(state: RouterState) -> dict:
    names = [state.info["model_id"], *state.limits.adapters]
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "bucketserve"}
            for name in names
        ],
    }


def openai_routes(app: FastAPI, state: RouterState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_route(body: ChatRequest, http_request: HttpRequest):
        return unknown_model(state, body) or await chat_completions(state, body, http_request)

    @app.post("/v1/completions")
    async def completions_route(body: CompletionRequest, http_request: HttpRequest):
        return unknown_model(state, body) or await completions(state, body, http_request)

    chat.chat_tokenize_route(app, state, ChatRequest, lambda body: chat_prompt(state, body))

    @app.get("/v1/models")
    async def models_route():
        return models(state)
