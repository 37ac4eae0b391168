"""The `slow` marker splits the suite: `make test-fast` (-m "not slow") keeps most of it, and the
end-to-end tests (shard, router and launcher processes; the embedded model) are what it leaves
out."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# One collection as `make test-fast` runs it, in a fresh interpreter; a plugin records what -m kept
# and what it left out. --strict-markers: an unregistered marker is an error.
COLLECT = """
import json, pytest

class Record:
    kept, left_out, markers = [], [], []

    def pytest_deselected(self, items):
        self.left_out += [item.nodeid for item in items]

    def pytest_collection_finish(self, session):
        self.kept = [item.nodeid for item in session.items]
        self.markers = session.config.getini("markers")

record = Record()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--strict-markers",
                    "-m", "not slow", "tests"], plugins=[record])
print("RECORD " + json.dumps(dict(code=int(code), kept=record.kept, left_out=record.left_out,
                                  markers=record.markers)))
"""

# End-to-end tests that -m "not slow" must leave out: whole modules, and single tests elsewhere.
END_TO_END_MODULES = [
    "tests/test_router_http.py",
    "tests/test_launcher_router.py",
    "tests/test_reliability_restart.py",
    "tests/test_tensor_parallel.py",
]
END_TO_END_TESTS = [
    "tests/test_server.py::test_cli_server_replaces_a_stale_socket_and_also_serves_tcp",
    "tests/test_cli.py::test_generate_chat_answers_from_the_embedded_model",
    "tests/test_router_client.py::test_grpc_client_on_two_tensor_parallel_shards",
]
# In-process tests that it must keep.
QUICK_MODULES = ["tests/test_buckets.py", "tests/test_sampling.py", "tests/test_layering.py"]
QUICK_TESTS = [
    "tests/test_shard.py::test_decode_of_two_concatenated_batches_matches_reference",
    "tests/test_server.py::test_tgi_router_sequence_matches_transformers",
]


def collect_as_test_fast() -> dict:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", COLLECT],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RECORD ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len("RECORD ") :])


def in_module(node_ids: list[str], module: str) -> list[str]:
    return [n for n in node_ids if n.split("::")[0] == module]


def test_not_slow_keeps_most_of_the_suite_and_leaves_out_the_end_to_end_tests():
    record = collect_as_test_fast()
    assert record["code"] == 0  # collected cleanly, with every marker registered
    assert any(m.startswith("slow:") for m in record["markers"])
    kept, left_out = record["kept"], record["left_out"]
    assert len(kept) >= 300 and len(kept) >= 2 * len(left_out), (len(kept), len(left_out))
    assert len(left_out) >= 50
    for module in END_TO_END_MODULES:
        assert in_module(left_out, module) and not in_module(kept, module), module
    for module in QUICK_MODULES:
        assert in_module(kept, module) and not in_module(left_out, module), module
    assert set(END_TO_END_TESTS) <= set(left_out)
    assert set(QUICK_TESTS) <= set(kept)
