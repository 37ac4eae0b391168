"""`python -m launcher` as a user runs it: real shard processes on the tiny Llama, real signals."""

import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest
import torch
from safetensors.torch import save_file

from engine.devices.probe import DeviceError, Probe, probe_in_child, resolve_device
from engine.wire import generate_pb2 as pb
from engine.wire import generate_pb2_grpc as pb_grpc
from launcher.checks import split_problem
from launcher.cli import bucketserve
from launcher.logs import Console, LogTail
from launcher.supervisor import RestartBudget
from tests.test_equivalence import PROMPTS, reference_tokens
from tests.test_server import free_tcp_port, prompt_request, short_socket_dir, tgi_warmup_request

REPO = Path(__file__).resolve().parents[1]
LIMITS = [
    "--max-input-tokens",
    "64",
    "--max-total-tokens",
    "128",
    "--max-batch-prefill-tokens",
    "128",
    "--block-size",
    "16",
    "--max-batch-size",
    "4",
    "--dtype",
    "float32",
]  # compared with float32 transformers
READY = re.compile(r"master shard socket unix://(\S+)-0 ")
STARTUP_S = 150  # generous: two shards each import torch and load a model on a 2-core machine
SHUTDOWN_TIMEOUT_S = 10  # the launcher's default graceful stop timeout
NEW_TOKENS = 6


class Launch:
    """A `python -m launcher` subprocess; its stdout and stderr go to files the test reads."""

    def __init__(self, model_dir, *flags, folder: Path):
        self.folder = folder
        self.out, self.err = folder / "launcher.out", folder / "launcher.err"
        env = {
            k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MAX_BATCH_SIZE")
        }
        command = [
            sys.executable,
            "-m",
            "launcher",
            "--model-id",
            str(model_dir),
            "--port",
            str(free_tcp_port()),
            *LIMITS,
            *flags,
        ]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=err)
        self.shard_pids: set[int] = set()
        self.base: str | None = None

    def stderr(self) -> str:
        return self.err.read_text()

    def wait_ready(self, times: int = 1) -> str:
        """The socket base from the launcher's `times`-th ready line (a restart prints it again)."""
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            found = READY.findall(self.out.read_text())
            if len(found) >= times:
                self.shard_pids |= set(self.current_shard_pids())
                self.base = found[-1]
                return self.base
            if self.process.poll() is not None:
                pytest.fail(f"the launcher exited with {self.process.returncode}:\n{self.stderr()}")
            time.sleep(0.2)
        pytest.fail(f"the launcher was not ready after {STARTUP_S}s:\n{self.stderr()}")

    def current_shard_pids(self) -> list[int]:
        children = psutil.Process(self.process.pid).children()
        return [c.pid for c in children if "serve" in c.cmdline()]

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher still runs after {timeout}s:\n{self.stderr()}")

    def clean_up(self) -> None:
        """After a failed test: stop the launcher as a user would, then kill whatever is left."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=SHUTDOWN_TIMEOUT_S + 5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in self.shard_pids:
            try:
                os.killpg(pid, signal.SIGKILL)  # each shard leads its own process group
            except ProcessLookupError:
                pass
        for path in Path(self.base).parent.glob(Path(self.base).name + "-*") if self.base else ():
            path.unlink()


@pytest.fixture
def launched(tiny_model_dirs):
    """Start launchers on the tiny Llama (4 heads, 2 KV heads); kill whatever a failed test left."""
    started, folders = [], []

    def start(*flags) -> Launch:
        folders.append(short_socket_dir())
        started.append(Launch(tiny_model_dirs["llama"], *flags, folder=folders[-1]))
        return started[-1]

    yield start
    for launch in started:
        launch.clean_up()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def stubs_for(base: str, count: int) -> list:
    return [
        pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(f"unix://{base}-{r}"))
        for r in range(count)
    ]


def fan_out(stubs, method: str, request):
    """Every RPC to every shard at once, as TGI's router does; the responses in rank order."""
    with ThreadPoolExecutor(len(stubs)) as pool:
        return list(pool.map(lambda stub: getattr(stub, method)(request, timeout=120), stubs))


def generations_once(responses) -> dict[int, list[int]]:
    """request id -> this step's tokens, failing if two ranks both answered for one request."""
    step = {}
    for response in responses:
        for generation in response.generations:
            assert generation.request_id not in step, (
                f"request {generation.request_id} answered twice"
            )
            step[generation.request_id] = list(generation.tokens.ids)
    return step


def serve_requests(
    stubs, ids: list[int], batch_id: int = 1, warm: bool = True
) -> dict[int, list[int]]:
    """Warmup (unless `warm` is False), then Prefill and Decode of `ids` fanned out to every shard."""
    if warm:
        fan_out(stubs, "Warmup", tgi_warmup_request(64, 128, 128, 4))
    batch = pb.Batch(
        id=batch_id, requests=[prompt_request(i, NEW_TOKENS) for i in ids], size=len(ids)
    )
    responses = fan_out(stubs, "Prefill", pb.PrefillRequest(batch=batch))
    tokens = generations_once(responses)
    while responses[0].HasField("batch"):
        assert len({r.HasField("batch") for r in responses}) == 1  # every rank runs every request
        responses = fan_out(stubs, "Decode", pb.DecodeRequest(batches=[responses[0].batch]))
        for request_id, new in generations_once(responses).items():
            tokens[request_id] += new
    return tokens


def engine_processes_of(base: str) -> list[psutil.Process]:
    """Any process still running with our socket base on its command line."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = process.info["cmdline"] or []
        if any(base in part for part in cmdline) and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def assert_nothing_left(launch: Launch, base: str) -> None:
    alive = [pid for pid in launch.shard_pids if is_running(pid)]
    assert not alive, f"shard processes {alive} outlived the launcher"
    assert not engine_processes_of(base)
    assert not list(Path(base).parent.glob(Path(base).name + "-*")), "socket files left behind"


def is_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_shard(launch: Launch, base: str, rank: int) -> int:
    """SIGKILL the shard that serves BASE-rank; its pid."""
    pid = next(p.pid for p in engine_processes_of(base) if p.environ().get("RANK") == str(rank))
    os.kill(pid, signal.SIGKILL)
    return pid


# --- a two-shard launch ---------------------------------------------------------------------------


@pytest.mark.slow
def test_two_shards_answer_and_each_request_is_served_once_then_sigterm_stops_all(
    launched, tiny_model_dirs
):
    launch = launched("--num-shard", "2", "--no-router", "--device", "cpu")
    base = launch.wait_ready()
    assert len(launch.shard_pids) == 2
    stubs = stubs_for(base, 2)
    for stub in stubs:
        stub.Health(pb.HealthRequest(), timeout=30)
    urls = stubs[0].ServiceDiscovery(pb.ServiceDiscoveryRequest(), timeout=30).urls
    assert list(urls) == [f"unix://{base}-0", f"unix://{base}-1"]

    tokens = serve_requests(stubs, [0, 1, 2, 3])
    assert sorted(tokens) == [0, 1, 2, 3] and all(len(t) == NEW_TOKENS for t in tokens.values())
    # The two ranks hold half the model each: together they must still generate transformers' tokens.
    expected = reference_tokens(tiny_model_dirs["llama"], PROMPTS[:4], NEW_TOKENS)
    assert [tokens[i] for i in range(4)] == expected

    launch.process.send_signal(signal.SIGTERM)
    assert launch.wait(SHUTDOWN_TIMEOUT_S) == 0, launch.stderr()
    assert "SIGTERM: all shards stopped" in launch.stderr()
    assert_nothing_left(launch, base)


@pytest.mark.slow
def test_a_shard_killed_during_decode_ends_the_launch(launched):
    folder = short_socket_dir()
    launch = launched(
        "--num-shard", "2", "--no-router", "--device", "cpu", "--uds-path", f"{folder}/s"
    )
    base = launch.wait_ready()
    stubs = stubs_for(base, 2)
    fan_out(stubs, "Warmup", tgi_warmup_request(64, 128, 128, 4))
    batch = pb.Batch(id=1, requests=[prompt_request(i, 40) for i in range(2)], size=2)
    cached = fan_out(stubs, "Prefill", pb.PrefillRequest(batch=batch))[0].batch
    kill_shard(launch, base, 1)
    with pytest.raises(grpc.RpcError):
        fan_out(stubs, "Decode", pb.DecodeRequest(batches=[cached]))
    code = launch.wait(10)  # the issue: the launcher exits within 10 s
    assert code != 0
    assert "error: shard 1 was killed by SIGKILL while serving" in launch.stderr()
    assert_nothing_left(launch, base)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_restart_on_failure_brings_the_group_back(launched):
    launch = launched("--num-shard", "2", "--no-router", "--device", "cpu", "--restart-on-failure")
    base = launch.wait_ready()
    first = set(launch.current_shard_pids())
    kill_shard(launch, base, 0)
    assert launch.wait_ready(times=2) == base  # the same sockets
    second = set(launch.current_shard_pids())
    assert len(second) == 2 and not first & second
    assert "restarting all 2 shard(s) (restart 1 of at most 3" in launch.stderr()
    assert "all 2 shard(s) warmed up again" in launch.stderr()

    tokens = serve_requests(stubs_for(base, 2), [1, 4], warm=False)  # the launcher re-ran warmup
    assert sorted(tokens) == [1, 4] and all(len(t) == NEW_TOKENS for t in tokens.values())
    launch.process.send_signal(signal.SIGINT)  # Ctrl-C stops gracefully too
    assert launch.wait(SHUTDOWN_TIMEOUT_S) == 0, launch.stderr()
    assert_nothing_left(launch, base)


@pytest.mark.slow
def test_a_corrupt_weight_file_is_refused_before_any_shard_starts(
    launched, tiny_model_dirs, tmp_path
):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dirs["llama"], broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    folder = short_socket_dir()
    # Two shards: the launcher reads the model's config to check the split, and refuses there.
    launch = launched(
        "--num-shard",
        "2",
        "--device",
        "cpu",
        "--uds-path",
        f"{folder}/s",
        "--model-id",
        str(broken),
    )
    code = launch.wait(STARTUP_S)
    err = launch.stderr()
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{broken / 'model.safetensors'} is corrupt" in errors[0], err
    assert "shard" not in err and "Traceback" not in err
    assert_nothing_left(launch, f"{folder}/s")
    shutil.rmtree(folder, ignore_errors=True)


def test_a_shard_that_dies_at_start_up_stops_the_launch(launched, tiny_model_dirs, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dirs["llama"], broken)
    # A well-formed file that holds none of the model's weights: the launcher's checks read only
    # its header (a file that is not safetensors at all is refused before any shard starts), so
    # it is the shards that fail, loading it.
    save_file({"unrelated.weight": torch.zeros(2)}, broken / "model.safetensors")
    folder = short_socket_dir()
    launch = launched(
        "--num-shard",
        "2",
        "--device",
        "cpu",
        "--uds-path",
        f"{folder}/s",
        "--model-id",
        str(broken),
    )
    code = launch.wait(STARTUP_S)
    err = launch.stderr()
    assert code == 1, err
    assert re.search(
        r"error: shard [01] exited with code 2 during start-up; its last \d+ log line\(s\):", err
    )
    # the shard's own error, reported
    assert "matches no parameter of the model" in err.split("during start-up")[1]
    assert_nothing_left(launch, f"{folder}/s")
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_shards_not_healthy_within_the_startup_timeout_stop_the_launch(launched):
    folder = short_socket_dir()
    # No shard imports torch and loads a model in a fifth of a second.
    launch = launched(
        "--num-shard",
        "2",
        "--device",
        "cpu",
        "--uds-path",
        f"{folder}/s",
        "--startup-timeout",
        "0.2",
    )
    assert launch.wait(STARTUP_S) == 1
    assert "error: shard(s) [0, 1] not healthy after --startup-timeout 0.2s" in launch.stderr()
    assert_nothing_left(launch, f"{folder}/s")
    shutil.rmtree(folder, ignore_errors=True)


# --- refused before any shard starts --------------------------------------------------------------


@pytest.fixture
def busy_port():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--num-shard", "3"],
            r"--num-shard 3 cannot split the model in \S+: num_attention_heads=4 is not divisible by 3",
        ),
        (["--port", "BUSY"], r"--port \d+ is already in use on this host"),
        (["--master-port", "BUSY"], r"--master-port \d+ is already in use on this host"),
        (["--device", "tpu"], r"unknown device 'tpu' \(choose from auto, cpu, cuda, hpu, xpu\)"),
        (
            ["--device", "cuda"],
            r"--device cuda is not usable here: this torch \(.+\) is built without CUDA or ROCm",
        ),
        (
            ["--device", "hpu"],
            r"--device hpu is not usable here: habana_frameworks is not installed \(it ships in Habana's PyTorch images\)",
        ),
        (
            ["--device", "xpu"],
            r"--device xpu is not usable here: this torch \(.+\) is built without XPU support",
        ),
        (
            ["--dtype", "bogus"],
            r"argument --dtype: unknown dtype 'bogus' \(choose from auto, float32, bfloat16, float16\) \(see --help\)",
        ),
        (
            ["--device", "cuda", "--quantize", "int4"],
            r"--quantize int4 runs on cpu only, not on --device cuda",
        ),
        (
            ["--device", "hpu", "--quantize", "int8"],
            r"--quantize int8 runs on cpu, cuda, xpu only, not on --device hpu",
        ),
        (
            ["--pipeline-parallel-size", "2", "--quantize", "int8"],
            r"--quantize int8 does not combine with --pipeline-parallel-size",
        ),
    ],
    ids=[
        "heads",
        "port",
        "master-port",
        "unknown-device",
        "cuda",
        "hpu",
        "xpu",
        "dtype",
        "int4-on-cuda",
        "int8-on-hpu",
        "quantized-stages",
    ],
)
def test_bad_launches_are_refused_in_one_line_before_any_shard(
    tiny_model_dirs, busy_port, flags, message
):
    folder = short_socket_dir()
    flags = [str(busy_port) if f == "BUSY" else f for f in flags]
    port = [] if "--port" in flags else ["--port", str(free_tcp_port())]
    command = [
        sys.executable,
        "-m",
        "launcher",
        "--model-id",
        str(tiny_model_dirs["llama"]),
        "--no-router",
        "--uds-path",
        f"{folder}/s",
        *LIMITS,
        *port,
        *flags,
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    shutil.rmtree(folder, ignore_errors=True)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert re.fullmatch(f"error: {message}\n", done.stderr), done.stderr
    assert not engine_processes_of(f"{folder}/s")


# --- units ----------------------------------------------------------------------------------------


def test_bucketserve_runs_the_launcher_or_an_engine_command(capsys):
    with pytest.raises(SystemExit) as launcher_help:
        bucketserve(["--help"])
    assert launcher_help.value.code == 0 and "--num-shard" in capsys.readouterr().out
    with pytest.raises(SystemExit) as engine_help:
        bucketserve(["generate", "--help"])
    assert engine_help.value.code == 0 and "--max-new-tokens" in capsys.readouterr().out
    with pytest.raises(SystemExit) as buckets_help:
        bucketserve(["buckets", "--help"])
    assert buckets_help.value.code == 0 and "--shapes" in capsys.readouterr().out
    assert bucketserve(["loadtest", "--help"]) == 0 and "--rate" in capsys.readouterr().out


def test_split_rule_names_the_numbers():
    assert split_problem(9, 3, 3) is None and split_problem(32, 8, 2) is None
    assert split_problem(32, 2, 4) is None  # fewer KV heads than shards: each KV head is replicated
    assert split_problem(9, 3, 2) == "num_attention_heads=9 is not divisible by 2"
    assert split_problem(12, 3, 6) is None
    assert (
        split_problem(24, 4, 6)
        == "num_key_value_heads=4 and 6 shards: neither is a multiple of the other"
    )


def fake_probe(**found):
    return lambda devices: [found.get(d, Probe(d, False, "absent")) for d in devices]


def test_device_plans_give_each_rank_its_own_device():
    cuda = fake_probe(cuda=Probe("cuda", True, count=4))
    plan = resolve_device("cuda", 2, {}, lambda: ["cpu", "cuda"], probe=cuda)
    assert [plan.env(r) for r in (0, 1)] == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]
    narrowed = resolve_device(
        "cuda", 2, {"CUDA_VISIBLE_DEVICES": "2,3"}, lambda: ["cpu", "cuda"], probe=cuda
    )
    assert narrowed.env(1) == {"CUDA_VISIBLE_DEVICES": "3"}
    rocm = fake_probe(cuda=Probe("cuda", True, count=1, rocm=True))
    assert resolve_device("cuda", 1, {}, lambda: ["cuda"], probe=rocm).env(0) == {
        "HIP_VISIBLE_DEVICES": "0"
    }
    hpu = fake_probe(hpu=Probe("hpu", True, count=8))
    # Module ids are the host's: none is made up (each shard takes its LOCAL_RANK among the
    # visible Gaudis), and a list the user set reaches every shard whole.
    assert "HABANA_VISIBLE_MODULES" not in resolve_device(
        "hpu", 8, {}, lambda: ["hpu"], probe=hpu
    ).env(7)
    chosen = {"HABANA_VISIBLE_MODULES": "4,5,6,7"}
    assert (
        resolve_device("hpu", 4, chosen, lambda: ["hpu"], probe=hpu).env(3)[
            "HABANA_VISIBLE_MODULES"
        ]
        == "4,5,6,7"
    )
    xpu = fake_probe(xpu=Probe("xpu", True, count=2))
    assert resolve_device("auto", 2, {}, lambda: ["cpu", "xpu"], probe=xpu).env(1) == {
        "ZE_AFFINITY_MASK": "1"
    }
    with pytest.raises(DeviceError, match="--num-shard 8 needs 8 cuda devices, 4 visible"):
        resolve_device("cuda", 8, {}, lambda: ["cuda"], probe=cuda)
    with pytest.raises(DeviceError, match="this engine has no cuda adapter yet"):
        resolve_device("cuda", 1, {}, lambda: ["cpu"], probe=cuda)


def test_the_probe_child_answers_for_every_device_without_one_here():
    probes = probe_in_child(("cuda", "hpu", "xpu"))
    assert [(p.device, p.usable) for p in probes] == [
        ("cuda", False),
        ("hpu", False),
        ("xpu", False),
    ]
    assert "habana_frameworks is not installed" in probes[1].reason


def test_auto_falls_back_to_cpu_and_splits_its_cores():
    warnings = []
    plan = resolve_device(
        "auto",
        2,
        {},
        lambda: ["cpu"],
        probe=fake_probe(cuda=Probe("cuda", True, count=2)),
        warn=warnings.append,
    )
    assert (
        plan.name == "cpu"
        and "OMP_NUM_THREADS" in plan.env(0)
        and "CUDA_VISIBLE_DEVICES" not in plan.env(0)
    )
    assert warnings == [
        "a cuda device is present but this engine has no cuda adapter yet: not using it"
    ]
    assert resolve_device("cpu", 2, {"OMP_NUM_THREADS": "1"}, lambda: ["cpu"]).env(1) == {}


def test_restart_budget_allows_a_few_restarts_per_window():
    budget = RestartBudget(limit=3, window=300)
    assert [budget.take() for _ in range(4)] == [True, True, True, False]
    budget.times[0] -= 301  # the oldest restart left the window
    assert budget.take()


def test_log_tail_keeps_lines_and_does_not_forward_progress_bars():
    read, write = os.pipe()
    forwarded = []
    with open(read, "rb") as stream:
        tail = LogTail(stream, forwarded.append)
        # tqdm draws "\r<bar>" per tick and ends with "\n"; a "\r\n" may arrive split over two reads.
        for chunk in (
            b"loading\r",
            b"\n\rwarmup:  10%\rwarmup:  50%",
            b"\rwarmup: 100%\nTraceback (most recent call last)\nValueError: boom",
        ):
            os.write(write, chunk)
        os.close(write)
        tail.finish()
    assert forwarded == [
        "loading",
        "warmup: 100%",
        "Traceback (most recent call last)",
        "ValueError: boom",
    ]
    assert tail.tail(2) == ["Traceback (most recent call last)", "ValueError: boom"]
    assert tail.latest == "ValueError: boom"


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_one_terminal_line_that_log_lines_push_down():
    terminal = FakeTerminal()
    console = Console(terminal, format_lines=False)  # the redrawing, not the line format
    console.status("waiting for shards: 0/2 ready")
    console.line("[shard 0] loaded")
    console.clear_status()
    assert terminal.getvalue() == (
        "waiting for shards: 0/2 ready"
        + "\r\033[K"
        + "[shard 0] loaded\n"
        + "waiting for shards: 0/2 ready"
        + "\r\033[K"
    )
