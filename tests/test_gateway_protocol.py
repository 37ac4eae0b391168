"""The inference gateways' model-server protocol on a launched tiny Llama: the vllm:* gauges under
load against the scheduler's own state, and the drain on SIGTERM during 16 streamed requests."""

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_equivalence import PROMPTS
from tests.test_launcher import launched  # noqa: F401 - launcher processes, cleaned up after the test
from tests.test_launcher_router import wait_served
from tests.test_lora import lora_dirs  # noqa: F401 - adapters made with peft
from tests.test_server import short_socket_dir

pytestmark = pytest.mark.slow  # end to end: a launched shard and router

GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")


def scrape(url: str) -> tuple[dict, dict]:
    """{sample name: [(labels, value)]} and {family name: type}."""
    samples, types = {}, {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        types[family.name] = family.type
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples, types


def value(samples: dict, name: str) -> float:
    return samples[name][0][1]


def generate(url: str, i: int, adapter: str | None, tokens: int = 40) -> int:
    parameters = {"max_new_tokens": tokens, "adapter_id": adapter}
    body = {"inputs": PROMPTS[i % len(PROMPTS)], "parameters": parameters}
    return httpx.post(f"{url}/generate", json=body, timeout=300).status_code


def test_the_gauges_follow_the_scheduler_under_load(launched, lora_dirs):  # noqa: F811
    folder = short_socket_dir()
    spec = ",".join(f"{name}={path}" for name, path in lora_dirs.items())
    launch = launched(
        "--device", "cpu", "--hostname", "127.0.0.1", "--uds-path", f"{folder}/s",
        "--lora-adapters", spec, "--max-batch-size", "2",
    )  # fmt: skip
    url = wait_served(launch)
    samples, types = scrape(url)
    assert all(types[name] == "gauge" for name in (*GAUGES, "vllm:lora_requests_info"))
    assert [value(samples, name) for name in GAUGES] == [0, 0, 0]
    (config,) = samples["vllm:cache_config_info"]
    info = httpx.get(f"{url}/info", timeout=10).json()
    assert config[0]["block_size"] == str(info["block_size"]) and config[1] == 1
    seen = []
    adapters = ["alpha", "beta", "alpha", "beta", None, "beta"]
    with ThreadPoolExecutor(len(adapters)) as pool:
        futures = [pool.submit(generate, url, i, a) for i, a in enumerate(adapters)]
        while not all(f.done() for f in futures):
            seen.append(scrape(url)[0])
            time.sleep(0.05)
        assert [f.result() for f in futures] == [200] * len(adapters)
    loaded = [s for s in seen if value(s, "vllm:num_requests_waiting") > 0]
    assert loaded, "no scrape saw a queue"
    for s in seen:  # one scrape reads the scheduler once: the families agree
        assert value(s, "vllm:num_requests_waiting") == value(s, "bucketserve_queue_size")
        assert value(s, "vllm:num_requests_running") == value(s, "bucketserve_running_requests")
        assert value(s, "vllm:num_requests_running") <= 2
        used, total = (
            value(s, "bucketserve_kv_blocks_in_use"),
            value(s, "bucketserve_kv_blocks_total"),
        )
        assert value(s, "vllm:kv_cache_usage_perc") == pytest.approx(used / total)
        (lora,) = s["vllm:lora_requests_info"]
        assert lora[0]["max_lora"] == "2"
        for key in ("running_lora_adapters", "waiting_lora_adapters"):
            assert set(filter(None, lora[0][key].split(","))) <= {"alpha", "beta"}
    busy = [s for s in loaded if value(s, "vllm:num_requests_running") == 2]
    assert any(s["vllm:lora_requests_info"][0][0]["waiting_lora_adapters"] for s in busy)
    assert any(s["vllm:lora_requests_info"][0][0]["running_lora_adapters"] for s in busy)
    assert any(value(s, "vllm:kv_cache_usage_perc") > 0 for s in busy)
    assert [value(scrape(url)[0], name) for name in GAUGES] == [0, 0, 0]


def stream(url: str, i: int, events: list, admitted: list, new_tokens: int = 30) -> None:
    parameters = {"max_new_tokens": new_tokens, "ignore_eos": True}
    body = {"inputs": PROMPTS[i % len(PROMPTS)], "parameters": parameters}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=300) as response:
        admitted.append(i)  # its headers came: the router queued it
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    events.append((response.status_code, lines[-1] if lines else ""))


def test_sigterm_drains_the_streams_refuses_new_ones_and_exits_0(launched):  # noqa: F811
    folder = short_socket_dir()
    launch = launched(
        "--device", "cpu", "--hostname", "127.0.0.1", "--uds-path", f"{folder}/s",
        "--drain-timeout", "120", "--max-total-tokens", "512", "--max-batch-size", "4",
    )  # fmt: skip
    url = wait_served(launch)
    done, admitted = [], []
    # The streams outlast the checks after the SIGTERM: once every stream is done the server
    # exits. A fast machine finished 16 streams of 30 tokens before the check of /live, and a
    # fresh-clone CI run one of 440 beside them; here 16 of 440 run four at a time, four waves.
    threads = [
        threading.Thread(target=stream, args=(url, i, done, admitted, 440)) for i in range(16)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    # All 16 admitted before the SIGTERM: one sent after it would rightly be refused.
    while len(admitted) < 16:
        assert time.monotonic() < deadline, f"{len(admitted)} of 16 streams started"
        time.sleep(0.01)
    launch.process.send_signal(signal.SIGTERM)
    refused = None
    while refused is None or refused.status_code != 503:
        assert time.monotonic() < deadline + 60, "new requests were never refused"
        refused = httpx.post(f"{url}/generate", json={"inputs": "Hi"}, timeout=30)
    assert refused.headers["retry-after"] == "1"
    assert "draining" in refused.json()["error"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    assert httpx.get(f"{url}/live", timeout=10).status_code == 200
    for thread in threads:
        thread.join(timeout=240)
    assert len(done) == 16
    finals = [json.loads(last.removeprefix("data:")) for _, last in done]
    assert [status for status, _ in done] == [200] * 16
    assert all(final.get("generated_text") is not None for final in finals), finals
    assert launch.wait(timeout=60) == 0
    assert "drained: stopping" in launch.out.read_text() + launch.stderr()
