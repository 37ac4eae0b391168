"""Tiny random LLaVA-NeXT, Qwen2.5-VL and Gemma 3 VLMs behind a real shard and router process each: images
sent as the OpenAI client's `image_url` content parts (data: URLs), and to
`bucketserve generate --image`, greedy equal to transformers (fp32, strict shapes)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import openai
import pytest
from transformers import AutoTokenizer

from tests.test_router_http import shard_and_router
from tests.test_server import REPO, short_socket_dir
from tests.vision_models import (
    build_tiny_gemma3,
    build_tiny_llava_next,
    gemma3_reference,
    image_bytes,
    llava_next_reference,
)

pytestmark = pytest.mark.slow  # end to end: real shard and router processes

NEW_TOKENS = 30
LIMITS = ["--max-input-tokens", "160", "--max-total-tokens", "200"]
LIMITS += ["--max-batch-prefill-tokens", "200", "--max-batch-size", "2"]
FAMILIES = {"llava_next": (build_tiny_llava_next, llava_next_reference)}
FAMILIES["gemma3"] = (build_tiny_gemma3, gemma3_reference)


def qwen2_5_vl(out_dir, tokenizer_dir):
    from tests.test_vision_qwen2_5_vl import build_tiny_qwen2_5_vl

    return build_tiny_qwen2_5_vl(out_dir, tokenizer_dir)


def qwen2_5_vl_reference(model_dir, chunks, new_tokens, add_special_tokens=False):
    """The embedded model's tokenizer adds no special tokens either way."""
    from tests.test_vision_qwen2_5_vl import qwen_reference

    return qwen_reference(model_dir, chunks, new_tokens)


FAMILIES["qwen2_5_vl"] = (qwen2_5_vl, qwen2_5_vl_reference)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request, tmp_path_factory, smollm_dir):
    """(family, model directory, router URL)."""
    build, _ = FAMILIES[request.param]
    model_dir = build(tmp_path_factory.mktemp(request.param), smollm_dir)
    base = short_socket_dir() / request.param[0]
    with shard_and_router(model_dir, base, [*LIMITS, "--strict-shapes", "on"], LIMITS) as served:
        yield request.param, model_dir, served[0]


def data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def test_openai_image_parts_match_transformers(model):
    family, model_dir, url = model
    first, second = image_bytes(60, 30, seed=31), image_bytes(30, 50, seed=32)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    parts = [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": data_url(first)}},
        {"type": "text", "text": " with "},
        {"type": "image_url", "image_url": {"url": data_url(second)}},
    ]
    reply = client.chat.completions.create(
        model="tgi",
        messages=[{"role": "user", "content": parts}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    marker = "\x00"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Compare {marker} with {marker}"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    before, middle, after = prompt.split(marker)
    chunks = [before, first, middle, second, after]
    reference = FAMILIES[family][1]
    expected = reference(model_dir, chunks, NEW_TOKENS, add_special_tokens=False)
    text = tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.usage.completion_tokens == NEW_TOKENS
    assert reply.choices[0].message.content == text


def test_generate_command_takes_image_files(model, tmp_path):
    family, model_dir, _ = model
    if family != "gemma3":  # the LLaVA family's is tests/test_vision_serving.py's
        pytest.skip("one model is enough for the command")
    picture = tmp_path / "cat.png"
    picture.write_bytes(image_bytes(50, 40, seed=33))
    command = [sys.executable, "-m", "launcher", "generate", "--model-id", str(model_dir)]
    command += ["--device", "cpu", "--dtype", "float32", "--strict-shapes", "on", "--json"]
    command += ["--image", str(picture), "--image", str(picture), "--prompt", "Describe it."]
    command += ["--max-new-tokens", str(NEW_TOKENS)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    ids = json.loads(result.stdout.splitlines()[-1])["token_ids"]
    chunks = [picture.read_bytes(), picture.read_bytes(), "Describe it."]
    assert ids == gemma3_reference(model_dir, chunks, NEW_TOKENS, eos=True)
