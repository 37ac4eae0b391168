"""A model file the router cannot read (a truncated GGUF) ends `python -m router` with one `error:`
line naming the file and exit status 2, as the engine's commands do, not a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

from engine.weights.paths import embedded_gguf_path

ROOT = Path(__file__).resolve().parent.parent
ROUTER_ARGS = ("--master-shard-uds-path", "unix:///nowhere", "--cache-dir")

# The router as `python -m router` runs it, with a stand-in for the shards that answers the
# connection: the router then goes on to find its tokenizer.
RUN_ROUTER = """
import sys
import router.app

class Shards:
    async def close(self):
        pass

async def connect(*args, **kwargs):
    return Shards()

router.app.GrpcShardClient.connect = connect
from router.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def truncated_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corrupt") / "truncated.gguf"
    with open(embedded_gguf_path(), "rb") as whole:
        path.write_bytes(whole.read(1 << 20))
    return path


@pytest.mark.parametrize("flag", ["--model-id", "--tokenizer"])
def test_a_truncated_gguf_is_one_error_line(truncated_gguf, tmp_path, flag):
    result = subprocess.run(
        [sys.executable, "-c", RUN_ROUTER, flag, str(truncated_gguf), *ROUTER_ARGS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert str(truncated_gguf) in lines[0]
