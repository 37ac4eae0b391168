"""Several nodes, pipeline stages: the stage split and the launcher's place in a group (fast), and
two launchers on loopback with gloo as two nodes, through the HTTP API (slow)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from engine.models.config import ModelConfig
from engine.pipeline.grid import place
from engine.pipeline.split import StageWeights, layer_ranges, split_for_stage
from launcher.checks import ConfigError
from launcher.cli import main as launcher_main
from launcher.cluster import resolve_cluster
from launcher.config import LauncherConfig
from tests.helpers import PROMPTS, reference_tokens
from tests.models import build_tiny_model
from tests.test_launcher import LIMITS, REPO, engine_processes_of
from tests.test_server import free_tcp_port, short_socket_dir

SECRET = "test-group-secret"
NEW_TOKENS = 4
STARTUP_S = 300  # several processes load a model each, on 2 cores
PEER_EXIT_S = 15  # a node whose peer died exits within this


# --- the stage split --------------------------------------------------------------------------


def test_layers_split_into_consecutive_stages_the_first_ones_taking_the_remainder():
    assert layer_ranges(3, 2) == [range(0, 2), range(2, 3)]
    assert layer_ranges(30, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    with pytest.raises(ValueError, match="--pipeline-parallel-size 4 is larger than .* 3 layers"):
        layer_ranges(3, 4)


def test_a_stage_reads_its_own_layers_under_local_names_and_only_its_ends():
    first, last = (
        StageWeights(range(0, 2), True, False, True),
        StageWeights(range(2, 3), False, True, True),
    )
    assert first.local_name("layers.1.mlp.down_proj.weight") == "layers.1.mlp.down_proj.weight"
    assert first.local_name("layers.2.mlp.down_proj.weight") is None
    assert last.local_name("layers.2.self_attn.q_proj.weight") == "layers.0.self_attn.q_proj.weight"
    assert first.local_name("embed_tokens.weight") == "embed_tokens.weight"
    assert first.local_name("norm.weight") is None and first.local_name("lm_head.weight") is None
    # tied: the last stage's LM head is the embedding, which it then reads
    assert last.local_name("embed_tokens.weight") == "embed_tokens.weight"
    assert StageWeights(range(2, 3), False, True, False).local_name("embed_tokens.weight") is None


def test_a_stage_config_slices_the_per_layer_fields():
    config = ModelConfig(
        "Gemma3ForCausalLM", 10, 8, 16, 3, 2, 2, 4, 1e-6, 64, False, False, False, False,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    )  # fmt: skip
    stage, weights = split_for_stage(config, 1, 2)
    assert stage.num_layers == 1 and stage.layer_types == ("full_attention",)
    assert weights.layers == range(2, 3) and weights.last and not weights.first


def test_ranks_form_tensor_parallel_groups_within_a_stage():
    parallel, pipe = place(4, 6, 2)  # TP=3 x PP=2: rank 4 is TP rank 1 of stage 1
    assert (parallel.rank, parallel.world_size, pipe.stage) == (1, 3, 1)
    assert (pipe.previous_rank, pipe.last_rank) == (1, 4)
    assert place(1, 6, 2)[1].next_rank == 4
    with pytest.raises(ValueError, match="world size 3 is not a multiple of"):
        place(0, 3, 2)


# --- a node's place in the group -------------------------------------------------------------------


def with_secret(**fields) -> LauncherConfig:
    return LauncherConfig(shard_secret=SECRET, **fields)


def test_a_node_takes_its_place_from_leaderworkerset_then_torchrun_variables():
    lws = {"LWS_LEADER_ADDRESS": "leader.svc", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    config = resolve_cluster(with_secret(), lws)
    assert (config.nnodes, config.node_rank, config.master_addr) == (2, 1, "leader.svc")
    assert config.master_port == 29500 and config.no_router  # node 1 is headless
    torchrun = {**lws, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "NNODES": "3"}
    config = resolve_cluster(with_secret(node_rank=0), torchrun)
    assert (config.nnodes, config.node_rank, config.master_addr) == (3, 0, "10.0.0.1")
    assert config.master_port == 1234 and not config.no_router
    # one node: the environment's rendezvous is not ours (a free port on loopback, as before)
    alone = resolve_cluster(LauncherConfig(), {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1"})
    assert (alone.nnodes, alone.master_addr, alone.master_port) == (1, "127.0.0.1", None)


def test_several_nodes_need_a_shard_secret():
    with pytest.raises(ConfigError, match="BUCKETSERVE_SHARD_SECRET"):
        resolve_cluster(LauncherConfig(nnodes=2), {})


@pytest.fixture
def pytest_signals():
    """launcher.cli.main installs its SIGTERM/SIGINT handlers: give pytest its own back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nnodes", "2", "--node-rank", "2"], r"--node-rank 2 must be in 0\.\.1 \(--nnodes 2\)"),
        (
            ["--nnodes", "2", "--num-shard", "3"],
            r"6 tensor-parallel ranks per stage \(--num-shard 3 x --nnodes 2 / "
            r"--pipeline-parallel-size 1\) cannot split the model in \S+: "
            r"num_attention_heads=4 is not divisible by 6",
        ),
        (
            ["--nnodes", "3", "--pipeline-parallel-size", "2"],
            r"the world size 3 is not a multiple of --pipeline-parallel-size 2",
        ),
        (
            ["--num-shard", "3", "--pipeline-parallel-size", "3"],
            r"--pipeline-parallel-size 3 is larger than the 2 layers of the model in \S+",
        ),
    ],
    ids=["node-rank", "heads", "stages", "layers"],
)
def test_bad_groups_are_refused_in_one_line(
    tiny_model_dirs, monkeypatch, capsys, pytest_signals, flags, message
):
    monkeypatch.setenv("BUCKETSERVE_SHARD_SECRET", SECRET)
    ports = ["--port", str(free_tcp_port()), "--master-port", str(free_tcp_port())]
    argv = ["--model-id", str(tiny_model_dirs["llama"]), "--device", "cpu", *ports, *flags]
    code = launcher_main(argv)
    err = capsys.readouterr().err
    assert code == 2 and re.fullmatch(f"error: {message}\n", err), err


# --- two nodes on loopback ---------------------------------------------------------------------------


class Node:
    """One node's `python -m launcher`, its output in files."""

    def __init__(self, rank: int, model_dir, master_port: int, *flags, http_port=None):
        self.folder = short_socket_dir()
        self.base = f"{self.folder}/s"
        self.out, self.err = self.folder / "out", self.folder / "err"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env["BUCKETSERVE_SHARD_SECRET"] = SECRET
        command = [sys.executable, "-m", "launcher", "--model-id", str(model_dir), *LIMITS]
        command += ["--device", "cpu", "--uds-path", self.base, "--nnodes", "2"]
        command += ["--node-rank", str(rank), "--master-addr", "127.0.0.1"]
        command += ["--master-port", str(master_port), *flags]
        if http_port is not None:
            command += ["--port", str(http_port), "--hostname", "127.0.0.1"]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err)
        self.shard_pids: set[int] = set()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while "ready:" not in self.out.read_text():
            if self.process.poll() is not None:
                pytest.fail(f"the launcher exited with {self.process.returncode}:\n{self.stderr()}")
            assert time.monotonic() < deadline, f"not ready after {STARTUP_S}s:\n{self.stderr()}"
            time.sleep(0.3)
        shards = [p for p in engine_processes_of(self.base) if "serve" in p.cmdline()]
        self.shard_pids |= {p.pid for p in shards}

    def stderr(self) -> str:
        return self.err.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for process in engine_processes_of(self.base):
            process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

    def left_behind(self) -> list[int]:
        alive = [p for p in self.shard_pids if psutil.pid_exists(p)]
        alive = [p for p in alive if psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        return alive + [p.pid for p in engine_processes_of(self.base)]


def start_two_nodes(model_dir, *flags, node1_model=None):
    master, http = free_tcp_port(), free_tcp_port()
    leader = Node(0, model_dir, master, *flags, http_port=http)
    worker = Node(1, node1_model or model_dir, master, *flags)
    return leader, worker, f"http://127.0.0.1:{http}"


def generated_tokens(url: str, prompts: list[str]) -> list[list[int]]:
    def one(prompt):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
        answer = httpx.post(f"{url}/generate", json=body, timeout=STARTUP_S)
        assert answer.status_code == 200, answer.text
        return [t["id"] for t in answer.json()["details"]["tokens"]]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: batched together
        return list(pool.map(one, prompts))


@pytest.fixture(scope="module")
def three_layer_model(tmp_path_factory, smollm_dir):
    """Three layers over two stages: an uneven split (2 + 1)."""
    root = tmp_path_factory.mktemp("three")
    return build_tiny_model("llama", root / "llama", smollm_dir, num_hidden_layers=3)


@pytest.mark.slow
def test_two_nodes_pipeline_stages_give_transformers_tokens_and_a_lost_node_ends_the_other(
    three_layer_model,
):
    leader, worker, url = start_two_nodes(
        three_layer_model, "--num-shard", "1", "--pipeline-parallel-size", "2"
    )
    try:
        leader.wait_ready()
        worker.wait_ready()
        assert "headless" in worker.out.read_text()
        expected = reference_tokens(three_layer_model, PROMPTS, NEW_TOKENS)
        assert generated_tokens(url, PROMPTS) == expected
        worker.process.kill()  # the node-1 launcher, SIGKILL: its shard stops by itself
        start = time.monotonic()
        code = leader.process.wait(timeout=PEER_EXIT_S + 30)
        took = time.monotonic() - start
        assert code != 0 and took < PEER_EXIT_S, (code, took, leader.stderr())
        assert re.search(r"error: rank 1 of another node \S+ has refused", leader.stderr())
        deadline = time.monotonic() + 5  # the worker's shard notices its launcher is gone
        while (leader.left_behind() or worker.left_behind()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not leader.left_behind() and not worker.left_behind()
    finally:
        leader.stop()
        worker.stop()


@pytest.mark.slow
def test_embedded_model_on_two_nodes_of_three_shards_pipeline_times_tensor_parallel(smollm_dir):
    """PP=2 x TP=3: six processes, the stage of each node tensor-parallel over its three."""
    leader, worker, url = start_two_nodes(
        smollm_dir, "--num-shard", "3", "--pipeline-parallel-size", "2"
    )
    try:
        leader.wait_ready()
        worker.wait_ready()
        assert len(leader.shard_pids) == len(worker.shard_pids) == 3
        expected = reference_tokens(smollm_dir, PROMPTS, NEW_TOKENS)
        assert generated_tokens(url, PROMPTS) == expected
    finally:
        leader.stop()
        worker.stop()


@pytest.mark.slow
def test_nodes_started_with_different_models_are_refused(three_layer_model, tiny_model_dirs):
    leader, worker, _ = start_two_nodes(
        three_layer_model, "--num-shard", "1", node1_model=tiny_model_dirs["llama"]
    )
    try:
        for node in (leader, worker):
            assert node.process.wait(timeout=STARTUP_S) != 0
            # the launcher's one error line, then the shard's reason among its last log lines
            errors = [line for line in node.stderr().splitlines() if "launcher: error:" in line]
            assert len(errors) == 1 and "during start-up" in errors[0], node.stderr()
            reason = "launcher:     error: the ranks serve different models: rank 0 has "
            assert reason in node.stderr() and "same --model-id" in node.stderr()
    finally:
        leader.stop()
        worker.stop()


@pytest.mark.slow
def streamed_ids(url: str, body: dict, decoding: threading.Event) -> list[int]:
    """The token ids a streamed /generate_stream gives; `decoding` set at its first token."""
    ids = []
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=STARTUP_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                ids.append(json.loads(line.removeprefix("data:"))["token"]["id"])
                decoding.set()
    return ids


def test_with_restart_on_failure_the_group_re_forms_and_the_request_in_flight_completes(
    three_layer_model,
):
    leader, worker, url = start_two_nodes(
        three_layer_model,
        "--num-shard",
        "1",
        "--pipeline-parallel-size",
        "2",
        "--restart-on-failure",
    )
    body = {"inputs": PROMPTS[1], "parameters": {"max_new_tokens": 60, "details": True}}
    try:
        leader.wait_ready()
        worker.wait_ready()
        before = httpx.post(f"{url}/generate", json=body, timeout=STARTUP_S).json()
        from concurrent.futures import ThreadPoolExecutor

        decoding = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(streamed_ids, url, body, decoding)
            assert decoding.wait(STARTUP_S), "the request never streamed a token"
            # its first token out, 59 to go: the kill lands mid-decode (a sleep did not, once the
            # whole request took 0.27 s)
            os.kill(next(iter(worker.shard_pids)), signal.SIGKILL)
            ids = held.result()
        # the ids: a resumed request recomputes its KV, its logprobs may differ in the last bits
        assert ids == [t["id"] for t in before["details"]["tokens"]]
        assert "restarting all 1 shard(s)" in leader.stderr()
        assert "restarting all 1 shard(s)" in worker.stderr()
    finally:
        leader.stop()
        worker.stop()
