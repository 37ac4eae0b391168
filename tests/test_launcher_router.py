"""The launcher as a user runs it by default: shards and the HTTP router together, on the embedded
model and on the tiny Llama; the router rides out a shard restart."""

import re
import time

import httpx
import openai
import pytest
from text_generation import Client
from transformers import AutoTokenizer

from tests.test_equivalence import reference_tokens
from tests.test_launcher import STARTUP_S, Launch, engine_processes_of, kill_shard, launched  # noqa: F401
from tests.test_server import short_socket_dir

pytestmark = pytest.mark.slow  # end to end: launched shards and routers

SERVES = re.compile(r"the router serves (http://\S+) ")
ROUTER_STARTUP_S = 300  # the router warms the shards up before it answers


def wait_served(launch: Launch) -> str:
    deadline = time.monotonic() + ROUTER_STARTUP_S
    while time.monotonic() < deadline:
        found = SERVES.search(launch.out.read_text())
        if found:
            return found.group(1)
        if launch.process.poll() is not None:
            pytest.fail(f"the launcher exited with {launch.process.returncode}:\n{launch.stderr()}")
        time.sleep(0.2)
    pytest.fail(f"no router after {ROUTER_STARTUP_S}s:\n{launch.stderr()}")


def health(url: str) -> int:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def wait_health(url: str, status: int, timeout: float = STARTUP_S) -> None:
    deadline = time.monotonic() + timeout
    while health(url) != status:
        assert time.monotonic() < deadline, f"/health never answered {status}"
        time.sleep(0.1)


def test_embedded_model_behind_the_launched_router(smollm_dir, tmp_path):
    folder = short_socket_dir()
    launch = Launch(
        smollm_dir,
        "--device",
        "cpu",
        "--hostname",
        "127.0.0.1",
        "--uds-path",
        f"{folder}/s",
        folder=folder,
    )
    try:
        url = wait_served(launch)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        chat = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = chat.chat.completions.create(
            model="tgi", messages=question, max_tokens=20, temperature=0
        )
        tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
        prompt = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
        expected = reference_tokens(
            smollm_dir, [prompt], 20, add_special_tokens=False, stop_on_eos=True
        )[0]
        assert answer.choices[0].message.content == tokenizer.decode(
            expected, skip_special_tokens=True
        )
        assert "Paris" in answer.choices[0].message.content
        chunks = chat.chat.completions.create(
            model="tgi", messages=question, max_tokens=20, temperature=0, stream=True
        )
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks)
            == answer.choices[0].message.content
        )
        tgi = Client(url, timeout=120)
        whole = tgi.generate("The capital of France is", max_new_tokens=5)
        streamed = list(tgi.generate_stream("The capital of France is", max_new_tokens=5))
        assert [r.token.id for r in streamed] == [t.id for t in whole.details.tokens]
        assert streamed[-1].generated_text == whole.generated_text
    finally:
        launch.clean_up()


def test_router_holds_requests_through_a_shard_restart(launched):
    folder = short_socket_dir()
    launch = launched(
        "--num-shard",
        "2",
        "--device",
        "cpu",
        "--restart-on-failure",
        "--hostname",
        "127.0.0.1",
        "--uds-path",
        f"{folder}/s",
    )
    url = wait_served(launch)
    body = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 6, "details": True}}
    before = httpx.post(f"{url}/generate", json=body, timeout=60).json()
    launch.shard_pids |= {p.pid for p in engine_processes_of(f"{folder}/s")}
    kill_shard(launch, f"{folder}/s", 1)
    # The router learns of the outage from this request's prefill; the request waits for the restart.
    held = httpx.post(f"{url}/generate", json=body, timeout=STARTUP_S)
    assert held.status_code == 200, held.text
    assert held.json()["details"]["tokens"] == before["details"]["tokens"]
    assert "restarting all 2 shard(s)" in launch.stderr()
    assert "holding 1 new request(s)" in launch.stderr()  # the router's own account of it
    wait_health(url, 200)
    launch.shard_pids |= {p.pid for p in engine_processes_of(f"{folder}/s")}
