"""LoRA end to end: the launcher serves two PEFT adapters on the tiny Llama, and HTTP requests naming
different adapters at the same moment each get their own adapter's tokens."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.test_equivalence import PROMPTS
from tests.test_launcher import launched  # noqa: F401 - launcher processes, cleaned up after the test
from tests.test_launcher_router import wait_served
from tests.test_lora import lora_dirs, lora_expected  # noqa: F401 - adapters made with peft, and references
from tests.test_server import short_socket_dir

pytestmark = pytest.mark.slow  # end to end: a launched shard and router

NEW_TOKENS = 12
EOS = 2


def generate(url: str, i: int, adapter: str | None) -> list[int]:
    parameters = {"max_new_tokens": NEW_TOKENS, "details": True, "adapter_id": adapter}
    response = httpx.post(
        f"{url}/generate", json={"inputs": PROMPTS[i], "parameters": parameters}, timeout=120
    )
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def matches(tokens: list[int], reference: list[int]) -> bool:
    """The reference ignores EOS; a served request stops at it."""
    return tokens == reference[: len(tokens)] and (len(tokens) == NEW_TOKENS or tokens[-1] == EOS)


def test_requests_naming_different_adapters_at_once_get_their_own(
    launched, lora_dirs, lora_expected
):  # noqa: F811
    folder = short_socket_dir()
    spec = ",".join(f"{name}={path}" for name, path in lora_dirs.items())
    launch = launched(
        "--device",
        "cpu",
        "--hostname",
        "127.0.0.1",
        "--uds-path",
        f"{folder}/s",
        "--lora-adapters",
        spec,
    )
    url = wait_served(launch)
    cases = [(1, "alpha"), (1, "beta"), (2, "beta"), (2, None), (3, "alpha"), (3, "")]
    with ThreadPoolExecutor(len(cases)) as pool:
        outputs = list(pool.map(lambda case: generate(url, *case), cases))
    for (i, adapter), tokens in zip(cases, outputs):
        assert matches(tokens, lora_expected[(i, adapter or None)]), (i, adapter)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data][1:] == ["alpha", "beta"]
    completion = client.completions.create(
        model="beta", prompt=PROMPTS[2], max_tokens=NEW_TOKENS, temperature=0, logprobs=0
    )
    assert completion.usage.completion_tokens >= 1
    beta_text = httpx.post(
        f"{url}/generate",
        json={
            "inputs": PROMPTS[2],
            "parameters": {"max_new_tokens": NEW_TOKENS, "adapter_id": "beta"},
        },
        timeout=120,
    ).json()["generated_text"]
    assert completion.choices[0].text == beta_text
    assert httpx.get(f"{url}/info", timeout=30).json()["lora_adapters"] == ["alpha", "beta"]
    unknown = httpx.post(
        f"{url}/generate", json={"inputs": "Hi", "parameters": {"adapter_id": "gamma"}}, timeout=30
    )
    assert unknown.status_code == 422 and "loaded adapters: alpha, beta" in unknown.json()["error"]
