"""The router checks a request's lengths in one place, in TGI's words: `/generate` over HTTP and the
offline path (router/offline.py, straight to the scheduler) refuse the same bad value with the
same message."""

import asyncio

import httpx
import pytest

from router.app import RouterConfig, build_state, create_app
from router.client import InProcessClient
from router.offline import run_scheduled
from tests.conftest import warmed_llama_shard
from tests.helpers import build_request

PROMPT = "The quick brown fox jumps over the lazy dog."
LONG_PROMPT = "word " * 150  # more tokens than max_input_tokens (128)
MAX_TOTAL = 256


@pytest.fixture(scope="module")
def shard(tiny_model_dirs):
    return warmed_llama_shard(tiny_model_dirs)


def http_refusal(shard, model_dir, prompt: str, max_new_tokens: int) -> tuple[int, str]:
    """The status and error message of `/generate` on a router over `shard`."""
    config = RouterConfig(
        tokenizer=str(model_dir),
        max_input_tokens=128,
        max_total_tokens=MAX_TOTAL,
        max_prefill_tokens=512,
        max_batch_size=4,
    )
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}

    async def main():
        state = await build_state(config, InProcessClient(shard, max_batch_size=4))
        try:
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
                return await http.post("/generate", json=body)
        finally:
            await state.scheduler.stop()
            state.executor.shutdown()

    response = asyncio.run(main())
    return response.status_code, response.json()["error"]


def offline_refusal(shard, prompt: str, max_new_tokens: int) -> str:
    length = len(shard.tokenizer(prompt)["input_ids"])
    request = build_request(0, max_new_tokens, prompt)
    with pytest.raises(ValueError) as refused:
        run_scheduled(shard, [request], [length], capacity_tokens=64 * shard.block_size)
    return str(refused.value)


@pytest.mark.parametrize(
    "prompt, max_new_tokens, message",
    [
        (PROMPT, 0, "`max_new_tokens` must be strictly positive"),
        (PROMPT, MAX_TOTAL, f"`inputs` tokens + `max_new_tokens` must be <= {MAX_TOTAL}. Given: "),
        (LONG_PROMPT, 4, "`inputs` tokens must be <= 128. Given: "),
    ],
)
def test_http_and_offline_refuse_a_bad_length_with_one_message(
    shard, tiny_model_dirs, prompt, max_new_tokens, message
):
    status, over_http = http_refusal(shard, tiny_model_dirs["llama"], prompt, max_new_tokens)
    offline = offline_refusal(shard, prompt, max_new_tokens)
    assert status == 422
    assert over_http == offline
    assert offline.startswith(message)
