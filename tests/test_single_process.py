"""`--single-process`: the router and its one shard in one process (launcher/single_process.py),
the shard called in place. The same answers as the gRPC launch, one child process, its flags
split back into the router's and the engine's, and the launches it cannot serve refused."""

import psutil
import pytest
from text_generation import Client

from launcher.cli import build_parser as launcher_parser
from launcher.cli import config_from_args, main
from launcher.single_process import parse
from tests.helpers import reference_tokens
from tests.test_launcher import Launch
from tests.test_launcher_router import wait_served
from tests.test_server import short_socket_dir


def launcher_config(*argv):
    return config_from_args(launcher_parser().parse_args(list(argv)))


def test_one_command_line_splits_into_the_router_and_the_shard():
    config = launcher_config(
        "--single-process", "--port", "4123", "--max-batch-size", "4", "--dtype", "bfloat16",
        "--max-input-tokens", "300", "--lookahead", "on", "--otlp-endpoint", "http://127.0.0.1:4318",
    )  # fmt: skip
    router, engine, verbose = parse(config.single_process_args())
    assert (router.port, router.hostname, router.lookahead) == (4123, "0.0.0.0", "on")
    assert (router.max_batch_size, engine.max_batch_size) == (4, 4)
    assert (router.max_input_tokens, engine.max_input_tokens) == (300, 300)
    assert engine.dtype == "bfloat16" and verbose
    assert router.master_url == ""  # no shard socket anywhere
    assert router.otlp_endpoint == "http://127.0.0.1:4318"  # a shared knob: both parsers take it


def test_a_command_line_without_its_separator_is_refused():
    from engine.errors import BucketserveError

    with pytest.raises(BucketserveError, match=r"\[router flags\] -- \[engine flags\]"):
        parse(["--port", "4123"])


@pytest.mark.parametrize(
    "flags, named",
    [
        (("--num-shard", "2"), "2 ranks"),
        (("--no-router",), "--no-router"),
        (("--restart-on-failure",), "--restart-on-failure"),
        (("--pipeline-parallel-size", "2"), "--pipeline-parallel-size"),
    ],
)
def test_launches_it_cannot_serve_are_refused(flags, named, capsys):
    assert main(["--single-process", "--device", "cpu", *flags]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: --single-process") and named in error


@pytest.mark.slow
def test_the_router_serves_its_in_process_shard(smollm_dir):
    folder = short_socket_dir()
    launch = Launch(
        smollm_dir, "--single-process", "--device", "cpu",
        "--hostname", "127.0.0.1", folder=folder,
    )  # fmt: skip
    try:
        url = wait_served(launch)
        children = psutil.Process(launch.process.pid).children(recursive=True)
        assert len(children) == 1, "one process holds the router and the shard"
        assert "launcher.single_process" in " ".join(children[0].cmdline())

        client = Client(url, timeout=120)
        prompt = "The capital of France is"
        answer = client.generate(prompt, max_new_tokens=12, decoder_input_details=True)
        expected = reference_tokens(smollm_dir, [prompt], 12)[0]
        assert [t.id for t in answer.details.tokens] == expected
        streamed = list(client.generate_stream(prompt, max_new_tokens=12))
        assert [r.token.id for r in streamed] == expected

        # the grammar check compiles on the shard's thread: a grammar still binds, and one that
        # allows nothing is still the request's own 422
        digits = client.generate(
            prompt, max_new_tokens=4, grammar={"type": "regex", "value": "[0-9]+"}
        )
        assert digits.generated_text.isdigit()
        with pytest.raises(Exception, match="allows no token"):
            client.generate(
                prompt, max_new_tokens=4, grammar={"type": "regex", "value": "[^\\s\\S]"}
            )
        assert client.generate(prompt, max_new_tokens=12).generated_text == answer.generated_text
    finally:
        launch.clean_up()
    assert not children[0].is_running() or children[0].status() == psutil.STATUS_ZOMBIE
