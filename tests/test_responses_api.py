"""OpenAI's Responses API (`/v1/responses`) over a real shard and router of the embedded model,
driven by the `openai` package itself (and raw HTTP for the error bodies): plain, streamed,
function calls, `json_schema`, conversations continued by `previous_response_id` from the bounded
store, and bad input beside a running request. Greedy answers are compared with what
`/v1/chat/completions` answers for the same conversation."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from router.http.response_store import ResponseStore
from router.http.responses_request import input_messages
from tests.test_router_http import shard_and_router
from tests.test_server import short_socket_dir

KEY = "sk-responses-test"
HEADERS = {"Authorization": f"Bearer {KEY}"}
STORED = 3  # the router's --max-stored-responses: small, so that a test can evict
LIMITS = ["--max-input-tokens", "768", "--max-total-tokens", "1280", "--max-batch-size", "4"]
SHARD_LIMITS = [*LIMITS, "--max-prefill-tokens", "1024"]
ROUTER_LIMITS = [*LIMITS, "--max-batch-prefill-tokens", "1024"]
ROUTER = [*ROUTER_LIMITS, "--api-key", KEY, "--max-stored-responses", str(STORED)]
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Oslo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city"],
    },
}
CLOCK = {
    "type": "function",
    "name": "clock",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "maxLength": 4}},
        "required": ["zone"],
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "big": {"type": "boolean"}},
    "required": ["city", "big"],
    "additionalProperties": False,
}


def chat_tool(tool: dict) -> dict:
    """The same function as chat completions declares it."""
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


@pytest.fixture(scope="module")
def url(smollm_dir):
    base = short_socket_dir() / "r"
    with shard_and_router(smollm_dir, base, SHARD_LIMITS, ROUTER) as served:
        yield served[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=300)


def greedy(client, **request):
    return client.responses.create(model="tgi", temperature=0, **request)


def chat_answer(client, messages: list[dict], **request):
    return client.chat.completions.create(
        model="tgi", messages=messages, temperature=0, **request
    ).choices[0]


def calls_of(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def assert_valid_calls(calls, names=frozenset(SCHEMAS)) -> None:
    for call in calls:
        assert call.name in names and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def streamed(client, **request) -> tuple[list, object]:
    with client.responses.stream(model="tgi", **request) as stream:
        events = list(stream)
        return events, stream.get_final_response()


# --- text ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_text_equals_chat_completions_with_usage_and_status(client):
    response = greedy(client, instructions="Answer briefly.", input=QUESTION, max_output_tokens=24)
    system = {"role": "system", "content": "Answer briefly."}
    chat = chat_answer(client, [system, {"role": "user", "content": QUESTION}], max_tokens=24)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.message.content != ""
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    usage = client.chat.completions.create(
        model="tgi", messages=[system, {"role": "user", "content": QUESTION}], max_tokens=24
    ).usage
    assert response.usage.input_tokens == usage.prompt_tokens
    assert 0 < response.usage.output_tokens <= 24
    assert response.usage.total_tokens == usage.prompt_tokens + response.usage.output_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    # The same words as content parts of an item list give the same prompt and answer.
    parts = [
        {"type": "input_text", "text": "What is the capital"},
        {"type": "input_text", "text": " of France?"},
    ]
    items = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": parts},
    ]
    assert greedy(client, input=items, max_output_tokens=24).output_text == response.output_text


@pytest.mark.slow
def test_the_token_limit_gives_an_incomplete_response(client):
    response = greedy(client, input=QUESTION, max_output_tokens=2, metadata={"k": "v"}, user="u")
    assert (
        response.status == "incomplete"
        and response.incomplete_details.reason == "max_output_tokens"
    )
    assert response.usage.output_tokens == 2 and response.output[0].status == "incomplete"
    assert response.metadata == {"k": "v"} and response.user == "u"


EXPECTED_TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def collapsed(types: list[str]) -> list[str]:
    """Event types with runs of the same delta type counted once."""
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1] or "delta" not in t]


@pytest.mark.slow
def test_a_stream_gives_the_typed_events_in_order_and_the_whole_answer(client):
    request = dict(input=QUESTION, temperature=0, max_output_tokens=64)
    events, final = streamed(client, **request)
    whole = client.responses.create(model="tgi", **request)
    types = [e.type for e in events]
    assert collapsed(types) == EXPECTED_TEXT_EVENTS, types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text != ""
    assert final.id == events[0].response.id and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


def raw_events(url: str, body: dict) -> list[dict]:
    """The server-sent events as sent: each `data` payload, checked against its `event` line."""
    events, kind = [], None
    body = {"model": "tgi", **body, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/responses", json=body, headers=HEADERS, timeout=300
    ) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
                assert events[-1]["type"] == kind
    return events


@pytest.mark.slow
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_events_and_responses_validate_against_the_openai_types(url, tools):
    body = {"input": QUESTION, "temperature": 0, "max_output_tokens": 24}
    body |= {"tools": tools, "tool_choice": "required"} if tools else {}
    events = raw_events(url, body)
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:  # strict: every required field there, with its type
        adapter.validate_python(event)
    Response.model_validate(events[-1]["response"])
    whole = httpx.post(f"{url}/v1/responses", json=body, headers=HEADERS, timeout=300)
    Response.model_validate(whole.json())
    assert [i["type"] for i in whole.json()["output"]] == [
        i["type"] for i in events[-1]["response"]["output"]
    ]


# --- function calls -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_is_valid_and_equals_chat_completions(client, stream):
    request = dict(
        input="What is the weather in Paris?", tools=TOOLS, tool_choice="required", temperature=0
    )
    if stream:
        events, response = streamed(client, **request)
        types = [e.type for e in events]
        assert "response.function_call_arguments.delta" in types
        assert "response.function_call_arguments.done" in types
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert types[-1] == "response.completed"
    else:
        response = client.responses.create(model="tgi", **request)
    calls = calls_of(response)
    assert calls and len(calls) == len(response.output)
    assert_valid_calls(calls)
    chat = chat_answer(
        client,
        [{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[chat_tool(t) for t in TOOLS],
        tool_choice="required",
    )
    expected = [(c.function.name, c.function.arguments) for c in chat.message.tool_calls]
    assert [(c.name, c.arguments) for c in calls] == expected


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_a_named_call_calls_that_function_once(client, stream):
    request = dict(
        input="What time is it in Oslo?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "clock"},
        temperature=1.0,
        extra_body={"seed": 7},
    )
    if stream:
        response = streamed(client, **request)[1]
    else:
        response = client.responses.create(model="tgi", **request)
    calls = calls_of(response)
    assert len(calls) == 1 == len(response.output) and response.status == "completed"
    assert_valid_calls(calls, {"clock"})


@pytest.mark.slow
def test_every_call_at_temperature_1_is_valid_over_seeds(client):
    def one(seed_and_choice):
        seed, choice = seed_and_choice
        return client.responses.create(
            model="tgi",
            input="What is the weather in Paris?",
            tools=TOOLS,
            tool_choice=choice,
            temperature=1.0,
            max_output_tokens=120,
            extra_body={"seed": seed},
        )

    cases = [(seed, choice) for seed in range(6) for choice in ("required", "auto")]
    with ThreadPoolExecutor(4) as pool:  # four at once: the router batches them
        responses = list(pool.map(one, cases))
    for (_, choice), response in zip(cases, responses):
        calls = calls_of(response)
        assert_valid_calls(calls)
        if choice == "required" and response.status == "completed":
            assert calls
    assert sum(len(calls_of(r)) for r in responses) >= 6


# --- structured output --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates_and_equals_chat_completions(client, stream):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    request = dict(input="Name a big city, as JSON.", text={"format": fmt}, temperature=0)
    if stream:
        response = streamed(client, **request)[1]
    else:
        response = client.responses.create(model="tgi", **request)
    jsonschema.validate(json.loads(response.output_text), CITY)
    chat = chat_answer(
        client,
        [{"role": "user", "content": "Name a big city, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
    )
    assert response.output_text == chat.message.content


# --- conversations and the store ----------------------------------------------------------------


@pytest.mark.slow
def test_previous_response_id_continues_the_conversation_as_chat_would(client):
    first = greedy(client, instructions="Be brief.", input="My name is Ann.", max_output_tokens=16)
    second = greedy(
        client, previous_response_id=first.id, input="What is my name?", max_output_tokens=16
    )
    assert second.previous_response_id == first.id
    # Instructions are not carried over (OpenAI's rule); the earlier turns are.
    history = [
        {"role": "user", "content": "My name is Ann."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.output_text == chat_answer(client, history, max_tokens=16).message.content
    assert client.responses.retrieve(first.id).output_text == first.output_text


@pytest.mark.slow
def test_a_call_result_sent_back_continues_as_chat_would(client):
    call = greedy(
        client,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    (item,) = calls_of(call)
    result = {"type": "function_call_output", "call_id": item.call_id, "output": "Sunny, 21 C"}
    follow = greedy(
        client,
        previous_response_id=call.id,
        input=[result],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=16,
    )
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": item.call_id, "content": "Sunny, 21 C"},
    ]
    chat = chat_answer(
        client, history, tools=[chat_tool(WEATHER)], tool_choice="none", max_tokens=16
    )
    assert follow.output_text == chat.message.content


@pytest.mark.slow
def test_the_store_evicts_the_least_recently_used_and_deletes(client):
    made = [greedy(client, input=f"Count to {i}.", max_output_tokens=1) for i in range(STORED)]
    client.responses.retrieve(made[0].id)  # used again: the second is now the least recent
    greedy(client, input="One more.", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[1].id)
    with pytest.raises(openai.BadRequestError) as refused:
        greedy(client, previous_response_id=made[1].id, input="Go on.", max_output_tokens=1)
    assert refused.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(made[0].id).id == made[0].id
    client.responses.delete(made[0].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0].id)
    unstored = greedy(client, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


# --- bad input ----------------------------------------------------------------------------------

IMAGE_WITHOUT_URL = [{"role": "user", "content": [{"type": "input_image", "detail": "auto"}]}]
BAD = [
    ({"model": "tgi"}, 422, "input"),  # required field missing
    ({"input": "Hi", "temperature": "hot"}, 422, "temperature"),
    ({"input": 5}, 422, "input"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "Hi", "tools": [{"type": "function"}]}, 400, "tools[0].name"),
    ({"input": "Hi", "tool_choice": {"type": "file_search"}}, 400, "tool_choice"),
    ({"input": "Hi", "previous_response_id": "resp_nothing"}, 400, "previous_response_id"),
    ({"input": "Hi", "max_output_tokens": 100000}, 400, "max_output_tokens"),
    ({"input": IMAGE_WITHOUT_URL}, 400, "input[0].content[0].image_url"),
    ({"input": "Hi", "background": True}, 400, "background"),
    ({"input": [{"type": "web_search_call"}]}, 400, "input[0].type"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema"}}}, 400, "text.format.schema"),
]


@pytest.mark.slow
def test_bad_input_is_4xx_in_openai_format_and_harms_no_running_request(client, url):
    request = dict(input=QUESTION, temperature=0, max_output_tokens=40)
    alone = client.responses.create(model="tgi", **request)
    started = threading.Event()

    def running():
        with client.responses.stream(model="tgi", **request) as stream:
            for event in stream:
                if event.type == "response.output_text.delta":
                    started.set()
            return stream.get_final_response()

    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(running)
        assert started.wait(300)
        for body, status, field in BAD:
            answer = httpx.post(f"{url}/v1/responses", json=body, headers=HEADERS, timeout=60)
            assert answer.status_code == status, (body, answer.text)
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error" and field in error["message"] + str(
                error["param"]
            ), (body, error)
            if status == 400:
                assert error["param"] == field
        assert beside.result().output_text == alone.output_text


@pytest.mark.slow
def test_the_routes_are_documented_guarded_and_counted(url):
    paths = httpx.get(f"{url}/openapi.json", headers=HEADERS, timeout=30).json()["paths"]
    assert "post" in paths["/v1/responses"]
    assert {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    body = {"input": "Hi", "max_output_tokens": 1}
    refused = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
    assert refused.status_code == 401 and "error" in refused.json()

    def successes() -> float:
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        line = next(
            m
            for m in metrics.splitlines()
            if m.startswith('bucketserve_requests_total{outcome="success"}')
        )
        return float(line.split()[-1])

    before = successes()
    assert (
        httpx.post(f"{url}/v1/responses", json=body, headers=HEADERS, timeout=60).status_code == 200
    )
    assert successes() == before + 1


# --- the store alone ----------------------------------------------------------------------------


def stored_response(response_id: str, text: str = "") -> dict:
    return {"id": response_id, "output": text}


def test_the_store_keeps_the_most_recently_used_within_its_count_and_size():
    store = ResponseStore(max_count=2)
    store.put(stored_response("a"), [])
    store.put(stored_response("b"), [])
    assert store.get("a") is not None  # now the most recent
    store.put(stored_response("c"), [])
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    sized = ResponseStore(max_count=10, max_chars=200)
    sized.put(stored_response("x", "x" * 80), [])
    sized.put(stored_response("y", "y" * 80), [])
    assert sized.get("x") is None and sized.get("y") is not None
    sized.put(stored_response("z", "z" * 500), [])  # larger than the whole store: not kept
    assert sized.get("z") is None and sized.get("y") is not None
    assert ResponseStore(max_count=0).get("none") is None


def test_input_items_become_the_messages_chat_completions_takes():
    image = "data:image/png;base64,AAAA"
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Look: "},
                {"type": "input_image", "image_url": image, "detail": "auto"},
            ],
        },
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "On it."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "clock", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "12:00"},
    ]
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image_url", "image_url": {"url": image}},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "On it."}], "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00", "name": "clock"},
    ]
