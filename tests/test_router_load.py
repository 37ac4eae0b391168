"""The router under concurrency and overload, over a real shard and router process (tiny Llama):
results do not depend on batching, nothing is lost, and every KV block comes back."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_equivalence import PROMPTS
from tests.test_router_http import WAIT_FOR_SHARD, free_port, start_router, wait_for_router
from tests.test_server import (
    short_socket_dir,
    start_cli_server,
    stop_cli_server,
    wait_until_serving,
)

pytestmark = pytest.mark.slow  # end to end: real shard and router processes

# Room for long generations: a stream must still be running when its client goes away.
LIMITS = [
    "--max-input-tokens",
    "64",
    "--max-total-tokens",
    "512",
    "--max-batch-prefill-tokens",
    "128",
    "--max-batch-size",
    "4",
]


@pytest.fixture(scope="module")
def url(tiny_model_dirs):
    model_dir, base = tiny_model_dirs["llama"], short_socket_dir() / "s"
    shard = start_cli_server(
        model_dir, base, extra=["--max-batch-size", "4", "--max-total-tokens", "512"]
    )
    router = None
    try:
        port = free_port()  # the router starts beside the shard (tests/test_router_http.py)
        router = start_router(model_dir, base, port, [*LIMITS, *WAIT_FOR_SHARD])
        wait_until_serving(shard, f"unix://{base}-0", base).close()
        wait_for_router(router, f"http://127.0.0.1:{port}", base)
        yield f"http://127.0.0.1:{port}"
    finally:
        if router is not None:
            stop_cli_server(router)
        stop_cli_server(shard)


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics by name (with its labels), parsed as Prometheus text."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def wait_idle(url: str, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        current = metrics(url)
        if (
            current["bucketserve_kv_blocks_in_use"] == 0
            and current["bucketserve_running_requests"] == 0
        ):
            return current
        assert time.monotonic() < deadline, f"the router never went idle: {current}"
        time.sleep(0.1)


def generate_ids(url: str, prompt: str, new_tokens: int) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "details": True}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def test_64_concurrent_requests_equal_the_same_run_one_at_a_time(url):
    cases = [(PROMPTS[i % len(PROMPTS)] + " " * (i % 3), 4 + i % 13) for i in range(64)]
    alone = [generate_ids(url, prompt, n) for prompt, n in cases]
    with ThreadPoolExecutor(64) as pool:
        together = list(pool.map(lambda case: generate_ids(url, *case), cases))
    assert together == alone
    after = wait_idle(url)
    assert after["bucketserve_batch_size_count{phase=decode}"] > 0
    assert (
        after["bucketserve_batch_size_sum{phase=decode}"]
        / after["bucketserve_batch_size_count{phase=decode}"]
        > 1
    )


def test_metrics_parse_and_count_what_happened(url):
    before = metrics(url)
    generate_ids(url, PROMPTS[0], 5)
    httpx.post(
        f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 0}}, timeout=30
    )
    after = wait_idle(url)
    assert (
        after["bucketserve_requests_total{outcome=success}"]
        == before["bucketserve_requests_total{outcome=success}"] + 1
    )
    assert (
        after["bucketserve_requests_total{outcome=validation}"]
        == before["bucketserve_requests_total{outcome=validation}"] + 1
    )
    assert (
        after["bucketserve_generated_tokens_total"]
        >= before["bucketserve_generated_tokens_total"] + 1
    )
    assert (
        after["bucketserve_time_to_first_token_seconds_count"]
        > before["bucketserve_time_to_first_token_seconds_count"]
    )
    assert after["bucketserve_kv_blocks_total"] > 0 and after["bucketserve_queue_size"] == 0
    # Reported by the shard after every step: strict mode keeps unwarmed shapes at 0.
    assert after["bucketserve_shard_unwarmed_shapes_total"] == 0
    assert (
        after["bucketserve_shard_prefill_padded_tokens_total"]
        >= after["bucketserve_shard_prefill_real_tokens_total"]
        > 0
    )
    assert 0 <= after["bucketserve_shard_decode_padding_waste_ratio"] < 1


def test_a_cancelled_stream_gives_back_its_blocks(url):
    before = wait_idle(url)
    body = {"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 440}}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as response:
        lines = response.iter_lines()  # kept: a dropped iterator would close the connection at once
        assert next(lines).startswith("data:")
        assert metrics(url)["bucketserve_kv_blocks_in_use"] > 0  # held while it streams
    after = wait_idle(url)
    assert (
        after["bucketserve_requests_total{outcome=cancelled}"]
        == before["bucketserve_requests_total{outcome=cancelled}"] + 1
    )
    generated = (
        after["bucketserve_generated_tokens_total"] - before["bucketserve_generated_tokens_total"]
    )
    assert 1 <= generated < 400  # it stopped long before its end


async def fire(url: str, count: int, new_tokens: int) -> list[int]:
    """`count` requests sent at once (far above what the shard serves): each one's status code."""
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(i: int) -> int:
            body = {
                "inputs": PROMPTS[i % len(PROMPTS)],
                "parameters": {"max_new_tokens": new_tokens},
            }
            return (await client.post(f"{url}/generate", json=body)).status_code

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_overload_answers_every_request_and_frees_every_block(url):
    before = metrics(url)
    statuses = asyncio.run(fire(url, 200, 16))
    assert len(statuses) == 200 and set(statuses) <= {200, 429}, sorted(set(statuses))
    assert (
        statuses.count(429) > 0 and statuses.count(200) >= 128
    )  # over capacity, and the queue was full
    after = wait_idle(url)
    served_ok = (
        after["bucketserve_requests_total{outcome=success}"]
        - before["bucketserve_requests_total{outcome=success}"]
    )
    refused = (
        after["bucketserve_requests_total{outcome=overloaded}"]
        - before["bucketserve_requests_total{outcome=overloaded}"]
    )
    assert (served_ok, refused) == (statuses.count(200), statuses.count(429))
    assert after["bucketserve_queue_size"] == 0
    response = httpx.post(
        f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=60
    )
    assert response.status_code == 200  # and it still serves
