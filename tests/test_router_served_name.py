"""--served-model-name: the OpenAI API serves the model under one name (and its LoRA adapters under
theirs, and `tgi` for TGI's clients); any other `model` is 404 in OpenAI's shape. Driven in process
with the real `openai` client."""

import asyncio

import httpx
import openai
import pytest

from router.app import RouterConfig, build_parser, build_state, config_from_args, create_app
from router.client import InProcessClient
from tests.conftest import warmed_llama_shard


@pytest.fixture(scope="module")
def shard(tiny_model_dirs):
    return warmed_llama_shard(tiny_model_dirs)


def serve(shard, model_dir, calls, **knobs):
    config = RouterConfig(
        tokenizer=str(model_dir),
        max_input_tokens=64,
        max_total_tokens=128,
        max_prefill_tokens=128,
        max_batch_size=4,
        **knobs,
    )

    async def main():
        state = await build_state(config, InProcessClient(shard, max_batch_size=4))
        try:
            http = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=create_app(state)), base_url="http://router"
            )
            client = openai.AsyncOpenAI(
                base_url="http://router/v1", api_key="x", http_client=http, max_retries=0
            )
            return await calls(client, http)
        finally:
            await state.scheduler.stop()

    return asyncio.run(main())


def test_the_served_name_is_listed_accepted_and_echoed(shard, tiny_model_dirs):
    async def calls(client, http):
        listed = [m.id for m in (await client.models.list()).data]
        named = await client.completions.create(model="my-model", prompt="Hi", max_tokens=2)
        alias = await client.chat.completions.create(
            model="tgi", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        bare = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        info = (await http.get("/info")).json()
        return listed, named.model, alias.model, bare.status_code, bare.json()["model"], info

    listed, named, alias, status, bare, info = serve(
        shard, tiny_model_dirs["llama"], calls, served_model_name="my-model"
    )
    assert listed == ["my-model"] and info["model_id"] == "my-model"
    assert named == alias == bare == "my-model" and status == 200


def test_another_model_is_404_in_openais_shape(shard, tiny_model_dirs):
    async def calls(client, http):
        with pytest.raises(openai.NotFoundError) as refused:
            await client.chat.completions.create(
                model="gpt-4", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
        raw = await http.post("/v1/completions", json={"model": "llama", "prompt": "Hi"})
        metrics = (await http.get("/metrics")).text
        return refused.value, raw, metrics

    refused, raw, metrics = serve(
        shard, tiny_model_dirs["llama"], calls, served_model_name="my-model"
    )
    assert refused.status_code == 404
    assert refused.body == {
        "message": "The model `gpt-4` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert raw.status_code == 404 and raw.json()["error"]["param"] == "model"
    assert 'outcome="not_found"' in metrics


def test_the_default_name_is_the_model_directory_and_adapters_are_models_too(
    shard, tiny_model_dirs
):
    async def calls(client, http):
        return [m.id for m in (await client.models.list()).data]

    adapters = (("beta", "/adapters/beta"),)  # listed only: no request goes to them here
    listed = serve(shard, tiny_model_dirs["llama"], calls, lora_adapters=adapters)
    assert listed == [tiny_model_dirs["llama"].name, "beta"]


def test_the_name_comes_from_the_flag_or_the_model_path():
    def named(*argv):
        return config_from_args(
            build_parser().parse_args(["--master-shard-uds-path", "/s-0", *argv])
        )

    assert named().model_name == "SmolLM2-135M-Instruct"  # the embedded model
    assert named("--model-id", "/models/Llama-3-8B/").model_name == "Llama-3-8B"
    assert named("--model-id", "/m/tiny.Q4_0.gguf").model_name == "tiny.Q4_0"
    assert named("--tokenizer", "/t/qwen").model_name == "qwen"
    assert named("--model-id", "/m/x", "--served-model-name", "prod").model_name == "prod"
