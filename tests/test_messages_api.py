"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), driven by the real
`anthropic` client against a real shard and router of the embedded model, and of the tiny LLaVA
for images: greedy replies equal chat completions' for the same conversation, tool calls valid
against their schemas, Anthropic's events, statuses and error bodies. The translation and the
stream's text hold-back are checked in-process first."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import openai
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from transformers import AutoTokenizer

from router.http import tracing
from router.http.errors import anthropic_error
from router.http.messages_api import cut_at_stop
from router.http.messages_request import MessagesRequest, chat_request
from router.http.messages_stream import held_back
from router.http.validation import ValidationError
from tests.helpers import shard_fixture
from tests.test_router_http import shard_and_router
from tests.test_router_tracing import serve_and_call
from tests.test_server import short_socket_dir
from tests.test_vision_serving import LIMITS as LLAVA_LIMITS
from tests.vision_models import image_bytes, llava_reference

KEY = "sk-messages-key"
MODEL = "tgi"  # the served model's alias, as on chat completions
NEW_TOKENS = 24
LIMITS = ["--max-input-tokens", "512", "--max-total-tokens", "768", "--max-batch-size", "4"]
ROUTER_LIMITS = [*LIMITS, "--max-batch-prefill-tokens", "1024", "--api-key", KEY]
SHARD_LIMITS = [*LIMITS, "--max-prefill-tokens", "1024"]
WEATHER = {
    "name": "weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
}
CLOCK = {
    "name": "clock",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 5}, "utc": {"type": "boolean"}},
        "required": ["zone"],
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]
GREEDY = {"temperature": 0}


def as_openai_tool(tool: dict) -> dict:
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if "description" in tool:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


# --- in-process: the translation, the hold-back, the error shape ----------------------------------


def test_a_tool_conversation_translates_to_chat_messages():
    body = MessagesRequest(
        model=MODEL,
        max_tokens=5,
        system=[{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Be kind."}],
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"days": 2}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Thanks."},
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["\n\n"],
        **GREEDY,
    )
    chat = chat_request(body)
    shown = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert shown == [
        {"role": "system", "content": "Be brief. Be kind."},
        ASK[0],
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"days": 2}'},
                }
            ],
        },
        {"role": "tool", "content": "Sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
    ]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert (chat.temperature, chat.max_tokens, chat.stop) == (0, 5, ["\n\n"])


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
        ({"tools": [{"name": "f", "input_schema": {"type": "nope"}}]}, "`input_schema`"),
        ({"tool_choice": {"type": "tool", "name": "clock"}, "tools": [WEATHER]}, "'clock'"),
        ({"temperature": 1.5}, "`temperature`"),
        ({"max_tokens": 0}, "`max_tokens`"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "`stop_sequences`"),
        ({"container": "c1"}, "`container`"),
    ],
)
def test_what_the_translation_refuses_is_named(fields, problem):
    body = MessagesRequest(**{"model": MODEL, "max_tokens": 5, "messages": ASK, **fields})
    with pytest.raises(ValidationError, match=re.escape(problem)):
        chat_request(body)


def test_labels_are_accepted():
    body = MessagesRequest(
        model=MODEL, max_tokens=5, messages=ASK, metadata={"user_id": "u"}, service_tier="auto"
    )
    assert chat_request(body).messages[0].role == "user"


def test_the_stream_holds_back_what_may_begin_a_stop_sequence():
    assert held_back("the end", []) == 0
    assert held_back("the en", ["end."]) == 2
    assert held_back("the end", ["end."]) == 3
    assert held_back("the e", ["xx", "e!"]) == 1
    assert held_back("that", ["end"]) == 0
    assert cut_at_stop("one, two. three", [".", ","]) == ("one", ",")
    assert cut_at_stop("one two", ["."]) == ("one two", None)


def test_errors_take_anthropics_statuses_and_types():
    assert anthropic_error(422, "bad") == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}},
    )
    assert anthropic_error(429, "busy")[0] == 529
    assert anthropic_error(429, "busy")[1]["error"]["type"] == "overloaded_error"
    assert anthropic_error(401, "key")[1]["error"]["type"] == "authentication_error"
    assert anthropic_error(404, "no")[1]["error"]["type"] == "not_found_error"
    assert anthropic_error(424, "failed") == (
        500,
        {"type": "error", "error": {"type": "api_error", "message": "failed"}},
    )


shard = shard_fixture(max_batch_size=4)


def test_messages_are_traced_as_chat_completions_are(shard, tiny_model_dirs):
    """An in-process router over the tiny Llama's shard: each request's span has its queue,
    prefill and decode spans, streamed or not."""
    exporter = InMemorySpanExporter()
    traces = tracing.Tracing.with_processor(SimpleSpanProcessor(exporter))

    async def calls(_, app):
        import httpx2  # the anthropic client's own httpx (it refuses httpx's clients)

        transport = httpx2.ASGITransport(app=app)
        http = httpx2.AsyncClient(transport=transport, base_url="http://router")
        client = anthropic.AsyncAnthropic(
            base_url="http://router", api_key="x", http_client=http, max_retries=0
        )
        request = dict(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        await client.messages.create(**request)
        async with client.messages.stream(**request) as stream:
            await stream.get_final_message()

    asyncio.run(serve_and_call(shard, tiny_model_dirs["llama"], traces, calls))
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.parent is None]
    assert [s.name for s in roots] == ["POST /v1/messages"] * 2
    for root in roots:
        children = [
            s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id
        ]
        assert sorted(s.name for s in children) == ["decode", "prefill", "queue"]


# --- the embedded model behind a real shard and router --------------------------------------------


@pytest.fixture(scope="module")
def url(smollm_dir):
    base = short_socket_dir() / "m"
    with shard_and_router(smollm_dir, base, SHARD_LIMITS, ROUTER_LIMITS) as served:
        yield served[0]


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def chat(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    return AutoTokenizer.from_pretrained(smollm_dir)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def shown(message) -> list:
    """Each block's content (the client's streamed and whole replies are of different classes)."""
    return [
        (block.type, block.text if block.type == "text" else (block.name, block.input))
        for block in message.content
    ]


def chat_stop_reason(finish_reason: str) -> str:
    return {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}[finish_reason]


@pytest.mark.slow
def test_greedy_messages_equal_chat_completions(client, chat):
    for system in (None, "You answer like a pirate."):
        answer = client.messages.create(
            model=MODEL,
            max_tokens=NEW_TOKENS,
            messages=ASK,
            **({"system": system} if system else {}),
            extra_body=GREEDY,
        )
        messages = ([{"role": "system", "content": system}] if system else []) + ASK
        expected = chat.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=NEW_TOKENS, temperature=0
        )
        assert answer.type == "message" and answer.role == "assistant"
        assert [block.type for block in answer.content] == ["text"]
        assert text_of(answer) == expected.choices[0].message.content
        assert answer.stop_reason == chat_stop_reason(expected.choices[0].finish_reason)
        assert answer.stop_sequence is None and answer.id.startswith("msg_")
        assert answer.usage.input_tokens == expected.usage.prompt_tokens
        assert answer.usage.output_tokens == expected.usage.completion_tokens


@pytest.mark.slow
def test_a_system_prompt_in_blocks_is_the_system_prompt_as_a_string(client):
    blocks = [{"type": "text", "text": "You answer "}, {"type": "text", "text": "like a pirate."}]
    kinds = [
        client.messages.create(
            model=MODEL, max_tokens=8, messages=ASK, system=system, extra_body=GREEDY
        )
        for system in (blocks, "You answer like a pirate.")
    ]
    plain = client.messages.create(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY)
    assert shown(kinds[0]) == shown(kinds[1]) and kinds[0].usage == kinds[1].usage
    # (the template writes a default system prompt of its own where a conversation has none)
    assert kinds[0].usage.input_tokens != plain.usage.input_tokens


@pytest.mark.slow
def test_the_stream_gives_the_whole_reply_in_anthropics_events(client, url):
    request = dict(model=MODEL, max_tokens=NEW_TOKENS, messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) > 1 and "".join(texts) == text_of(whole)
    assert shown(final) == shown(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    names = sse_names(url, {**request.pop("extra_body"), **request, "stream": True})
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"} and len(names[3:-3]) > 1


def sse_names(url: str, body: dict) -> list[str]:
    names = []
    headers = {"x-api-key": KEY}
    with httpx.stream("POST", f"{url}/v1/messages", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
    return names


@pytest.mark.slow
def test_a_stop_sequence_ends_the_text_before_it_streamed_and_not(client):
    request = dict(model=MODEL, max_tokens=NEW_TOKENS, messages=ASK, extra_body=GREEDY)
    free = text_of(client.messages.create(**request))
    words = free.split()
    assert len(words) > 3, free
    # The last letter of a word, the space and two letters of the next: it begins in one token and
    # ends in another, so a stream must hold back that letter until it knows what follows.
    space = free.index(f" {words[2]}")
    stop = free[space - 1 : space + 3]
    cut = client.messages.create(**request, stop_sequences=[stop, "\u2603never"])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == free[: free.index(stop)]
    with client.messages.stream(**request, stop_sequences=[stop, "\u2603never"]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(cut) and final.stop_sequence == stop


def called(message) -> list:
    return [block for block in message.content if block.type == "tool_use"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "choice",
    [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "weather"}],
)
def test_a_tool_call_and_its_result_equal_chat_completions(client, chat, choice):
    tools = [WEATHER, CLOCK]
    request = dict(model=MODEL, max_tokens=128, messages=ASK, tools=tools, tool_choice=choice)
    first = client.messages.create(**request, extra_body=GREEDY)
    calls = called(first)
    assert first.stop_reason == "tool_use" and len(calls) == 1
    assert calls[0].id.startswith("toolu_") and (
        choice["type"] == "any" or calls[0].name == "weather"
    )
    schema = {t["name"]: t["input_schema"] for t in tools}[calls[0].name]
    jsonschema.validate(calls[0].input, schema)
    with client.messages.stream(**request, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in called(streamed)] == [(calls[0].name, calls[0].input)]
    openai_choice = (
        "required"
        if choice["type"] == "any"
        else {"type": "function", "function": {"name": "weather"}}
    )
    expected = chat.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[as_openai_tool(t) for t in tools],
        tool_choice=openai_choice,
        parallel_tool_calls=False,
        max_tokens=128,
        temperature=0,
    )
    call = expected.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == (
        calls[0].name,
        calls[0].input,
    )
    result = "Sunny, 21 degrees."
    answer = client.messages.create(
        model=MODEL,
        max_tokens=NEW_TOKENS,
        tools=tools,
        messages=[
            *ASK,
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": result}],
            },
        ],
        extra_body=GREEDY,
        tool_choice={"type": "none"},
    )
    reply = chat.chat.completions.create(
        model=MODEL,
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": calls[0].id,
                        "type": "function",
                        "function": {
                            "name": calls[0].name,
                            "arguments": json.dumps(calls[0].input),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": calls[0].id, "content": result},
        ],
        tools=[as_openai_tool(t) for t in tools],
        tool_choice="none",
        max_tokens=NEW_TOKENS,
        temperature=0,
    )
    assert text_of(answer) == reply.choices[0].message.content
    assert answer.usage.input_tokens == reply.usage.prompt_tokens


@pytest.mark.slow
def test_sampled_tool_inputs_validate_against_their_schemas(client):
    tools = [WEATHER, CLOCK]
    schemas = {t["name"]: t["input_schema"] for t in tools}
    for seed in range(6):
        one = seed % 2 == 1  # one call, or up to 8 (the reply may end at max_tokens between them)
        choice = {"type": "any", "disable_parallel_tool_use": one}
        for stream in (False, True):
            request = dict(
                model=MODEL,
                max_tokens=256,
                messages=ASK,
                tools=tools,
                tool_choice=choice,
                extra_body={"temperature": 1, "seed": seed},
            )
            if stream:
                with client.messages.stream(**request) as events:
                    message = events.get_final_message()
            else:
                message = client.messages.create(**request)
            reasons = ("tool_use",) if one else ("tool_use", "max_tokens")
            assert message.stop_reason in reasons and called(message), (seed, message)
            for block in called(message):
                jsonschema.validate(block.input, schemas[block.name])


@pytest.mark.slow
def test_count_tokens_is_the_prompt_a_request_counts(client, tokenizer):
    system = "You answer like a pirate."
    counted = client.messages.count_tokens(
        model=MODEL, messages=ASK, system=system, tools=[WEATHER]
    )
    answer = client.messages.create(
        model=MODEL,
        max_tokens=4,
        messages=ASK,
        system=system,
        tools=[WEATHER],
        tool_choice={"type": "auto"},
        extra_body=GREEDY,
    )
    assert counted.input_tokens == answer.usage.input_tokens
    plain = [{"role": "system", "content": system}, *ASK]
    alone = client.messages.count_tokens(model=MODEL, messages=ASK, system=system)
    ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    assert alone.input_tokens == len(getattr(ids, "input_ids", ids))
    assert counted.input_tokens > alone.input_tokens  # the tools are in the prompt


BAD = [  # (what is wrong, body, status, error type, what the message names)
    (
        "max_tokens missing",
        {"model": MODEL, "messages": ASK},
        400,
        "invalid_request_error",
        "max_tokens",
    ),
    (
        "messages of the wrong type",
        {"model": MODEL, "max_tokens": 4, "messages": "hi"},
        400,
        "invalid_request_error",
        "messages",
    ),
    (
        "a string temperature",
        {"model": MODEL, "max_tokens": 4, "messages": ASK, "temperature": "hot"},
        400,
        "invalid_request_error",
        "temperature",
    ),
    (
        "an unknown tool type",
        {
            "model": MODEL,
            "max_tokens": 4,
            "messages": ASK,
            "tools": [{"type": "bash_20250124", "name": "bash"}],
        },
        400,
        "invalid_request_error",
        "bash_20250124",
    ),
    (
        "max_tokens over the limit",
        {"model": MODEL, "max_tokens": 100000, "messages": ASK},
        400,
        "invalid_request_error",
        "prompt tokens + `max_tokens` must be <= 768",
    ),
    (
        "an image block without data",
        {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}
                    ],
                }
            ],
        },
        400,
        "invalid_request_error",
        "data",
    ),
    (
        "an image to a text model",
        {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        }
                    ],
                }
            ],
        },
        400,
        "invalid_request_error",
        "does not take images",
    ),
    (
        "a model not served",
        {"model": "claude-x", "max_tokens": 4, "messages": ASK},
        404,
        "not_found_error",
        "claude-x",
    ),
]


@pytest.mark.slow
def test_bad_requests_get_anthropics_errors_while_a_stream_runs_unharmed(client, url):
    request = dict(model=MODEL, max_tokens=NEW_TOKENS, messages=ASK, extra_body=GREEDY)
    alone = client.messages.create(**request)
    answers = []

    def refuse_each():
        headers = {"x-api-key": KEY}
        for _, body, *_ in BAD:
            answers.append(httpx.post(f"{url}/v1/messages", json=body, headers=headers, timeout=60))
        answers.append(
            httpx.post(f"{url}/v1/messages", json=request, headers={"x-api-key": "wrong"})
        )

    with ThreadPoolExecutor(1) as pool, client.messages.stream(**request) as stream:
        texts, refusing = [], None
        for text in stream.text_stream:
            texts.append(text)
            refusing = refusing or pool.submit(refuse_each)
        refusing.result()
        final = stream.get_final_message()
    assert "".join(texts) == text_of(alone) and shown(final) == shown(alone)
    for (what, _, status, kind, named), answer in zip(BAD, answers):
        assert answer.status_code == status, (what, answer.text)
        error = answer.json()
        assert error["type"] == "error" and error["error"]["type"] == kind, what
        assert named in error["error"]["message"], (what, error)
    unauthorized = answers[-1]
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"]["type"] == "authentication_error"


@pytest.mark.slow
def test_a_wrong_key_raises_the_clients_authentication_error(url):
    wrong = anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="`max_tokens` must be <= 768"):
        anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(
            model=MODEL, max_tokens=5000, messages=ASK
        )


@pytest.mark.slow
def test_the_routes_are_in_openapi_and_counted_in_the_metrics(url):
    paths = httpx.get(f"{url}/openapi.json", headers={"x-api-key": KEY}, timeout=30).json()["paths"]
    assert "post" in paths["/v1/messages"] and "post" in paths["/v1/messages/count_tokens"]

    def validation_count() -> float:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        return float(
            re.search(r'bucketserve_requests_total\{outcome="validation"\} (\S+)', text)[1]
        )

    before = validation_count()
    body = {"model": MODEL, "messages": ASK}
    httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert validation_count() == before + 1


# --- an image to the tiny LLaVA -------------------------------------------------------------------


@pytest.fixture(scope="module")
def llava_url(tiny_llava_dir):
    with shard_and_router(
        tiny_llava_dir, short_socket_dir() / "l", LLAVA_LIMITS, LLAVA_LIMITS
    ) as served:
        yield served[0]


@pytest.mark.slow
def test_an_image_block_gives_transformers_tokens(llava_url, tiny_llava_dir):
    picture = image_bytes(40, 30, seed=7)
    source = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(picture).decode(),
    }
    content = [
        {"type": "text", "text": "What is in "},
        {"type": "image", "source": source},
        {"type": "text", "text": "?"},
    ]
    client = anthropic.Anthropic(base_url=llava_url, api_key="-", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": content}]
    reply = client.messages.create(model=MODEL, max_tokens=30, messages=messages, extra_body=GREEDY)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is in \x00?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    before, after = prompt.split("\x00")
    expected = llava_reference(
        tiny_llava_dir, [before, picture, after], 30, add_special_tokens=False, eos=True
    )
    assert text_of(reply) == tokenizer.decode(expected, skip_special_tokens=True)
    assert client.messages.count_tokens(model=MODEL, messages=messages).input_tokens == (
        reply.usage.input_tokens
    )
    corrupt = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(b"\x89PNG" + bytes(40)).decode(),
    }
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model=MODEL,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": corrupt}]}],
        )
    assert refused.value.body["error"]["type"] == "invalid_request_error"
