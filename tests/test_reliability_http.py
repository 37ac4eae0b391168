"""Hostile HTTP requests get a 4xx with the route's JSON error body, and a valid request streaming
beside each of them still gives transformers' tokens (ISSUE 12, "What was measured" 1-5)."""

import json

import httpx
import pytest

from tests.test_equivalence import PROMPTS, reference_tokens
from tests.test_router_http import router_url, served  # noqa: F401 - the shard + router of this module

pytestmark = pytest.mark.slow  # end to end: real shard and router processes

VALID_TOKENS = 40
MARKER = "zq-marker-7731"  # never to be echoed back in an error body


@pytest.fixture(scope="module")
def valid_expected(tiny_model_dirs):
    return reference_tokens(tiny_model_dirs["llama"], [PROMPTS[0]], VALID_TOKENS, stop_on_eos=True)[
        0
    ]


def beside(url: str, hostile) -> tuple[list[int], httpx.Response]:
    """Start a valid greedy stream, send `hostile(url)` once its first token came, finish the stream."""
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": VALID_TOKENS}}
    tokens, answer = [], None
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:") :])
            assert "error" not in event, event
            tokens.append(event["token"]["id"])
            if answer is None:
                answer = hostile(url)
    return tokens, answer


def post(path: str, body=None, content: bytes | None = None, headers=None):
    def send(url):
        return httpx.post(f"{url}{path}", json=body, content=content, headers=headers, timeout=120)

    return send


def raw_json(path: str, text: str):
    return post(path, content=text.encode(), headers={"content-type": "application/json"})


def generate_with(**parameters):
    return post(
        "/generate",
        {"inputs": f"Hello {MARKER}", "parameters": {"max_new_tokens": 5, **parameters}},
    )


HOSTILE_422 = {
    "top_k beyond uint32": (generate_with(top_k=2**32), "`top_k`"),
    "surrogate in stop": (
        raw_json("/generate", '{"inputs": "Hi", "parameters": {"stop": ["\\ud800"]}}'),
        "`stop`",
    ),
    "surrogate in inputs": (raw_json("/generate", '{"inputs": "Hi \\ud800"}'), "`inputs`"),
    "regex that does not parse": (
        generate_with(grammar={"type": "regex", "value": "(unclosed"}),
        "`grammar`",
    ),
    "regex that allows nothing": (
        generate_with(grammar={"type": "regex", "value": "[^\\s\\S]"}),
        "`grammar`",
    ),
    "schema of an unknown type": (
        generate_with(grammar={"type": "json", "value": {"type": "nonsense"}}),
        "`grammar`",
    ),
    "temperature beyond float32": (
        generate_with(temperature=1e300, do_sample=True),
        "`temperature`",
    ),
    "JSON Infinity": (
        raw_json("/generate", '{"inputs": "Hi", "parameters": {"temperature": Infinity}}'),
        "`temperature`",
    ),
    "wrong type, input not echoed": (
        post("/generate", {"inputs": MARKER, "parameters": {"top_k": [MARKER]}}),
        "top_k`",
    ),
    "1.5 MB prompt, refused before tokenizing": (
        post("/generate", {"inputs": "word " * 300_000}),
        "characters",
    ),
    "too many chat messages": (
        post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 2000}),
        "`messages`",
    ),
    "unimplemented OpenAI field": (
        post(
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "functions": [{"name": "f"}],
                "audio": {"v": 1},
            },
        ),
        "`audio`, `functions`",
    ),
}


def error_text(response: httpx.Response) -> str:
    body = response.json()
    return body["error"]["message"] if isinstance(body["error"], dict) else body["error"]


@pytest.mark.parametrize("case", list(HOSTILE_422))
def test_hostile_body_is_422_and_the_stream_beside_it_is_exact(router_url, valid_expected, case):
    hostile, field = HOSTILE_422[case]
    tokens, answer = beside(router_url, hostile)
    assert tokens == valid_expected
    assert answer.status_code == 422, answer.text
    assert field in error_text(answer) and MARKER not in answer.text


REFUSED = {
    "body over the payload limit": (
        post(
            "/generate",
            content=b'{"inputs": "' + b"a" * 3_000_000 + b'"}',
            headers={"content-type": "application/json"},
        ),
        413,
        "payload_too_large",
        "too_large",
    ),
    "not JSON": (
        post(
            "/generate",
            content=b"inputs=hi",
            headers={"content-type": "application/x-www-form-urlencoded"},
        ),
        415,
        "unsupported_media_type",
        "validation",
    ),
    "invalid UTF-8": (
        post(
            "/generate",
            content=b'{"inputs": "\xff\xfe"}',
            headers={"content-type": "application/json"},
        ),
        400,
        "validation",
        "validation",
    ),
    "unknown route": (
        lambda url: httpx.post(f"{url}/nowhere", json={}, timeout=30),
        404,
        "not_found",
        "not_found",
    ),
    "wrong method": (
        lambda url: httpx.get(f"{url}/generate", timeout=30),
        405,
        "method_not_allowed",
        "not_found",
    ),
    "tokenize crash": (
        raw_json("/tokenize", '{"inputs": "\\ud800 x"}'),
        422,
        "validation",
        "validation",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refusals_have_the_tgi_error_body_and_are_counted(router_url, valid_expected, case):
    hostile, status, error_type, outcome = REFUSED[case]
    before = outcome_counts(router_url)
    tokens, answer = beside(router_url, hostile)
    assert tokens == valid_expected
    assert answer.status_code == status, answer.text
    assert answer.json()["error_type"] == error_type and isinstance(answer.json()["error"], str)
    after = outcome_counts(router_url)
    label = f'bucketserve_requests_total{{outcome="{outcome}"}}'
    assert after[label] - before[label] == 1


def outcome_counts(url: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("bucketserve_requests_total{"):
            name, value = line.rsplit(" ", 1)
            counts[name] = float(value)
    return counts


def test_seed_zero_is_a_seed(router_url):
    body = {
        "inputs": PROMPTS[1],
        "parameters": {
            "max_new_tokens": 8,
            "do_sample": True,
            "seed": 0,
            "temperature": 1.5,
            "details": True,
        },
    }
    answers = [httpx.post(f"{router_url}/generate", json=body, timeout=60).json() for _ in range(2)]
    assert answers[0]["details"]["seed"] == 0 == answers[1]["details"]["seed"]
    assert answers[0]["details"]["tokens"] == answers[1]["details"]["tokens"]
