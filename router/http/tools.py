"""OpenAI tool calling, valid by construction: the tools' JSON schemas become one grammar for the
reply.

The reply the model writes is JSON, constrained by xgrammar on the shard (TGI's JSON grammar type),
so it always parses, always names a declared function and always carries arguments that match that
function's schema. What the model writes:

- a named `tool_choice`: one call of that function, `{"name": N, "arguments": {...}}` (one
  object: once it closes, only the end of the reply can follow);
- `required`, or a call under `auto`: `{"calls": [{"name": N, "arguments": {...}}, ...]}`, a
  list that may close after every call and holds at most MAX_PARALLEL_CALLS calls, or exactly
  one when the request sends `parallel_tool_calls: false`;
- a text answer, which only `auto` allows: `{"content": "..."}`.

`none` sends no grammar and no tools. The router then turns the JSON into OpenAI's `tool_calls` (or
`content`). The schemas are checked here (jsonschema's metaschema, and engine/grammar_schema.py
for the keywords that the grammar enforces) so that a wrong or unenforceable one is a 422 naming
the tool. A finished reply is validated again against the tools' schemas: a call that does not
validate is not returned as a call (its text comes back as content, and a warning is logged). A
reply cut by the token limit returns the calls that were complete before the cut, with
`finish_reason: "length"`.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict

from engine.grammar_schema import UnsupportedSchema, check_schema, has_refs, rebased
from router.http.validation import Grammar, ValidationError, check

log = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_PARALLEL_CALLS = 8  # bounds the reply (and the grammar) when calls may repeat
CALLS_START = '{"calls": ['  # how a list of calls begins (compact separators)


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

    tools: list[dict]  # OpenAI tool dicts for the chat template ([] when `none`)
    grammar: Grammar | None  # the reply's grammar (None: free text)
    allows_text: bool  # `auto`: the reply may be `{"content": ...}`
    schemas: dict | None = None  # name -> parameters schema of each function the reply may call

    @property
    def active(self) -> bool:
        return self.grammar is not None


NO_TOOLS = ToolPlan([], None, True)


def plan(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolPlan:
    """The plan for `tools` under `tool_choice`; OpenAI's defaults: `auto` when tools exist,
    parallel calls on."""
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
        check(
            bool(allowed), f"`tool_choice` names {choice.function.name!r}, which is not in `tools`"
        )
    if isinstance(choice, NamedToolChoice):
        schema = named_schema(allowed[0])
    else:
        schema = calls_schema(allowed, parallel is not False, text=choice == "auto")
    return ToolPlan(
        [t.model_dump(exclude_none=True) for t in tools],
        Grammar(type="json", value=schema),
        choice == "auto",
        {t.function.name: parameters(t) for t in allowed},
    )


def check_tools(tools: list[Tool]) -> None:
    names = [t.function.name for t in tools]
    for tool in tools:
        name = tool.function.name
        check(
            NAME.match(name) is not None,
            f"tool name {name!r} must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
        )
        try:
            jsonschema.validators.validator_for(parameters(tool)).check_schema(parameters(tool))
        except jsonschema.SchemaError as error:
            raise ValidationError(
                f"tool {name!r}: `parameters` is not a valid JSON schema: {error.message}"
            ) from None
        try:
            check_schema(parameters(tool))
        except UnsupportedSchema as error:
            raise ValidationError(f"tool {name!r}: `parameters`: {error}") from None
    duplicates = sorted({n for n in names if names.count(n) > 1})
    check(not duplicates, f"tool names must be unique; repeated: {', '.join(duplicates)}")


def parameters(tool: Tool) -> dict:
    # A function without parameters takes an empty object, as OpenAI documents.
    return tool.function.parameters or {"type": "object", "properties": {}}


TEXT_SCHEMA = {
    "type": "object",
    "properties": {"content": {"type": "string"}},
    "required": ["content"],
}


def call_schema(tool: Tool, arguments: dict | None = None) -> dict:
    arguments = parameters(tool) if arguments is None else arguments
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
    }


def with_definitions(tools: list[Tool], schema_for) -> dict:
    """schema_for(arguments) for the tools' calls. A tool whose parameters hold references (`$ref`
    is relative to the parameters' root) moves to the grammar's `$defs`, its references rebased."""
    definitions, arguments = {}, []
    for i, tool in enumerate(tools):
        if has_refs(parameters(tool)):
            definitions[f"tool_{i}"] = rebased(parameters(tool), f"#/$defs/tool_{i}")
            arguments.append({"$ref": f"#/$defs/tool_{i}"})
        else:
            arguments.append(parameters(tool))
    schema = schema_for(arguments)
    return {"$defs": definitions, **schema} if definitions else schema


def named_schema(tool: Tool) -> dict:
    return with_definitions([tool], lambda arguments: call_schema(tool, arguments[0]))


def calls_schema(tools: list[Tool], parallel: bool, text: bool = False) -> dict:
    def schema_for(arguments: list[dict]) -> dict:
        calls = [call_schema(t, a) for t, a in zip(tools, arguments)]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        items = {
            "type": "array",
            "items": one,
            "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
        }
        schema = {"type": "object", "properties": {"calls": items}, "required": ["calls"]}
        return {"anyOf": [schema, TEXT_SCHEMA]} if text else schema

    return with_definitions(tools, schema_for)


# --- the reply ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    content: str | None
    tool_calls: list[dict]  # OpenAI's shape: id, type, function {name, arguments (a JSON string)}

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else "stop"


def parse_reply(text: str) -> Reply | None:
    """The model's constrained JSON as content or tool calls; None when it is cut short
    (max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    if "calls" in value:
        return Reply(None, [tool_call(c["name"], c["arguments"]) for c in value["calls"]])
    if "name" in value:  # a named tool_choice: one call
        return Reply(None, [tool_call(value["name"], value["arguments"])])
    return Reply(value.get("content"), [])


def complete_calls(text: str) -> list[dict]:
    """The calls of a list cut short that were complete before the cut (the grammar fixes the
    separators, so each call is a JSON object after `{"calls": [` or after `, `)."""
    if not text.startswith(CALLS_START):
        return []
    decoder, position, calls = json.JSONDecoder(), len(CALLS_START), []
    while True:
        try:
            call, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return calls
        if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
            return calls
        calls.append(tool_call(call["name"], call["arguments"]))
        if not text.startswith(", ", end):
            return calls
        position = end + 2


def tool_call(name: str, arguments: Any) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def invalid_call(call: dict, schemas: dict | None) -> str | None:
    """Why a call does not match the functions the reply may call (None: it does)."""
    if schemas is None:
        return None
    name = call["function"]["name"]
    if name not in schemas:
        return f"it calls {name!r}, which the request does not allow"
    error = jsonschema.exceptions.best_match(
        jsonschema.validators.validator_for(schemas[name])(schemas[name]).iter_errors(
            json.loads(call["function"]["arguments"])
        )
    )
    return None if error is None else f"its arguments for {name!r} do not validate: {error.message}"


def reply_message(text: str, length_reason: str, plan: ToolPlan | None = None) -> tuple[dict, str]:
    """The assistant message and finish reason for a constrained reply. A reply cut short returns
    the calls complete before the cut (or, without any, its raw text) with the length reason; a call
    that does not validate against its schema is never returned as a call."""
    reply = parse_reply(text)
    if reply is None:
        reply, reason = Reply(None, complete_calls(text)), length_reason
    else:
        reason = reply.finish_reason
    schemas = plan.schemas if plan is not None else None
    problems = [p for p in (invalid_call(c, schemas) for c in reply.tool_calls) if p]
    if problems:
        log.warning(
            "a constrained reply does not validate, so it is returned as text: %s", problems[0]
        )
        return {
            "role": "assistant",
            "content": text,
        }, length_reason if reason == length_reason else "stop"
    if not reply.tool_calls and reply.content is None:
        return {"role": "assistant", "content": text}, reason
    message = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return message, reason


def reply_deltas(
    text: str, length_reason: str, plan: ToolPlan | None = None
) -> tuple[list[dict], str]:
    """The same reply as stream deltas: the content, or one `tool_calls` delta per call (with its
    index)."""
    message, reason = reply_message(text, length_reason, plan)
    if not message.get("tool_calls"):
        return [{"content": message["content"]}], reason
    return [
        {"tool_calls": [{"index": i, **call}]} for i, call in enumerate(message["tool_calls"])
    ], reason
