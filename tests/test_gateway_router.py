"""Behind vLLM's router: two launched replicas of the tiny Llama behind `vllm-router` (the Rust binary
from PyPI) answer 64 concurrent requests in groups that share long prefixes under cache_aware,
kv_aware (fed by our KV events: the proof that they are in vLLM's format), power_of_two and
round_robin, and one replica killed under load leaves every request answered.

vllm-router lives in its own environment (`make` puts it in .venv/vllm-router; it pins its own
web stack); $BUCKETSERVE_VLLM_ROUTER names another binary.
"""

import os
import random
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tests.test_launcher import launched  # noqa: F401 - launcher processes, cleaned up after the test
from tests.test_launcher_router import wait_served
from tests.test_server import free_tcp_port, short_socket_dir

pytestmark = pytest.mark.slow  # end to end: two launched replicas and a router process

REPO = Path(__file__).resolve().parents[1]
BLOCK = 16  # the launcher's --block-size in tests/test_launcher.py LIMITS
# 16 prefixes of 4 prompts: one prompt of each group is served first (what a replica holds is then
# known to every policy, by the router's own record or by KV events), then the other 48 in a burst;
# a prefix-aware policy sends all 48 where their prefix is, round_robin half of them elsewhere
GROUPS, PER_GROUP = 16, 4  # 64 requests
PREFIX_TOKENS, TAIL_TOKENS, NEW_TOKENS = 48, 4, 2  # within --max-input-tokens 64


def router_binary() -> str:
    found = (
        os.environ.get("BUCKETSERVE_VLLM_ROUTER")
        or shutil.which("vllm-router", path=str(REPO / ".venv" / "vllm-router" / "bin"))
        or shutil.which("vllm-router")
    )
    if not found:
        pytest.skip(
            "vllm-router is not installed: `python -m venv .venv/vllm-router && "
            ".venv/vllm-router/bin/pip install vllm-router==0.1.17` (make does it)"
        )
    return found


class Replica:
    def __init__(self, launch, url: str, events: str):
        self.launch, self.url, self.events = launch, url, events

    def metric(self, name: str) -> float:
        for sample in samples(f"{self.url}/metrics", name):
            return sample.value
        raise AssertionError(f"{name} not in /metrics")


def samples(url: str, name: str):
    """The samples called `name` that a Prometheus endpoint serves."""
    text = httpx.get(url, timeout=10).text
    for family in text_string_to_metric_families(text):
        yield from (sample for sample in family.samples if sample.name == name)


@pytest.fixture
def replicas(launched):  # noqa: F811
    started = []
    for _ in range(2):
        folder, events = short_socket_dir(), free_tcp_port()
        launch = launched(
            "--device",
            "cpu",
            "--hostname",
            "127.0.0.1",
            "--uds-path",
            f"{folder}/s",
            "--kv-events-endpoint",
            f"tcp://*:{events}",
            # room to admit a burst at once, as a serving replica would: the blocks a request
            # will compute are announced when it is admitted (router/sched/prefix_cache.py)
            "--max-batch-size",
            "32",
            "--max-batch-prefill-tokens",
            "512",
        )
        started.append((launch, events))
    return [Replica(launch, wait_served(launch), f"tcp://127.0.0.1:{e}") for launch, e in started]


class Router:
    """A vllm-router process over the replicas, answering on `url` once its workers are healthy."""

    def __init__(self, replicas, policy: str, model_dir, log: Path):
        self.url = f"http://127.0.0.1:{free_tcp_port()}"
        self.metrics_url = f"http://127.0.0.1:{free_tcp_port()}/metrics"
        command = [
            router_binary(),
            "--host",
            "127.0.0.1",
            "--port",
            self.url.rsplit(":", 1)[1],
            "--prometheus-port",
            self.metrics_url.rsplit(":", 1)[1].split("/")[0],
            "--policy",
            policy,
            "--worker-urls",
            *[r.url for r in replicas],
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "1",
            "--worker-startup-check-interval",
            "1",
            "--retry-max-retries",
            "5",
            "--retry-initial-backoff-ms",
            "200",
            # A replica that refused a request is skipped at once: retries go to the others even
            # before the next health check has marked it down (docs/scaling.md).
            "--cb-failure-threshold",
            "1",
        ]
        if policy == "kv_aware":
            for replica in replicas:
                command += ["--kv-event-source", f"{replica.url}={replica.events}"]
            command += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", str(model_dir)]
        env = {**os.environ, "VLLM_ROUTER_TOKENIZER": str(model_dir), "RUST_LOG": "warn"}
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while not self._answers():
            assert self.process.poll() is None, f"vllm-router exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"vllm-router never answered:\n{log.read_text()}"
            time.sleep(0.2)

    def kv_lookups_found(self) -> float:
        """The KV-aware lookups that found some of a prompt's blocks in the router's index."""
        lookups = samples(self.metrics_url, "vllm_router_kv_placement_lookups_total")
        return sum(sample.value for sample in lookups if sample.labels.get("result") != "miss")

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        """Its whole process group (the Python launcher and the Rust router it starts)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def workload_groups(model_dir, seed: int = 0) -> list[list[list[int]]]:
    """GROUPS long prefixes, PER_GROUP prompts each: token ids from the model's own tokenizer
    (kv_aware reads ids; the others route on them too)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3][:4000]
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    groups = []
    for _ in range(GROUPS):
        prefix = tokenizer(text(PREFIX_TOKENS), add_special_tokens=False)["input_ids"]
        prefix = prefix[:PREFIX_TOKENS]
        tails = [
            tokenizer(" " + text(TAIL_TOKENS), add_special_tokens=False)["input_ids"]
            for _ in range(PER_GROUP)
        ]
        groups.append([prefix + tail[:TAIL_TOKENS] for tail in tails])
    return groups


def workload(model_dir, seed: int = 0) -> list[list[int]]:
    """The groups' prompts, shuffled."""
    prompts = [prompt for group in workload_groups(model_dir, seed) for prompt in group]
    random.Random(seed).shuffle(prompts)
    return prompts


def send_all(url: str, prompts: list[list[int]], policy: str) -> None:
    """All of `prompts` at once; every one answered."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        statuses = list(pool.map(lambda p: complete(url, p), prompts))
    assert statuses == [200] * len(prompts), (policy, statuses)


def complete(url: str, prompt: list[int]) -> int:
    body = {"model": "tgi", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    if response.status_code != 200:
        print(f"{response.status_code}: {response.text[:300]}")
    return response.status_code


def hit_rate(replicas, before: dict) -> float:
    """Prompt tokens found in the replicas' prefix caches, as a share of those looked up."""
    hits = sum(r.metric("bucketserve_prefix_cache_hit_tokens_total") for r in replicas)
    tokens = sum(r.metric("bucketserve_prefix_cache_prompt_tokens_total") for r in replicas)
    return (hits - before["hits"]) / (tokens - before["tokens"])


def counters(replicas) -> dict:
    return {
        "hits": sum(r.metric("bucketserve_prefix_cache_hit_tokens_total") for r in replicas),
        "tokens": sum(r.metric("bucketserve_prefix_cache_prompt_tokens_total") for r in replicas),
    }


def wait_for_kv_events(router: Router) -> None:
    """vllm-router subscribes to the replicas' KV events after it first answers, and ZMQ drops what
    a publisher sends before a subscriber has joined: in CI a whole run's events were lost once,
    and kv_aware's hit rate was round_robin's. So a probe prompt is served twice until the second
    lookup finds the first's blocks, each try with a fresh probe (consecutive ids: no workload prompt
    holds its blocks)."""
    deadline = time.monotonic() + 60
    for attempt in range(150):  # ids stay below the vocabulary (49152)
        probe = [40000 + attempt * PREFIX_TOKENS + i for i in range(PREFIX_TOKENS)]
        assert complete(router.url, probe) == 200
        found = router.kv_lookups_found()
        assert complete(router.url, probe) == 200
        if router.kv_lookups_found() > found:
            return
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    raise AssertionError("vllm-router never read the replicas' KV events")


def run_policy(replicas, policy: str, model_dir, tmp_path, groups) -> float:
    """The hit rate of the groups' prompts: each group's first, then the rest in one burst. Routed
    all in one burst, kv_aware met most requests before any event of their prefix (requests are
    routed in milliseconds, a prefill takes longer) and its rate was round_robin's, within noise."""
    router = Router(replicas, policy, model_dir, tmp_path / f"{policy}.log")
    try:
        if policy == "kv_aware":
            wait_for_kv_events(router)  # its probes' hits come before the counters are read
        before = counters(replicas)
        send_all(router.url, [group[0] for group in groups], policy)
        rest = [prompt for group in groups for prompt in group[1:]]
        random.Random(0).shuffle(rest)
        send_all(router.url, rest, policy)
        return hit_rate(replicas, before)
    finally:
        router.stop()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_four_policies_answer_all_and_the_prefix_aware_ones_hit_more(
    replicas, smollm_dir, tmp_path
):
    """Each policy gets its own prefixes (a fresh workload), so no run profits from another's."""
    rates = {}
    for seed, policy in enumerate(("round_robin", "power_of_two", "cache_aware", "kv_aware")):
        rates[policy] = run_policy(
            replicas, policy, smollm_dir, tmp_path, workload_groups(smollm_dir, seed)
        )
    print(f"prefix hit rates (share of prompt tokens): {rates}")
    assert rates["cache_aware"] > rates["round_robin"], rates
    assert rates["kv_aware"] > rates["round_robin"], rates


def test_a_replica_killed_under_load_leaves_every_request_answered(replicas, smollm_dir, tmp_path):
    router = Router(replicas, "cache_aware", smollm_dir, tmp_path / "kill.log")
    victim = replicas[1].launch
    family = [victim.process.pid] + [
        c.pid for c in psutil.Process(victim.process.pid).children(True)
    ]
    try:
        prompts = workload(smollm_dir, seed=9)
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(complete, router.url, p) for p in prompts]
            time.sleep(1.0)  # under load: requests are queued and running on both replicas
            victim.process.send_signal(signal.SIGKILL)
            statuses = [f.result() for f in futures]
        assert statuses == [200] * len(prompts), statuses
        assert complete(router.url, prompts[0]) == 200  # routed around the dead replica
    finally:
        router.stop()
    deadline = time.monotonic() + 15  # the killed launcher's shard and router notice and stop
    while any(alive(pid) for pid in family):
        assert time.monotonic() < deadline, "a process of the killed replica is left behind"
        time.sleep(0.2)
