"""`n` > 1 (OpenAI) and `best_of` (TGI) over a real shard and router process: the sequences of one prompt
share one prefill (read from the shard's step counters in /metrics), each sibling samples with its own
seed (seed + k), greedy siblings equal a lone request, and bad counts are 422s naming the field."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from text_generation import Client

from router.sched.fanout import MAX_SIBLINGS
from tests.test_router_http import shard_and_router
from tests.test_server import short_socket_dir

pytestmark = pytest.mark.slow  # end to end: real shard and router processes

PROMPT = "Once upon a time, in a kingdom by the sea, there lived"
LIMITS = [
    "--max-input-tokens",
    "64",
    "--max-total-tokens",
    "128",
    "--max-batch-prefill-tokens",
    "128",
    "--max-batch-size",
    "8",
]
SHARD_LIMITS = ["--max-batch-size", "8"]
COUNTERS = ("prefill_real_tokens", "prefill_forwards", "copied_prompts")


@pytest.fixture(scope="module")
def url(tiny_model_dirs):
    with shard_and_router(
        tiny_model_dirs["llama"], short_socket_dir() / "n", SHARD_LIMITS, LIMITS
    ) as served:
        # the shard reports its counters with every step: one request makes them show in /metrics
        httpx.post(
            f"{served[0]}/generate",
            json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}},
            timeout=60,
        )
        yield served[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def shard_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        name: float(re.search(rf"^bucketserve_shard_{name}_total (\S+)$", text, re.M)[1])
        for name in COUNTERS
    }


def completions(client, n: int, **extra) -> tuple[list[str], object]:
    reply = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=12, n=n, **extra)
    assert [c.index for c in reply.choices] == list(range(n))
    return [c.text for c in reply.choices], reply.usage


def test_n4_with_a_seed_gives_four_reproducible_sequences_for_one_prefill(client, url):
    before = shard_counters(url)
    texts, usage = completions(client, 4, seed=7, temperature=1.0)
    after = shard_counters(url)
    assert len(set(texts)) == 4  # four seeds, four sequences
    assert after["prefill_forwards"] - before["prefill_forwards"] == 1
    assert (
        after["prefill_real_tokens"] - before["prefill_real_tokens"] == usage.prompt_tokens
    )  # the prompt once
    assert after["copied_prompts"] - before["copied_prompts"] == 3
    assert usage.completion_tokens == 4 * 12
    assert completions(client, 4, seed=7, temperature=1.0)[0] == texts
    # sibling k samples with seed + k: the second sequence is what a lone request with seed 8 gives
    assert completions(client, 1, seed=8, temperature=1.0)[0] == texts[1:2]


def test_greedy_n2_gives_two_equal_sequences_equal_to_n1(client):
    chat = dict(
        model="tgi", messages=[{"role": "user", "content": PROMPT}], max_tokens=10, temperature=0
    )
    two = client.chat.completions.create(n=2, **chat)
    one = client.chat.completions.create(n=1, **chat)
    assert [c.index for c in two.choices] == [0, 1]
    assert (
        two.choices[0].message.content
        == two.choices[1].message.content
        == one.choices[0].message.content
    )
    assert two.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert two.usage.prompt_tokens == one.usage.prompt_tokens


@pytest.mark.parametrize("n", [0, MAX_SIBLINGS + 1])
def test_bad_n_is_422_naming_the_field(client, n):
    with pytest.raises(
        openai.UnprocessableEntityError, match=rf"`n` must be >= 1 and <= {MAX_SIBLINGS}"
    ):
        client.completions.create(model="tgi", prompt=PROMPT, max_tokens=4, n=n)
    with pytest.raises(openai.UnprocessableEntityError, match="`n` must be"):
        client.chat.completions.create(
            model="tgi", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=n
        )


def test_streamed_n_sends_each_choice_by_index_as_the_unstreamed_reply_has_it(client, url):
    texts, usage = completions(client, 3, seed=11, temperature=1.0)
    before = shard_counters(url)
    parts, finished, usages = {}, set(), []
    for chunk in client.completions.create(
        model="tgi",
        prompt=PROMPT,
        max_tokens=12,
        n=3,
        seed=11,
        temperature=1.0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        usages += [chunk.usage] if chunk.usage else []
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + choice.text
            finished |= {choice.index} if choice.finish_reason else set()
    assert shard_counters(url)["prefill_forwards"] - before["prefill_forwards"] == 1
    assert [parts[i] for i in range(3)] == texts and finished == {0, 1, 2}
    assert len(usages) == 1 and usages[0].completion_tokens == usage.completion_tokens == 3 * 12
    chat = dict(
        model="tgi",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=10,
        temperature=0,
        n=2,
    )
    whole = client.chat.completions.create(**chat)
    streamed = {}
    for chunk in client.chat.completions.create(stream=True, **chat):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[0], streamed[1]] == [c.message.content for c in whole.choices]


def test_tgi_best_of_answers_the_likeliest_and_lists_the_others(url):
    before = shard_counters(url)
    response = Client(url, timeout=120).generate(
        PROMPT, do_sample=True, best_of=3, max_new_tokens=8
    )
    after = shard_counters(url)
    assert after["prefill_forwards"] - before["prefill_forwards"] == 1
    others = response.details.best_of_sequences
    assert len(others) == 2

    def mean(tokens):
        return sum(t.logprob for t in tokens) / len(tokens)

    assert all(mean(response.details.tokens) >= mean(o.tokens) for o in others)
    assert len({response.generated_text, *(o.generated_text for o in others)}) == 3


@pytest.mark.parametrize(
    "parameters, message",
    [
        ({"best_of": 2}, "you must use sampling when `best_of` is > 1"),
        ({"best_of": 2, "do_sample": True, "seed": 3}, "`seed` must not be set when `best_of` > 1"),
        (
            {"best_of": MAX_SIBLINGS + 1, "do_sample": True},
            f"`best_of` must be >= 1 and <= {MAX_SIBLINGS}",
        ),
        ({"best_of": 0}, "`best_of` must be > 0"),
    ],
)
def test_bad_best_of_is_422(url, parameters, message):
    response = httpx.post(
        f"{url}/generate",
        json={"inputs": PROMPT, "parameters": {"max_new_tokens": 4, **parameters}},
        timeout=30,
    )
    assert response.status_code == 422 and message in response.json()["error"], response.text
    streamed = httpx.post(
        f"{url}/generate_stream",
        timeout=30,
        json={
            "inputs": PROMPT,
            "parameters": {"max_new_tokens": 4, "best_of": 2, "do_sample": True},
        },
    )
    assert (
        streamed.status_code == 422 and "not supported when streaming" in streamed.json()["error"]
    )
