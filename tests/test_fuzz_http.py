"""Hypothesis-generated HTTP bodies against a live router on the tiny Llama: random JSON, random
types in every TGI and OpenAI field, random bytes. Whatever comes in, no answer is a 5xx without a
JSON body, no process dies, every KV block comes back, and a well-formed request sent afterwards
still gives transformers' tokens. Bounded: a fixed number of examples, each with a deadline."""

import json
import time
from datetime import timedelta

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_equivalence import PROMPTS, reference_tokens
from tests.test_router_http import (
    ROUTER_LIMITS,
    WAIT_FOR_SHARD,
    free_port,
    generate,
    start_router,
    token_ids,
    wait_for_router,
)
from tests.test_server import (
    short_socket_dir,
    start_cli_server,
    stop_cli_server,
    wait_until_serving,
)

pytestmark = pytest.mark.slow  # end to end: real shard and router processes

EXAMPLES = 80
ROUTES = [
    "/generate",
    "/generate_stream",
    "/",
    "/tokenize",
    "/v1/chat/completions",
    "/v1/completions",
]
TGI_FIELDS = [
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "do_sample",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "stop",
    "truncate",
    "return_full_text",
    "details",
    "decoder_input_details",
    "top_n_tokens",
    "watermark",
    "best_of",
    "grammar",
    "adapter_id",
]
OPENAI_FIELDS = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "frequency_penalty",
    "presence_penalty",
    "logprobs",
    "top_logprobs",
    "response_format",
    "echo",
    "max_completion_tokens",
    "logit_bias",
    "tools",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["", "\ud800", "(unclosed", "json", "regex", "user", "Hello"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
small_ints = st.integers(min_value=-3, max_value=40)
field_values = st.one_of(json_values, small_ints)
tgi_bodies = st.fixed_dictionaries(
    {"inputs": st.one_of(st.text(max_size=60), json_values)},
    optional={
        "parameters": st.dictionaries(st.sampled_from(TGI_FIELDS), field_values, max_size=6),
        "stream": st.booleans(),
    },
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.one_of(st.sampled_from(["user", "system", "assistant"]), json_values),
            "content": st.one_of(st.text(max_size=40), json_values),
        }
    ),
    max_size=3,
)
openai_bodies = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.one_of(messages, json_values),
        "prompt": st.one_of(st.text(max_size=40), json_values),
    },
).flatmap(
    lambda base: st.dictionaries(st.sampled_from(OPENAI_FIELDS), field_values, max_size=5).map(
        lambda extra: {**base, **extra}
    )
)


def encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


bodies = st.one_of(
    tgi_bodies.map(encode),
    openai_bodies.map(encode),
    json_values.map(encode),
    st.binary(max_size=200),
)


@pytest.fixture(scope="module")
def live(tiny_model_dirs):
    """(router URL, [shard process, router process]) on the tiny Llama."""
    model_dir, base = tiny_model_dirs["llama"], short_socket_dir() / "s"
    processes = [start_cli_server(model_dir, base, extra=["--max-batch-size", "4"])]
    try:
        port = free_port()  # the router starts beside the shard (tests/test_router_http.py)
        processes.append(start_router(model_dir, base, port, [*ROUTER_LIMITS, *WAIT_FOR_SHARD]))
        wait_until_serving(processes[0], f"unix://{base}-0", base).close()
        wait_for_router(processes[1], f"http://127.0.0.1:{port}", base)
        yield f"http://127.0.0.1:{port}", processes
    finally:
        for process in reversed(processes):
            stop_cli_server(process)


def check_answer(response: httpx.Response) -> None:
    if response.status_code >= 500 or response.headers.get("content-type", "").startswith(
        "application/json"
    ):
        json.loads(response.content)  # a 5xx (or any JSON answer) must be well-formed JSON
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data:") and line.strip() not in ("data: [DONE]", "data:[DONE]"):
                json.loads(line[5:])


def test_random_bodies_never_break_the_router(live, tiny_model_dirs, capsys):
    url, processes = live
    counts = {"cases": 0, "statuses": {}}
    with httpx.Client(base_url=url, timeout=60) as client:

        @settings(
            max_examples=EXAMPLES,
            deadline=timedelta(seconds=20),
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )
        @given(route=st.sampled_from(ROUTES), body=bodies)
        def one(route, body):
            response = client.post(
                route, content=body, headers={"content-type": "application/json"}
            )
            counts["cases"] += 1
            counts["statuses"][response.status_code] = (
                counts["statuses"].get(response.status_code, 0) + 1
            )
            check_answer(response)  # a 5xx (or any JSON answer) has a well-formed JSON body
            assert all(p.poll() is None for p in processes), "a process died"

        one()
        assert_idle(client)
    expected = reference_tokens(tiny_model_dirs["llama"], [PROMPTS[2]], 12, stop_on_eos=True)[0]
    assert token_ids(generate(url, PROMPTS[2], max_new_tokens=12)) == expected
    with capsys.disabled():
        print(
            f"\nHTTP fuzz: {counts['cases']} cases, by status {dict(sorted(counts['statuses'].items()))}"
        )


def assert_idle(client: httpx.Client, timeout: float = 30) -> None:
    """Every KV block back in the allocator, nothing queued or running."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in client.get("/metrics").text.splitlines()
            if line.startswith(
                ("bucketserve_kv_blocks_in_use", "bucketserve_queue_size", "bucketserve_running")
            )
        }
        if not any(gauges.values()):
            return
        assert time.monotonic() < deadline, f"the router is not idle: {gauges}"
        time.sleep(0.1)
