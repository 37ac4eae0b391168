"""Chat messages to a prompt through the model's chat template, with tools, and TGI's
`/chat_tokenize`.

A template that raises for some message sequence (a system message where it allows none, roles that
do not alternate) is the request's fault: 422 with the template's own message. A template that does
not know tools (it never reads `tools`) gets them as text in a system message, so the model still
sees what it may call; past calls and their results become plain text for it too.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from router.http.state import RouterState, error_response
from router.http.validation import ValidationError, check

TOOLS_INTRO = (
    "You can call these functions. To call one, answer with JSON: "
    '{"calls": [{"name": <function name>, "arguments": <its arguments>}]}; '
    'to answer in words, {"content": <your answer>}.\n'
)


def template_reads_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def render(
    tokenizer, messages: list[dict], tools: list[dict], template_kwargs: dict | None = None
) -> str:
    """The templated prompt; ValidationError (422) when the template refuses the messages.
    `template_kwargs`: the template's own switches (`enable_thinking`), see
    check_template_kwargs."""
    check(len(messages) > 0, "`messages` cannot be empty")
    check_template_kwargs(tokenizer, template_kwargs)
    if not getattr(tokenizer, "chat_template", None):
        raise ValidationError("this model has no chat template: use /v1/completions")
    native = template_reads_tools(tokenizer)
    if not native:
        messages = [as_text(m) for m in messages]
        if tools:
            messages = [{"role": "system", "content": TOOLS_INTRO + json.dumps(tools)}, *messages]
    kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools and native else {})}
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except Exception as error:  # noqa: BLE001 - jinja2 errors and the template's raise_exception alike
        raise ValidationError(f"the chat template refused the messages: {error}") from None


def check_template_kwargs(tokenizer, template_kwargs: dict | None) -> None:
    """`chat_template_kwargs` (vLLM's and SGLang's field) reach the template as its variables:
    switches such as Qwen3's `enable_thinking`. A name apply_chat_template takes itself is refused:
    it would change what the router asks for (tokens instead of text, another template, tools)."""
    if not template_kwargs:
        return
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}
    reserved = sorted(set(template_kwargs) & own)
    check(
        not reserved,
        f"`chat_template_kwargs` cannot set {', '.join(f'`{n}`' for n in reserved)}: "
        "they are the chat template's call, not its variables",
    )
    invalid = sorted(name for name in template_kwargs if not name.isidentifier())
    check(not invalid, f"`chat_template_kwargs` names must be identifiers. Given: {invalid[:3]}")


def as_text(message: dict) -> dict:
    """A message for a template that knows only `role` and `content` (a string)."""
    content = message.get("content") or ""
    if message.get("tool_calls"):
        content += json.dumps(
            {
                "calls": [
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                    for c in message["tool_calls"]
                ]
            }
        )
    return {"role": message["role"], "content": content}


def template_message(
    role: str,
    content: str,
    tool_calls: list[dict] | None,
    tool_call_id: str | None,
    name: str | None,
) -> dict:
    """One OpenAI message as the dict chat templates read; a call's arguments as a dict (HF's
    convention)."""
    message: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        message["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": decoded(c["function"].get("arguments")),
                },
            }
            for c in tool_calls
        ]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    if name is not None:
        message["name"] = name
    return message


def decoded(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            raise ValidationError("a tool call's `arguments` must be a JSON string") from None
    return arguments


def chat_tokenize(state: RouterState, prompt: str) -> JSONResponse:
    """TGI's /chat_tokenize: the templated text and its tokens (id, text, character span)."""
    encoding = state.tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    tokens = [
        {"id": token_id, "text": prompt[start:stop], "start": start, "stop": stop}
        for token_id, (start, stop) in zip(encoding["input_ids"], encoding["offset_mapping"])
    ]
    return JSONResponse({"tokenize_response": tokens, "templated_text": prompt})


def chat_tokenize_route(app: FastAPI, state: RouterState, request_type, prompt_of) -> None:
    """`prompt_of(body)` renders a chat request's prompt (openai_api owns the request's shape)."""

    async def route(body):
        try:
            return chat_tokenize(state, prompt_of(body))
        except ValidationError as error:
            return error_response(state, error)

    route.__annotations__["body"] = (
        request_type  # a class, not a string: FastAPI reads the body's schema from it
    )
    app.post("/chat_tokenize")(route)
