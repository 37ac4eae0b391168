"""Processes stop cleanly: a shard stopped during progressive warmup's background phase exits 0
(its warmup thread stopped first), and a SIGKILLed launcher leaves no shard or router behind."""

import signal
from pathlib import Path

import psutil
import pytest

from engine.wire import generate_pb2_grpc as pb_grpc
from tests.test_launcher import Launch, engine_processes_of  # noqa: F401
from tests.test_launcher_router import wait_served
from tests.test_server import (
    short_socket_dir,
    start_cli_server,
    tgi_warmup_request,
    wait_until_serving,
)

pytestmark = pytest.mark.slow  # end to end: shard and launcher processes, signalled

PARENT_GONE_S = 30  # a shard polls its parent every 0.5 s, then stops within its grace period


def test_sigint_during_background_warmup_exits_cleanly(tiny_model_dirs):
    base = short_socket_dir() / "s"
    # compile mode: warming runs every bucket (on an eager CPU it only registers them, leaving no background phase)
    process = start_cli_server(
        tiny_model_dirs["llama"], base, extra=["--warmup", "progressive", "--graph-mode", "compile"]
    )
    channel = wait_until_serving(process, f"unix://{base}-0", base)
    pb_grpc.TextGenerationServiceStub(channel).Warmup(
        tgi_warmup_request(64, 128, 128, 4), timeout=120
    )
    channel.close()
    process.send_signal(signal.SIGINT)  # the background warmup has only begun
    code = process.wait(timeout=60)
    log = Path(f"{base}.log").read_text()
    assert "more warming in the background" in log
    assert "stopping the background warmup" in log  # it was still running: this test saw the stop
    assert "terminate called" not in log and code == 0, log[-2000:]


def test_a_sigkilled_launcher_leaves_no_process_behind(tiny_model_dirs):
    folder = short_socket_dir()
    launch = Launch(
        tiny_model_dirs["llama"],
        "--num-shard",
        "2",
        "--device",
        "cpu",
        "--hostname",
        "127.0.0.1",
        "--uds-path",
        f"{folder}/s",
        folder=folder,
    )
    try:
        wait_served(launch)
        children = engine_processes_of(f"{folder}/s")  # the shards and the router
        launch.shard_pids |= {p.pid for p in children}
        assert len(children) >= 3
        launch.process.kill()
        launch.process.wait()
        gone, alive = psutil.wait_procs(children, timeout=PARENT_GONE_S)
        assert not alive, f"{[p.cmdline()[:4] for p in alive]} outlived the SIGKILLed launcher"
    finally:
        launch.clean_up()
