"""Anthropic's Messages request, and its translation into an OpenAI chat body.

`/v1/messages` runs on chat completions' machinery (openai_api.py, chat.py, tools.py): the
translation below is the whole difference on the way in. `system` becomes a system message; a
user message's `tool_result` blocks become `tool` messages (before its text and images, as
Anthropic orders them); an assistant's `tool_use` blocks become its `tool_calls`; an image's
base64 source becomes a data URL; `tools` with `input_schema` become functions; `tool_choice`
`any` is `required` and `disable_parallel_tool_use` is `parallel_tool_calls: false`. Thinking
blocks of earlier turns are dropped, as Anthropic's API drops them from the context.

Anthropic's API refuses a field it does not know, and so do we (400 naming it), except the ones
that only label a request or steer Anthropic's own infrastructure (LABELS). The current `anthropic`
client has no `temperature`, `top_p` or `top_k` argument: clients send them in the body
(`extra_body`), as they do `seed` and vLLM's other sampling extensions.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.http.openai_api import ChatRequest, Message
from router.http.tools import Function, NamedFunction, NamedToolChoice, Tool
from router.http.validation import MAX_STOP_SEQUENCES, ValidationError, check

# Accepted and not used: they label a request, or steer what only Anthropic's servers have (their
# prompt cache's breakpoints: bucketserve caches prefixes by itself, where the shards can).
LABELS = {"metadata", "service_tier", "cache_control", "inference_geo", "speed", "diagnostics"}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations
    type: Literal["text"]
    text: str


class Base64Source(BaseModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(BaseModel):
    type: Literal["url"]
    url: str


class ImageBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] = ""
    is_error: bool = False


class ToolUseBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ImageBlock | ToolResultBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class CustomTool(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, strict
    type: str | None = None  # None or "custom"; Anthropic's server tools are refused, named
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    """`enabled` / `disabled` set the chat template's `enable_thinking`; a model that thinks in tags
    gets its thinking split out by the reasoning parser (router/http/reasoning.py) as a `thinking`
    block. `budget_tokens` is accepted and not enforced."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountRequest(BaseModel):
    """The body of `/v1/messages/count_tokens`: a conversation, its system prompt and its tools."""

    model_config = ConfigDict(extra="allow")  # kept to be refused by name (`check_known`)
    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountRequest):
    max_tokens: int
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # vLLM's sampling extensions, as chat completions takes them
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False


def check_known(body: CountRequest) -> None:
    unknown = sorted(name for name in body.model_extra or {} if name not in LABELS)
    check(not unknown, f"not supported: {', '.join(f'`{n}`' for n in unknown)} (leave them out)")


def chat_request(body: CountRequest) -> ChatRequest:
    """The OpenAI chat body that asks what `body` asks (ValidationError where it cannot)."""
    check_known(body)
    choice, parallel = tool_choice(body.tool_choice)
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": system_messages(body.system) + conversation(body.messages),
        "tools": chat_tools(body.tools),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
    }
    if isinstance(body, MessagesRequest):
        fields.update(sampling(body))
    if body.thinking is not None and body.thinking.type != "adaptive":
        # the chat template's switch (Qwen3's), as vLLM passes it
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type == "enabled"}
    chat = ChatRequest(**fields)
    try:
        chat.tool_plan()  # the tools' schemas checked once, named as Anthropic names them
    except ValidationError as error:
        raise ValidationError(str(error).replace("`parameters`", "`input_schema`")) from None
    return chat


def sampling(body: MessagesRequest) -> dict:
    check(body.max_tokens >= 1, f"`max_tokens` must be at least 1. Given: {body.max_tokens}")
    check(
        body.temperature is None or 0 <= body.temperature <= 1,
        f"`temperature` must be >= 0.0 and <= 1.0. Given: {body.temperature}",
    )
    stops = body.stop_sequences or []
    check(
        len(stops) <= MAX_STOP_SEQUENCES,
        f"`stop_sequences` may hold up to {MAX_STOP_SEQUENCES} sequences. Given: {len(stops)}",
    )
    same = ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty")
    same += ("logit_bias", "min_tokens", "ignore_eos", "max_tokens")
    return {**{name: getattr(body, name) for name in same}, "stop": stops}


def system_messages(system: str | list[TextBlock] | None) -> list[Message]:
    text = system if isinstance(system, str) else "".join(b.text for b in system or [])
    return [Message(role="system", content=text)] if text else []


def conversation(messages: list[InputMessage]) -> list[Message]:
    out = []
    for message in messages:
        if isinstance(message.content, str):
            out.append(Message(role=message.role, content=message.content))
        elif message.role == "user":
            out += user_messages(message.content)
        else:
            out.append(assistant_message(message.content))
    return out


def user_messages(blocks: list) -> list[Message]:
    """A user turn: its tool results as `tool` messages, then its text and images, if any."""
    refused = [b.type for b in blocks if b.type not in ("text", "image", "tool_result")]
    check(not refused, f"a user message cannot hold {refused[:1]} blocks")
    results = [
        Message(role="tool", tool_call_id=b.tool_use_id, content=parts(b.content))
        for b in blocks
        if isinstance(b, ToolResultBlock)
    ]
    rest = [b for b in blocks if not isinstance(b, ToolResultBlock)]
    return results + ([Message(role="user", content=parts(rest))] if rest else [])


def assistant_message(blocks: list) -> Message:
    """An assistant turn: its text and its tool calls (its thinking is not replayed)."""
    refused = [b.type for b in blocks if b.type in ("image", "tool_result")]
    check(not refused, f"an assistant message cannot hold {refused[:1]} blocks")
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    calls = [
        {
            "id": b.id,
            "type": "function",
            "function": {"name": b.name, "arguments": json.dumps(b.input)},
        }
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    return Message(role="assistant", content=text, tool_calls=calls or None)


def parts(content: str | list) -> str | list[dict]:
    """Text and image blocks as OpenAI's content parts (a base64 image as a data URL)."""
    if isinstance(content, str):
        return content
    return [
        {"type": "text", "text": b.text}
        if isinstance(b, TextBlock)
        else {"type": "image_url", "image_url": {"url": image_url(b)}}
        for b in content
    ]


def image_url(block: ImageBlock) -> str:
    source = block.source
    if isinstance(source, UrlSource):
        return source.url
    check(source.data != "", "an image block's `source.data` is empty")
    return f"data:{source.media_type};base64,{source.data}"


def chat_tools(tools: list[CustomTool] | None) -> list[Tool] | None:
    if not tools:
        return None
    for tool in tools:
        check(
            tool.type in (None, "custom"),
            f"tool {tool.name!r}: type {tool.type!r} is not supported (only custom tools, "
            "with `name` and `input_schema`, are served)",
        )
        check(tool.input_schema is not None, f"tool {tool.name!r} needs `input_schema`")
    return [
        Tool(
            type="function",
            function=Function(name=t.name, description=t.description, parameters=t.input_schema),
        )
        for t in tools
    ]


def tool_choice(choice: ToolChoice | None) -> tuple[Any, bool | None]:
    """OpenAI's `tool_choice` and `parallel_tool_calls` for Anthropic's `tool_choice`."""
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        check(bool(choice.name), "`tool_choice` of type `tool` needs `name`")
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name)), parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel
