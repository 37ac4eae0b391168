"""The front page (`GET /`) in a real headless Chromium after real traffic, and `/info` as TGI's
client reads it, over a real shard and router (subprocesses)."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser

import httpx
import pytest
from text_generation import Client
from text_generation.errors import ValidationError

from router.http.state import VALIDATION_WORKERS
from router.sched.fanout import MAX_SIBLINGS
from tests.test_router_http import shard_and_router
from tests.test_server import short_socket_dir

BATCH = 4  # the router's --max-batch-size (tests/test_router_http.py ROUTER_LIMITS)
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def url(tiny_model_dirs):
    base = short_socket_dir() / "s"
    with shard_and_router(
        tiny_model_dirs["llama"], base, ["--max-batch-size", str(BATCH)]
    ) as served:
        yield served[0]


def test_info_states_the_limits_the_routes_enforce(url):
    info = httpx.get(f"{url}/info", timeout=30).json()
    assert info["max_best_of"] == min(MAX_SIBLINGS, BATCH) > 1
    assert info["max_stop_sequences"] == 4 and info["max_input_length"] == info["max_input_tokens"]
    assert info["validation_workers"] == VALIDATION_WORKERS and info["max_client_batch_size"] == 1
    client = Client(url, timeout=60)
    most = info["max_best_of"]
    answer = client.generate("Hello", max_new_tokens=4, best_of=most, do_sample=True)
    assert len(answer.details.best_of_sequences) == most - 1
    with pytest.raises(ValidationError, match="best_of"):
        client.generate("Hello", max_new_tokens=4, best_of=most + 1, do_sample=True)
    stops = [f"stop{i}" for i in range(info["max_stop_sequences"])]
    assert (
        client.generate("Hello", max_new_tokens=2, stop_sequences=stops).generated_text is not None
    )
    with pytest.raises(ValidationError, match="stop"):
        client.generate("Hello", max_new_tokens=2, stop_sequences=[*stops, "one more"])


def test_the_front_page_is_html_with_no_external_assets_and_the_cdn_docs_are_gone(url):
    page = httpx.get(f"{url}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text), "an external asset"
    assert "@import" not in page.text and "url(" not in page.text
    assert httpx.get(f"{url}/docs", timeout=30).status_code == 404  # Swagger UI: assets from a CDN
    assert httpx.get(f"{url}/redoc", timeout=30).status_code == 404
    assert httpx.get(f"{url}/openapi.json", timeout=30).status_code == 200
    compat = httpx.post(
        f"{url}/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}}, timeout=60
    )
    assert compat.status_code == 200 and isinstance(compat.json(), list)  # TGI's POST / stays


def test_buckets_reports_hits_and_waste_after_traffic(url):
    for n in (3, 5):
        httpx.post(
            f"{url}/generate",
            json={"inputs": "Hello there", "parameters": {"max_new_tokens": n}},
            timeout=60,
        ).raise_for_status()
    status = httpx.get(f"{url}/buckets", timeout=30).json()
    assert status["model"]["device"] == "cpu" and status["model"]["dtype"]
    assert status["warmup"]["total"] > 0 and status["warmup"]["warmed"] == status["warmup"]["total"]
    assert status["plan"]["prefill"] + status["plan"]["decode"] == status["warmup"]["total"]
    phases = {b["phase"] for b in status["buckets"]}
    assert phases == {"prefill", "decode"} and all(b["hits"] > 0 for b in status["buckets"])
    assert all(0 <= b["waste"] < 1 and b["real"] <= b["padded"] for b in status["buckets"])
    assert status["kv_cache"]["blocks_total"] > 0 and status["requests"] == {
        "running": 0,
        "queued": 0,
    }


class Rows(HTMLParser):
    """The cells of the bucket table's rows; `texts`: the text of each element with an id."""

    def __init__(self):
        super().__init__()
        self.rows, self._row, self._cell = [], None, None
        self.texts: dict[str, str] = {}

    def feed(self, data: str) -> None:
        super().feed(data)
        for name, text in re.findall(r'id="([\w-]+)"[^>]*>([^<]*)<', data):
            self.texts[name] = text.strip()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and "bucket" in (attrs.get("class") or ""):
            self._row = []
        elif tag == "td" and self._row is not None:
            self._cell = ""

    def handle_endtag(self, tag):
        if tag == "td" and self._row is not None and self._cell is not None:
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip(
            "no chromium here (Debian: apt-get install chromium) for the headless browser check"
        )
    return found


def browse(url: str, profile, *flags: str) -> subprocess.CompletedProcess:
    """Chromium, headless, after the page's scripts ran (virtual time lets its fetch complete)."""
    command = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        *flags,
        url,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def test_the_front_page_in_headless_chromium_shows_the_buckets_after_traffic(url, tmp_path):
    chromium()
    httpx.post(
        f"{url}/generate", json={"inputs": "Hi", "parameters": {"max_new_tokens": 4}}, timeout=60
    ).raise_for_status()
    dom = Rows()
    dom.feed(browse(f"{url}/", tmp_path / "profile", "--dump-dom").stdout)
    assert "cpu" in dom.texts["model"] and "float32" in dom.texts["model"]
    assert re.fullmatch(r"(\d+) / \1 warm", dom.texts["warmup"])
    assert re.fullmatch(r"\d+ / \d+ blocks", dom.texts["kv"])
    assert dom.texts["running"] == "0 running" and dom.texts["queued"] == "0 queued"
    assert {row[0] for row in dom.rows} == {"prefill", "decode"}
    assert all(int(row[4]) > 0 for row in dom.rows), dom.rows  # hits
    assert all(row[7].endswith("%") for row in dom.rows)  # padding waste
    shot = tmp_path / "front_page.png"
    browse(f"{url}/", tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,900")
    assert shot.read_bytes()[:8] == PNG and shot.stat().st_size > 10_000
