"""A Responses API request (`POST /v1/responses`) as the chat completions request it amounts to.

Input items become chat messages (a `function_call` joins the assistant message before it as a
tool call, a `function_call_output` becomes a `tool` message), `instructions` a system message in
front, a `previous_response_id` the stored conversation before the new input, flat function tools
chat's nested ones, and `text.format` chat's `response_format`. The chat request then goes
through chat completions' own prompt, sampling, grammar and tool-call code (openai_api.py), so
both APIs answer a conversation alike. A field this does not honour is refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict

from engine.grammar_schema import UnsupportedSchema, check_schema
from router.http.openai_api import MAX_MESSAGES, ChatRequest, Message
from router.http.response_store import ResponseStore
from router.http.tools import Function, NamedFunction, NamedToolChoice, Tool
from router.http.validation import ValidationError

# Fields that only label a request, and fields accepted at the value that is our behaviour anyway.
LABELS = {"safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier"}
LABELS |= {"stream_options"}  # its one option, `include_obfuscation`, pads events we do not pad
OUR_BEHAVIOUR = {"truncation": "disabled", "background": False, "include": [], "top_logprobs": 0}
MAX_METADATA = 16  # OpenAI's limits on `metadata`: pairs, key and value lengths
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class RequestError(ValidationError):
    """A request error naming the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def require(condition: bool, message: str, param: str | None = None) -> None:
    if not condition:
        raise RequestError(message, param)


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    """The fields `POST /v1/responses` serves; any other is kept to be refused (`check_fields`)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # not in OpenAI's schema (clients send it in extra_body), as vLLM takes
    stop: str | list[str] | None = None  # the same
    logit_bias: dict[int, float] | None = None  # the same (chat completions' field)
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None  # `effort` sets the template's enable_thinking (`none`: off)
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False


@dataclass(frozen=True)
class Turn:
    """One request's chat request, and its conversation to store with the reply added."""

    chat: ChatRequest
    history: list[dict]  # the previous response's messages and this input's (no instructions)


def turn(body: ResponsesRequest, store: ResponseStore) -> Turn:
    check_fields(body)
    history = previous_messages(body, store) + input_messages(body.input)
    require(len(history) > 0, "`input` cannot be empty", "input")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages = system + history
    require(
        len(messages) <= MAX_MESSAGES,
        f"a conversation may hold up to {MAX_MESSAGES} messages. Given: {len(messages)}",
        "input",
    )
    chat = ChatRequest(
        model=body.model,
        messages=[Message(**m) for m in messages],
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop,
        logit_bias=body.logit_bias,
        chat_template_kwargs=thinking_switch(body.reasoning),
        response_format=response_format(body.text),
        tools=function_tools(body.tools),
        tool_choice=tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        user=body.user,
    )
    require(
        not (chat.tool_plan().active and chat.response_format),
        "`text.format` cannot be combined with `tools` (unless `tool_choice` is `none`)",
        "text.format",
    )
    return Turn(chat, history)


def thinking_switch(reasoning: Reasoning | None) -> dict | None:
    """The chat template's switch (Qwen3's `enable_thinking`) for `reasoning.effort`, as vLLM
    passes it: off for `none`, on for any other effort; no effort: the template's default."""
    if reasoning is None or reasoning.effort is None:
        return None
    return {"enable_thinking": reasoning.effort != "none"}


def check_fields(body: ResponsesRequest) -> None:
    """Refuse (naming them) the fields we do not honour, unless null or our behaviour's value."""
    refused = sorted(
        name
        for name, value in (body.model_extra or {}).items()
        if name not in LABELS
        and value is not None  # null: the field's default
        and not (name in OUR_BEHAVIOUR and value == OUR_BEHAVIOUR[name])
    )
    require(
        not refused,
        f"not supported: {', '.join(f'`{name}`' for name in refused)} (leave them out)",
        refused[0] if refused else None,
    )
    tokens = body.max_output_tokens
    require(
        tokens is None or tokens > 0,
        f"`max_output_tokens` must be strictly positive. Given: {tokens}",
        "max_output_tokens",
    )
    metadata = body.metadata or {}
    require(
        len(metadata) <= MAX_METADATA,
        f"`metadata` may hold up to {MAX_METADATA} pairs",
        "metadata",
    )
    require(
        all(
            len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE for k, v in metadata.items()
        ),
        f"`metadata` keys may have up to {MAX_METADATA_KEY} characters and values up to "
        f"{MAX_METADATA_VALUE}",
        "metadata",
    )


def previous_messages(body: ResponsesRequest, store: ResponseStore) -> list[dict]:
    if body.previous_response_id is None:
        return []
    stored = store.get(body.previous_response_id)
    require(
        stored is not None,
        f"Previous response with id {body.previous_response_id!r} not found (it may have been "
        "evicted from this server's store, or stored with `store: false`)",
        "previous_response_id",
    )
    return list(stored.messages)


# --- input items -> chat messages -------------------------------------------------------------


def input_messages(items: str | list[dict]) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for index, item in enumerate(items):
        where, kind = f"input[{index}]", item.get("type", "message")
        if kind == "message":
            messages.append(message(item, where))
        elif kind == "function_call":
            add_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append(call_output(item, messages, where))
        else:  # "reasoning" too: a model's past thinking is not part of its next prompt
            require(
                kind == "reasoning",
                f"`{where}.type` {kind!r} is not supported (message, function_call, "
                "function_call_output, reasoning)",
                f"{where}.type",
            )
    return messages


def message(item: dict, where: str) -> dict:
    role = item.get("role")
    require(
        role in ROLES,
        f"`{where}.role` must be one of {', '.join(ROLES)}. Given: {role!r}",
        f"{where}.role",
    )
    return {"role": ROLES[role], "content": content(item.get("content"), f"{where}.content")}


def content(value: Any, where: str) -> str | list[dict]:
    """A message's content as chat content: a string, or chat's text and image_url parts."""
    if isinstance(value, str):
        return value
    require(
        isinstance(value, list) and all(isinstance(p, dict) for p in value),
        f"`{where}` must be a string or a list of content parts",
        where,
    )
    return [content_part(part, f"{where}[{i}]") for i, part in enumerate(value)]


def content_part(part: dict, where: str) -> dict:
    kind = part.get("type")
    if kind in ("input_text", "output_text", "refusal"):
        text = part.get("refusal" if kind == "refusal" else "text")
        require(isinstance(text, str), f"`{where}` needs its text as a string", where)
        return {"type": "text", "text": text}
    require(
        kind == "input_image",
        f"`{where}.type` {kind!r} is not supported (input_text, output_text, input_image)",
        f"{where}.type",
    )
    url = part.get("image_url")
    require(
        isinstance(url, str) and url != "",
        f"`{where}` needs `image_url`, a data: or http(s): URL (`file_id` is not supported)",
        f"{where}.image_url",
    )
    return {"type": "image_url", "image_url": {"url": url}}


def add_call(messages: list[dict], item: dict, where: str) -> None:
    """A function_call item joins the assistant message before it (calls made together share one
    chat message, as chat completions sends them), else starts one."""
    for name in ("call_id", "name", "arguments"):
        require(
            isinstance(item.get(name), str), f"`{where}.{name}` must be a string", f"{where}.{name}"
        )
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def call_output(item: dict, messages: list[dict], where: str) -> dict:
    call_id = item.get("call_id")
    require(isinstance(call_id, str), f"`{where}.call_id` must be a string", f"{where}.call_id")
    names = [
        c["function"]["name"]
        for m in messages
        for c in m.get("tool_calls") or []
        if c["id"] == call_id
    ]
    result = {
        "role": "tool",
        "tool_call_id": call_id,
        "content": content(item.get("output"), f"{where}.output"),
    }
    return {**result, "name": names[-1]} if names else result


# --- tools and formats ------------------------------------------------------------------------


def function_tools(tools: list[dict] | None) -> list[Tool] | None:
    if tools is None:
        return None
    return [function_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def function_tool(tool: dict, where: str) -> Tool:
    kind = tool.get("type")
    require(
        kind == "function",
        f"`{where}.type` {kind!r} is not supported: bucketserve has no built-in tools, only "
        "`function` tools",
        f"{where}.type",
    )
    fields = {k: v for k, v in tool.items() if k != "type"}
    try:
        return Tool(type="function", function=Function.model_validate(fields))
    except pydantic.ValidationError as error:
        problem = error.errors()[0]
        field = ".".join(str(p) for p in problem["loc"])
        raise RequestError(f"`{where}.{field}`: {problem['msg']}", f"{where}.{field}") from None


def tool_choice(choice: str | dict | None) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    require(
        isinstance(choice, dict) and choice.get("type") == "function",
        '`tool_choice` must be auto, none, required or {"type": "function", "name": ...}',
        "tool_choice",
    )
    name = choice.get("name")
    require(isinstance(name, str), "`tool_choice.name` must be a string", "tool_choice.name")
    return NamedToolChoice(type="function", function=NamedFunction(name=name))


def response_format(text: TextConfig | None) -> dict | None:
    """`text.format` as chat's `response_format`, its schema checked here to name Responses'
    field."""
    fmt = (text.format if text else None) or {"type": "text"}
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return None if kind == "text" else {"type": "json_object"}
    require(
        kind == "json_schema",
        f"`text.format.type` {kind!r} is not supported (text, json_object, json_schema)",
        "text.format.type",
    )
    schema = fmt.get("schema")
    require(
        isinstance(schema, dict),
        "`text.format.schema` must be a JSON schema object",
        "text.format.schema",
    )
    try:
        check_schema(schema)
    except UnsupportedSchema as error:
        raise RequestError(f"`text.format.schema`: {error}", "text.format.schema") from None
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": schema}}
