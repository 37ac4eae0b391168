"""The router's OpenAI routes and /tokenize over a real shard and router process (tiny Llama), driven
with the `openai` package itself and with raw HTTP for what the package hides."""

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.test_equivalence import PROMPTS, reference_tokens
from tests.test_router_http import served  # noqa: F401 - the shard + router processes of this module

pytestmark = pytest.mark.slow  # end to end: real shard and router processes

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def url(served):  # noqa: F811
    return served[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dirs):
    return AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])


def chat_reference(model_dir, tokenizer, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = reference_tokens(
        model_dir, [prompt], NEW_TOKENS, add_special_tokens=False, stop_on_eos=True
    )[0]
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_openai_chat_greedy_matches_transformers(client, tiny_model_dirs, tokenizer):
    expected = chat_reference(tiny_model_dirs["llama"], tokenizer, PROMPTS[0])
    response = client.chat.completions.create(
        model="tgi",
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=NEW_TOKENS,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason in ("length", "stop")
    prompt_tokens = len(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[0]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )["input_ids"]
    )
    assert response.usage.prompt_tokens == prompt_tokens
    assert 0 < response.usage.completion_tokens <= NEW_TOKENS
    assert response.usage.total_tokens == prompt_tokens + response.usage.completion_tokens


def test_openai_chat_stream_equals_whole(client):
    messages = [{"role": "user", "content": PROMPTS[2]}]
    whole = client.chat.completions.create(
        model="tgi", messages=messages, max_tokens=NEW_TOKENS, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="tgi",
            messages=messages,
            max_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finished = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finished == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_chat_stream_ends_with_done(url):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(line[5:])["object"] == "chat.completion.chunk" for line in lines[:-1])


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model="tgi",
        messages=[{"role": "user", "content": PROMPTS[1]}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-5)


def test_response_format_json_schema_is_followed(client):
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    response = client.chat.completions.create(
        model="tgi",
        messages=[{"role": "user", "content": "Pick a color."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "color", "schema": schema}},
    )
    assert json.loads(response.choices[0].message.content)["color"] in ("red", "green", "blue")


def test_completions_equal_generate(client, url):
    completion = client.completions.create(
        model="tgi", prompt=PROMPTS[3], max_tokens=NEW_TOKENS, temperature=0, logprobs=2
    )
    generated = httpx.post(
        f"{url}/generate",
        json={"inputs": PROMPTS[3], "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}},
        timeout=60,
    ).json()
    choice = completion.choices[0]
    assert choice.text == generated["generated_text"]
    assert choice.logprobs.tokens == [t["text"] for t in generated["details"]["tokens"]]
    assert choice.logprobs.token_logprobs == pytest.approx(
        [t["logprob"] for t in generated["details"]["tokens"]]
    )
    assert completion.usage.completion_tokens == generated["details"]["generated_tokens"]
    streamed = list(
        client.completions.create(
            model="tgi", prompt=PROMPTS[3], max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_models_lists_the_served_model(client, url):
    info = httpx.get(f"{url}/info", timeout=30).json()
    assert [m.id for m in client.models.list().data] == [info["model_id"]]


def test_a_model_that_is_not_served_is_404_in_openais_shape(client):
    with pytest.raises(openai.NotFoundError) as refused:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    assert refused.value.status_code == 404
    assert refused.value.body == {
        "message": "The model `gpt-4` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


def test_the_served_name_and_tgis_alias_are_served_and_answered_with_the_served_name(client, url):
    served = httpx.get(f"{url}/info", timeout=30).json()["model_id"]
    assert served == "llama"  # the model directory's name
    for name in (served, "tgi"):
        assert client.completions.create(model=name, prompt="Hi", max_tokens=2).model == served


def test_tokenize_matches_the_tokenizer(url, tokenizer):
    text = "The quick brown fox"
    tokens = httpx.post(f"{url}/tokenize", json={"inputs": text}, timeout=30).json()
    assert [t["id"] for t in tokens] == tokenizer(text)["input_ids"]
    assert "".join(t["text"] for t in tokens) == text
    assert all(text[t["start"] : t["stop"]] == t["text"] for t in tokens)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"messages": [], "max_tokens": 4}, "`messages` cannot be empty"),
        ({"messages": [{"role": "user", "content": "Hi"}], "n": 0}, "`n` must be >= 1"),
        (
            {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 9},
            "`top_logprobs`",
        ),
        (
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5000},
            "`max_new_tokens` must be <=",
        ),
        ({"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}, "`temperature`"),
        ({"messages": "not a list"}, "messages"),
    ],
)
def test_openai_validation_errors_are_422(url, body, message):
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 422, response.text
    error = response.json()["error"]  # OpenAI's error object
    assert (
        error["code"] == "validation"
        and error["type"] == "invalid_request_error"
        and message in error["message"]
    )


def test_openai_package_raises_on_validation_error(client):
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(
            model="tgi", messages=[{"role": "user", "content": "Hi"}], n=99
        )


def test_unknown_adapter_is_422_naming_the_loaded_ones(url):
    response = httpx.post(
        f"{url}/generate", json={"inputs": "Hi", "parameters": {"adapter_id": "nope"}}, timeout=30
    )
    assert response.status_code == 422
    assert (
        "unknown adapter_id 'nope'" in response.json()["error"]
        and "none" in response.json()["error"]
    )
