"""A shard killed mid-generation under --restart-on-failure loses no request: the tiny Llama (the
embedded model's tokenizer) on two shards, 8 greedy requests of 40 tokens in flight, half of them
streamed. After the restart the router re-prefills each request's prompt and the tokens it had
generated; every answer is 200 with transformers' tokens, and no stream repeats or skips a token.
(The embedded model on one shard ran the same checks in 42 s of the suite's 20-minute budget;
nothing in a restart depends on which weights the shards hold.)"""

import json
import threading
import time

import httpx
import pytest

from tests.test_equivalence import PROMPTS, reference_tokens
from tests.test_launcher import STARTUP_S, Launch, engine_processes_of, kill_shard  # noqa: F401
from tests.test_launcher_router import wait_served
from tests.test_server import short_socket_dir

pytestmark = pytest.mark.slow  # end to end: launched shards and routers, one killed

NEW_TOKENS = 40  # 10 or more before the kill, the rest after the restart
REQUESTS = (PROMPTS + ["The three primary colors are", "A good breakfast has"])[:8]
LIMITS = [
    "--device",
    "cpu",
    "--restart-on-failure",
    "--hostname",
    "127.0.0.1",
    "--max-input-tokens",
    "160",
    "--max-total-tokens",
    "192",
    "--max-batch-prefill-tokens",
    "512",
    "--max-batch-size",
    "8",
    "--dtype",
    "float32",
]


class Answer:
    """One request on its own thread: its tokens as they arrive (streamed) or at the end."""

    def __init__(self, url: str, prompt: str, stream: bool):
        self.url, self.prompt, self.stream = url, prompt, stream
        self.tokens, self.indices, self.status, self.done_at = [], [], None, None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {
            "inputs": self.prompt,
            "parameters": {"max_new_tokens": NEW_TOKENS, "details": True},
        }
        if self.stream:
            with httpx.stream(
                "POST", f"{self.url}/generate_stream", json=body, timeout=900
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        event = json.loads(line[len("data:") :])
                        assert "error" not in event, event
                        self.indices.append(event["index"])
                        self.tokens.append(event["token"]["id"])
        else:
            response = httpx.post(f"{self.url}/generate", json=body, timeout=900)
            self.status = response.status_code
            if response.status_code == 200:
                self.tokens = [t["id"] for t in response.json()["details"]["tokens"]]
        self.done_at = time.monotonic()


def test_requests_in_flight_survive_a_shard_kill_on_the_tiny_llama(tiny_model_dirs, capsys):
    kill_mid_generation(tiny_model_dirs["llama"], 2, capsys)


def kill_mid_generation(model_dir, num_shard: int, capsys) -> None:
    expected = reference_tokens(model_dir, REQUESTS, NEW_TOKENS, stop_on_eos=True)
    folder = short_socket_dir()
    launch = Launch(
        model_dir,
        *LIMITS,
        "--num-shard",
        str(num_shard),
        "--uds-path",
        f"{folder}/s",
        folder=folder,
    )
    try:
        url = wait_served(launch)
        launch.shard_pids |= {p.pid for p in engine_processes_of(f"{folder}/s")}
        answers = [Answer(url, prompt, stream=i % 2 == 0) for i, prompt in enumerate(REQUESTS)]
        streamed = [a for a in answers if a.stream]
        deadline = time.monotonic() + STARTUP_S
        while min(len(a.tokens) for a in streamed) < 10:  # all in flight: each stream has tokens
            assert time.monotonic() < deadline, "the requests never got going"
            time.sleep(0.05)
        killed_at, before = time.monotonic(), [len(a.tokens) for a in streamed]
        kill_shard(launch, f"{folder}/s", num_shard - 1)
        for answer in answers:
            answer.thread.join(timeout=STARTUP_S * 2)
        launch.shard_pids |= {p.pid for p in engine_processes_of(f"{folder}/s")}
        assert [a.status for a in answers] == [200] * len(answers), launch.stderr()[-3000:]
        assert [a.tokens for a in answers] == expected
        for answer in streamed:  # no token twice, none missing
            assert answer.indices == list(range(1, len(answer.tokens) + 1))
        assert f"restarting all {num_shard} shard(s)" in launch.stderr()
        assert "to resume" in launch.stderr()
        with capsys.disabled():
            print(
                f"\nshard kill ({num_shard} shards): streams had {before} tokens at the kill; "
                f"last answer {max(a.done_at for a in answers) - killed_at:.1f}s after the kill"
            )
    finally:
        launch.clean_up()
