"""OpenAI tool calling, valid by construction: the tools' JSON schemas become one grammar for the reply.

The reply the model writes is JSON, constrained by xgrammar on the shard (TGI's JSON grammar type), so it
always parses, always names a declared function and always carries arguments that match that function's
schema. What the model writes:

- a call (`required`, a named function, or a call under `auto`): `{"calls": [{"name": N, "arguments": {...}}]}`,
  one call, or one or more when `parallel_tool_calls` is true; a named `tool_choice` allows only that name;
- a text answer, which only `auto` allows: `{"content": "..."}`.

`none` sends no grammar and no tools. The router then turns the JSON into OpenAI's `tool_calls` (or
`content`). The schemas are checked here (jsonschema's metaschema) so a wrong one is a 422 naming the tool.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict

from router.http.validation import Grammar, ValidationError, check

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # OpenAI's rule for function names
MAX_PARALLEL_CALLS = 8                        # bounds the reply (and the grammar) when calls may repeat


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: Function


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for its prompt, its grammar and its reply."""
    tools: list[dict]             # OpenAI tool dicts for the chat template ([] when `none`)
    grammar: Grammar | None       # the reply's grammar (None: free text)
    allows_text: bool             # `auto`: the reply may be `{"content": ...}`

    @property
    def active(self) -> bool:
        return self.grammar is not None


NO_TOOLS = ToolPlan([], None, True)


def plan(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolPlan:
    """The plan for `tools` under `tool_choice`; OpenAI's defaults: `auto` when tools exist, parallel calls on."""
    if not tools:
        check(choice in (None, "none"), "`tool_choice` needs `tools`")
        return NO_TOOLS
    check_tools(tools)
    choice = choice or "auto"
    if choice == "none":
        return NO_TOOLS
    allowed = tools
    if isinstance(choice, NamedToolChoice):
        allowed = [t for t in tools if t.function.name == choice.function.name]
        check(bool(allowed), f"`tool_choice` names {choice.function.name!r}, which is not in `tools`")
    calls = calls_schema(allowed, parallel is not False)
    schema = {"anyOf": [calls, TEXT_SCHEMA]} if choice == "auto" else calls
    return ToolPlan([t.model_dump(exclude_none=True) for t in tools], Grammar(type="json", value=schema),
                    choice == "auto")


def check_tools(tools: list[Tool]) -> None:
    names = [t.function.name for t in tools]
    for tool in tools:
        name = tool.function.name
        check(NAME.match(name) is not None, f"tool name {name!r} must be 1 to 64 of a-z, A-Z, 0-9, _ and -")
        try:
            jsonschema.validators.validator_for(parameters(tool)).check_schema(parameters(tool))
        except jsonschema.SchemaError as error:
            raise ValidationError(f"tool {name!r}: `parameters` is not a valid JSON schema: {error.message}") from None
    duplicates = sorted({n for n in names if names.count(n) > 1})
    check(not duplicates, f"tool names must be unique; repeated: {', '.join(duplicates)}")


def parameters(tool: Tool) -> dict:
    # A function without parameters takes an empty object, as OpenAI documents.
    return tool.function.parameters or {"type": "object", "properties": {}}


TEXT_SCHEMA = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"]}


def call_schema(tool: Tool) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters(tool)},
            "required": ["name", "arguments"]}


def calls_schema(tools: list[Tool], parallel: bool) -> dict:
    one = call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [call_schema(t) for t in tools]}
    items = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
    return {"type": "object", "properties": {"calls": items}, "required": ["calls"]}


# --- the reply ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    content: str | None
    tool_calls: list[dict]    # OpenAI's shape: id, type, function {name, arguments (a JSON string)}

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else "stop"


def parse_reply(text: str) -> Reply | None:
    """The model's constrained JSON as content or tool calls; None when it is cut short (max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if "calls" in value:
        return Reply(None, [tool_call(c["name"], c["arguments"]) for c in value["calls"]])
    return Reply(value["content"], [])


def tool_call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def reply_message(text: str, length_reason: str) -> tuple[dict, str]:
    """The assistant message and finish reason for a constrained reply; a reply cut short keeps its raw text."""
    reply = parse_reply(text)
    if reply is None:
        return {"role": "assistant", "content": text}, length_reason
    message = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return message, reply.finish_reason


def reply_deltas(text: str, length_reason: str) -> tuple[list[dict], str]:
    """The same reply as stream deltas: the content, or one `tool_calls` delta per call (with its index)."""
    message, reason = reply_message(text, length_reason)
    if not message.get("tool_calls"):
        return [{"content": message["content"]}], reason
    return [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(message["tool_calls"])], reason
