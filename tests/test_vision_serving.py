"""A tiny random LLaVA behind a real shard and router process: images through the OpenAI client's
content parts, TGI's markdown and `bucketserve generate --image`, exact against transformers;
bad images answered 422 in each API's error body."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.test_router_http import shard_and_router, while_streaming
from tests.test_server import REPO, short_socket_dir
from tests.vision_models import image_bytes, llava_reference

pytestmark = pytest.mark.slow  # end to end: real shard and router processes

NEW_TOKENS = 30
LIMITS = ["--max-input-tokens", "96", "--max-total-tokens", "160"]
LIMITS += ["--max-batch-prefill-tokens", "192", "--max-batch-size", "4"]


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


MAX_PIXELS = 100 * 100
ROUTER = LIMITS + ["--max-image-pixels", str(MAX_PIXELS)]


@pytest.fixture(scope="module")
def url(tiny_llava_dir):
    with shard_and_router(tiny_llava_dir, short_socket_dir() / "v", LIMITS, ROUTER) as served:
        yield served[0]


def openai_image(image_url: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": image_url}}]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}


def tgi_images(*image_urls: str) -> dict:
    inputs = "".join(f"![]({u})" for u in image_urls) + "What is it?"
    return {"inputs": inputs, "parameters": {"max_new_tokens": 2}}


BAD = [  # (route, body, what the error names)
    ("/v1/chat/completions", openai_image(data_url(b"\x89PNG\r\n\x1a\n" + bytes(60))), "corrupt"),
    ("/generate", tgi_images(data_url(image_bytes(8, 8, kind="TIFF"), "image/tiff")), "TIFF"),
    ("/v1/chat/completions", openai_image(data_url(image_bytes(101, 100))), "more than the limit"),
    ("/generate", tgi_images(*[data_url(image_bytes(8, 8))] * 9), "up to 8 images. Given: 9"),
    ("/v1/chat/completions", openai_image("http://example.com/cat.png"), "not allowed"),
]


def test_bad_images_are_refused_while_a_request_with_an_image_stays_exact(url, tiny_llava_dir):
    picture = image_bytes(45, 35, seed=12)
    inputs = f"![]({data_url(picture)})Tell me a story about it."
    body = {"inputs": inputs, "parameters": {"max_new_tokens": NEW_TOKENS}}
    answers = []

    def refuse_each():
        for route, bad, problem in BAD:
            response = httpx.post(f"{url}{route}", json=bad, timeout=60)
            answers.append((route, response.status_code, response.json(), problem))

    ids = while_streaming(url, body, refuse_each)
    chunks = [picture, "Tell me a story about it."]
    assert ids == llava_reference(tiny_llava_dir, chunks, NEW_TOKENS, eos=True)
    for route, status, error, problem in answers:
        assert status == 422, (route, error)
        message = error["error"]["message"] if route.startswith("/v1") else error["error"]
        assert problem in message and (route.startswith("/v1") or error["error_type"])


def test_openai_image_parts_match_transformers(url, tiny_llava_dir):
    picture = image_bytes(40, 30, seed=7)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    parts = [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": data_url(picture)}},
        {"type": "text", "text": "?"},
    ]
    reply = client.chat.completions.create(
        model="tgi",
        messages=[{"role": "user", "content": parts}],
        max_tokens=NEW_TOKENS,
        temperature=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_llava_dir)
    marker = "\x00"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is in {marker}?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    before, after = prompt.split(marker)
    expected = llava_reference(
        tiny_llava_dir, [before, picture, after], NEW_TOKENS, add_special_tokens=False, eos=True
    )
    assert expected and reply.choices[0].message.content == tokenizer.decode(
        expected, skip_special_tokens=True
    )


def test_tgi_markdown_images_match_transformers(url, tiny_llava_dir):
    first, second = image_bytes(64, 20, seed=8), image_bytes(33, 47, seed=9, kind="JPEG")
    inputs = f"Compare ![]({data_url(first)}) with ![]({data_url(second, 'image/jpeg')}) now"
    body = {"inputs": inputs, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    ids = [t["id"] for t in response.json()["details"]["tokens"]]
    chunks = ["Compare ", first, " with ", second, " now"]
    assert ids == llava_reference(tiny_llava_dir, chunks, NEW_TOKENS, eos=True)


@pytest.mark.parametrize(
    "image_url, problem",
    [
        (data_url(image_bytes(20, 20)[:40]), "an image is corrupt"),
        (data_url(image_bytes(8, 8, kind="TIFF"), "image/tiff"), "format TIFF is not supported"),
        ("https://example.com/cat.png", "image URLs are not allowed"),
    ],
)
def test_bad_images_are_422_in_openais_shape(url, image_url, problem):
    parts = [{"type": "image_url", "image_url": {"url": image_url}}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 422, response.text
    assert problem in response.json()["error"]["message"]


def test_too_many_images_are_422_in_tgis_shape(url):
    inputs = f"![]({data_url(image_bytes(8, 8))})" * 9
    body = {"inputs": inputs, "parameters": {"max_new_tokens": 2}}
    response = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "a request may hold up to 8 images. Given: 9"


def test_generate_command_takes_image_files(tiny_llava_dir, tmp_path):
    picture = tmp_path / "cat.png"
    picture.write_bytes(image_bytes(50, 40, seed=10))
    command = [sys.executable, "-m", "launcher", "generate", "--model-id", str(tiny_llava_dir)]
    command += ["--device", "cpu", "--dtype", "float32", "--strict-shapes", "on", "--json"]
    command += ["--image", str(picture), "--prompt", "Describe it.", "--max-new-tokens", "30"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    ids = json.loads(result.stdout.splitlines()[-1])["token_ids"]
    chunks = [picture.read_bytes(), "Describe it."]
    assert ids == llava_reference(tiny_llava_dir, chunks, NEW_TOKENS, eos=True)


def image_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    names = ("images_encoded", "image_cache_hits", "encoder_seconds")
    found = {n: re.search(rf"^bucketserve_shard_{n}_total (\S+)$", text, re.M) for n in names}
    return {n: float(m[1]) if m else 0.0 for n, m in found.items()}


def test_a_repeated_image_in_a_chat_is_encoded_once(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    picture = {"type": "image_url", "image_url": {"url": data_url(image_bytes(36, 36, seed=11))}}
    first = [{"role": "user", "content": [picture, {"type": "text", "text": "What is it?"}]}]
    before = image_counters(url)
    answer = client.chat.completions.create(model="tgi", messages=first, max_tokens=4)
    turns = first + [
        {"role": "assistant", "content": answer.choices[0].message.content},
        {"role": "user", "content": "And its color?"},
    ]
    client.chat.completions.create(model="tgi", messages=turns, max_tokens=4)
    after = image_counters(url)
    assert after["images_encoded"] - before["images_encoded"] == 1
    assert after["image_cache_hits"] - before["image_cache_hits"] == 1
    assert after["encoder_seconds"] > before["encoder_seconds"]
