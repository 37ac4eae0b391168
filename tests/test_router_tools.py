"""Tool calling, API keys, CORS, request ids and chat templates over a real shard and router process, driven
by the `openai` package. The model is a tiny random Qwen2 whose chat template reads `tools` and refuses system
messages (as some real templates do)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.models import build_tiny_model
from tests.test_router_http import shard_and_router
from tests.test_server import short_socket_dir
from tests.tool_schemas import tools as tool_lists

pytestmark = pytest.mark.slow  # end to end: real shard and router processes

KEY = "sk-test-key"
ORIGIN = "https://app.example"
# Room for a prompt that lists the tools, and for a reply spelled one character per token.
LIMITS = [
    "--max-input-tokens",
    "768",
    "--max-total-tokens",
    "1280",
    "--max-batch-prefill-tokens",
    "1024",
    "--max-batch-size",
    "4",
]
SHARD_LIMITS = [
    "--max-input-tokens",
    "768",
    "--max-total-tokens",
    "1280",
    "--max-prefill-tokens",
    "1024",
    "--max-batch-size",
    "4",
]
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call: {{ tools | tojson }}<|im_end|>
{% endif %}{%- for message in messages %}{% if message.role == 'system' %}\
{{ raise_exception('System messages are not supported by this template') }}{% endif %}<|im_start|>{{ message.role }}
{% if message.tool_calls %}{{ message.tool_calls | tojson }}{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 4}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tools_model(smollm_dir, tmp_path_factory) -> Path:
    model_dir = build_tiny_model(
        "qwen2",
        tmp_path_factory.mktemp("tools") / "qwen2-tools",
        smollm_dir,
        max_position_embeddings=2048,
    )
    (model_dir / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return model_dir


@pytest.fixture(scope="module")
def served(tools_model):
    router_args = LIMITS + ["--api-key", KEY, "--cors-allow-origin", ORIGIN]
    with shard_and_router(
        tools_model, short_socket_dir() / "t", SHARD_LIMITS, router_args
    ) as served:
        yield served


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


def validate_calls(calls, declared: list[dict], names: set[str]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in declared}
    assert calls
    for call in calls:
        assert (
            call.id.startswith("call_") and call.type == "function" and call.function.name in names
        )
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def streamed_calls(client, **request) -> tuple[list, str]:
    """The tool calls a stream sends, accumulated by index as OpenAI's clients do, and its finish reason."""
    calls, reason = {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                calls.setdefault(delta.index, delta)
    return [calls[i] for i in sorted(calls)], reason


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(declared=tool_lists(max_tools=2), seed=st.integers(0, 2**32))
def test_sampled_tool_calls_validate_streamed_and_not(client, declared, seed):
    # One call per reply (parallel replies are sampled in test_tools.py), and no max_tokens: the reply may take
    # all the room the prompt leaves, since a random model may spell a name one character per token.
    request = dict(
        model="tgi",
        messages=ASK,
        tools=declared,
        tool_choice="required",
        temperature=1.0,
        parallel_tool_calls=False,
    )

    def whole(s):
        choice = client.chat.completions.create(seed=s, **request).choices[0]
        return choice.message.tool_calls, choice.finish_reason

    with ThreadPoolExecutor(4) as pool:  # four at once: the router batches them
        replies = list(pool.map(whole, [seed, seed + 1, seed + 2]))
        replies.append(pool.submit(streamed_calls, client, seed=seed + 3, **request).result())
    names = {t["function"]["name"] for t in declared}
    for calls, reason in replies:
        assert reason == "tool_calls"
        validate_calls(calls, declared, names)


def test_named_tool_choice_is_respected(client):
    for seed in range(4):
        response = client.chat.completions.create(
            model="tgi",
            messages=ASK,
            tools=[WEATHER, CLOCK],
            temperature=1.0,
            seed=seed,
            max_tokens=100,
            tool_choice={"type": "function", "function": {"name": "clock"}},
            parallel_tool_calls=False,
        )
        calls = response.choices[0].message.tool_calls
        assert len(calls) == 1 and response.choices[0].finish_reason == "tool_calls"
        validate_calls(calls, [WEATHER, CLOCK], {"clock"})


GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ADD_NUMBERS = {
    "type": "function",
    "function": {
        "name": "add_numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TWO_TOOLS = [GET_WEATHER, ADD_NUMBERS]


def replies_at_temperature_1(client, tool_choice, seeds=range(12)) -> list:
    """Twelve seeded replies of at most 120 tokens, four at a time (the router batches them)."""

    def one(seed):
        return client.chat.completions.create(
            model="tgi",
            messages=ASK,
            tools=TWO_TOOLS,
            tool_choice=tool_choice,
            temperature=1.0,
            seed=seed,
            max_tokens=120,
        ).choices[0]

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, seeds))


def test_required_gives_valid_calls_even_when_the_token_limit_cuts_the_list(client):
    # Parallel calls are on (OpenAI's default): a list that the limit cuts keeps its complete calls.
    for choice in replies_at_temperature_1(client, "required"):
        assert choice.finish_reason in ("tool_calls", "length"), choice
        validate_calls(choice.message.tool_calls, TWO_TOOLS, {"get_weather", "add_numbers"})
        assert len(choice.message.tool_calls) <= 8


def test_a_cut_list_returns_the_calls_complete_before_the_cut(client):
    whole = {
        seed: choice for seed, choice in enumerate(replies_at_temperature_1(client, "required"))
    }
    seed = next(s for s, choice in whole.items() if len(choice.message.tool_calls) >= 2)
    full = client.chat.completions.create(
        model="tgi",
        messages=ASK,
        tools=TWO_TOOLS,
        tool_choice="required",
        temperature=1.0,
        seed=seed,
        max_tokens=120,
    )
    cut = client.chat.completions.create(
        model="tgi",
        messages=ASK,
        tools=TWO_TOOLS,
        tool_choice="required",
        temperature=1.0,
        seed=seed,
        max_tokens=full.usage.completion_tokens - 2,
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls, choice
    validate_calls(choice.message.tool_calls, TWO_TOOLS, {"get_weather", "add_numbers"})
    expected = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert got == expected[: len(got)]


def test_a_named_choice_gives_exactly_one_call_at_temperature_1(client):
    named = {"type": "function", "function": {"name": "add_numbers"}}
    for choice in replies_at_temperature_1(client, named):
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        validate_calls(choice.message.tool_calls, TWO_TOOLS, {"add_numbers"})


def test_a_schema_keyword_the_grammar_cannot_enforce_is_a_422_naming_it(client):
    unique = {
        "type": "function",
        "function": {
            "name": "tags",
            "parameters": {
                "type": "object",
                "properties": {"tags": {"type": "array", "uniqueItems": True}},
            },
        },
    }
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.chat.completions.create(model="tgi", messages=ASK, tools=[unique], max_tokens=8)
    assert "`uniqueItems`" in raised.value.response.json()["error"]["message"]
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.chat.completions.create(
            model="tgi",
            messages=ASK,
            max_tokens=8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "integer", "multipleOf": 2}},
            },
        )
    assert "`multipleOf`" in raised.value.response.json()["error"]["message"]


def test_tool_choice_none_answers_in_text(client):
    response = client.chat.completions.create(
        model="tgi", messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=8
    )
    choice = response.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


def test_auto_gives_a_valid_call_or_text(client):
    for seed in range(3):
        choice = client.chat.completions.create(
            model="tgi", messages=ASK, tools=[WEATHER], temperature=1.0, seed=seed, max_tokens=60
        ).choices[0]
        if choice.message.tool_calls:
            validate_calls(choice.message.tool_calls, [WEATHER], {"weather"})
        else:
            assert isinstance(choice.message.content, str) and choice.finish_reason in (
                "stop",
                "length",
            )


def test_tool_results_in_the_history_are_accepted(client, url):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    response = client.chat.completions.create(
        model="tgi", messages=messages, tools=[WEATHER], max_tokens=60
    )
    assert response.choices[0].finish_reason in ("tool_calls", "stop", "length")
    templated = httpx.post(
        f"{url}/chat_tokenize",
        json={"messages": messages, "tools": [WEATHER]},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    ).json()["templated_text"]
    assert (
        '"city": "Oslo"' in templated and "sunny" in templated and '"name": "weather"' in templated
    )


def test_a_template_that_refuses_gives_422_with_its_message(client):
    with pytest.raises(openai.UnprocessableEntityError) as raised:
        client.chat.completions.create(
            model="tgi", messages=[{"role": "system", "content": "Be brief."}, *ASK], max_tokens=4
        )
    assert "System messages are not supported" in raised.value.response.json()["error"]["message"]


# --- access: API key, CORS, request ids ---------------------------------------------------------------


def test_api_key_is_required_except_for_health_and_metrics(url):
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
    assert httpx.post(f"{url}/generate", json=body, timeout=30).status_code == 401
    wrong = httpx.post(
        f"{url}/generate", json=body, headers={"Authorization": "Bearer nope"}, timeout=30
    )
    assert wrong.status_code == 401 and wrong.json()["error_type"] == "authentication"
    right = httpx.post(
        f"{url}/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert right.status_code == 200
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200
    assert httpx.get(f"{url}/info", timeout=30).status_code == 401


def test_openai_client_without_the_key_gets_authentication_error(url):
    stranger = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as raised:
        stranger.chat.completions.create(model="tgi", messages=ASK, max_tokens=2)
    assert raised.value.body["code"] == "invalid_api_key"


def test_cors_preflight_and_headers(url):
    preflight = httpx.options(
        f"{url}/v1/chat/completions",
        timeout=30,
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert (
        preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    )
    other = httpx.options(
        f"{url}/v1/chat/completions",
        timeout=30,
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in other.headers
    refused = httpx.get(f"{url}/info", headers={"Origin": ORIGIN}, timeout=30)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_every_response_carries_a_request_id_that_the_log_names(url, served):
    auth = {"Authorization": f"Bearer {KEY}"}
    first = httpx.get(f"{url}/info", headers=auth, timeout=30).headers["x-request-id"]
    second = httpx.get(f"{url}/health", timeout=30).headers["x-request-id"]
    assert first and second and first != second
    mine = httpx.post(
        f"{url}/generate",
        json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}},
        headers={**auth, "x-request-id": "my-trace-42"},
        timeout=30,
    )
    assert mine.headers["x-request-id"] == "my-trace-42"
    hostile = httpx.get(f"{url}/health", headers={"x-request-id": "a b\tc"}, timeout=30)
    assert hostile.headers["x-request-id"] != "a b\tc"
    log = Path(f"{served[1]}.router.log").read_text()
    assert "[my-trace-42]" in log and "POST /generate -> 200" in log


# --- sampling fields through the openai client ---------------------------------------------------------


def greedy_reference(model_dir, prompt_ids: list[int], new: int, presence: float) -> list[int]:
    """Greedy decoding on transformers' logits with OpenAI's presence penalty applied by its definition."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, generated = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(new):
            scores = model(torch.tensor([ids])).logits[0, -1].clone()
            for token in set(generated):
                scores[token] -= presence
            generated.append(int(scores.argmax()))
            ids.append(generated[-1])
    return generated


def test_presence_penalty_matches_its_definition_on_transformers_logits(client, tools_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tools_model)
    new = 24
    for prompt in (
        "The cat sat on the mat and the cat",
        "1 2 3 4",
        "a a a a a",
        "Hello, Hello, Hello",
    ):
        expected = greedy_reference(tools_model, tokenizer(prompt)["input_ids"], new, presence=2.0)
        if expected != greedy_reference(
            tools_model, tokenizer(prompt)["input_ids"], new, presence=0.0
        ):
            break  # a prompt on which the penalty changes the greedy run, so the comparison means something
    else:
        pytest.fail("the penalty changed none of the greedy runs")
    response = client.completions.create(
        model="tgi",
        prompt=prompt,
        max_tokens=new,
        temperature=0,
        presence_penalty=2.0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert response.choices[0].text == tokenizer.decode(expected)


def test_logit_bias_bans_and_forces(client, tools_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tools_model)
    first = (
        client.completions.create(model="tgi", prompt="Hello", max_tokens=1, temperature=0)
        .choices[0]
        .text
    )
    banned_id = tokenizer(first, add_special_tokens=False)["input_ids"][0]
    other = (
        client.completions.create(
            model="tgi",
            prompt="Hello",
            max_tokens=1,
            temperature=0,
            logit_bias={str(banned_id): -100},
        )
        .choices[0]
        .text
    )
    assert other != first
    forced = tokenizer.convert_ids_to_tokens(300)
    text = (
        client.completions.create(
            model="tgi",
            prompt="Hello",
            max_tokens=4,
            temperature=1.0,
            seed=3,
            logit_bias={"300": 100},
        )
        .choices[0]
        .text
    )
    assert text == tokenizer.decode([300] * 4), forced


def test_min_tokens_and_ignore_eos(client):
    eos = {"2": 100}  # <|im_end|>: the model would end at once
    ended = client.completions.create(
        model="tgi", prompt="Hi", max_tokens=10, temperature=0, logit_bias=eos
    )
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    held = client.completions.create(
        model="tgi",
        prompt="Hi",
        max_tokens=10,
        temperature=0,
        logit_bias=eos,
        extra_body={"min_tokens": 4},
    )
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 5
    ignored = client.completions.create(
        model="tgi",
        prompt="Hi",
        max_tokens=6,
        temperature=0,
        logit_bias=eos,
        extra_body={"ignore_eos": True},
    )
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 6


def test_seed_stop_user_and_max_completion_tokens(client):
    request = dict(
        model="tgi", messages=ASK, temperature=1.0, seed=11, max_completion_tokens=8, user="someone"
    )
    first, again = (
        client.chat.completions.create(**request).choices[0].message.content for _ in range(2)
    )
    assert first == again
    other = client.chat.completions.create(**{**request, "seed": 12}).choices[0].message.content
    assert other != first
    stop = first[2:5]
    if stop.strip():
        cut = client.chat.completions.create(**request, stop=[stop]).choices[0]
        # The shard stops at the token that completes the stop sequence and keeps that token (TGI's behaviour).
        assert (
            cut.finish_reason == "stop"
            and stop in cut.message.content
            and first.startswith(cut.message.content)
        )


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"logit_bias": {"1": 101}}, "`logit_bias` values"),
        ({"logit_bias": {"99999999": 1}}, "`logit_bias` token ids"),
        ({"presence_penalty": 3}, "`presence_penalty`"),
        ({"min_tokens": 99}, "`min_tokens`"),
    ],
)
def test_bad_sampling_fields_are_422_naming_them(url, extra, message):
    body = {"model": "tgi", "messages": ASK, "max_tokens": 8, **extra}
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert response.status_code == 422 and message in response.json()["error"]["message"]


def test_tgi_generate_takes_the_same_extensions(url):
    def generate(**parameters):
        body = {
            "inputs": "Hi",
            "parameters": {
                "max_new_tokens": 8,
                "details": True,
                "logit_bias": {"2": 100},
                **parameters,
            },
        }
        response = httpx.post(
            f"{url}/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
        )
        assert response.status_code == 200, response.text
        return response.json()["details"]

    assert generate()["generated_tokens"] == 1
    held = generate(min_new_tokens=3)
    assert held["generated_tokens"] == 4 and held["finish_reason"] == "eos_token"
    ignored = generate(ignore_eos=True)
    assert ignored["generated_tokens"] == 8 and ignored["finish_reason"] == "length"
