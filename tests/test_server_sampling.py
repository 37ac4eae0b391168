"""The next-token chooser through the real gRPC server: logprobs, seeds, warpers, penalties, stops, grammars."""

import json
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.serving.server import ServerConfig
from engine.serving.shard import Shard
from engine.wire import generate_pb2 as pb
from tests.conftest import tiny_config
from tests.test_server import (
    LIMITS,
    BackgroundServer,
    short_socket_dir,
    text_request,
    tgi_warmup_request,
)

PROMPT = "The lighthouse keeper counted the ships that passed in the night"


@pytest.fixture(scope="module")
def stub(tiny_model_dirs):
    shard = Shard(tiny_config(tiny_model_dirs["llama"], **LIMITS), show_progress=False)
    folder = short_socket_dir()
    server = BackgroundServer(shard, ServerConfig(uds_path=str(folder / "s"), max_batch_size=4))
    server.stub.Warmup(
        tgi_warmup_request(
            LIMITS["max_input_tokens"], LIMITS["max_prefill_tokens"], LIMITS["max_total_tokens"], 4
        )
    )
    yield server.stub
    server.close()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def hf(tiny_model_dirs):
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dirs["llama"], dtype=torch.float32
    ).eval()


def generate(stub, request, batch_id):
    """All generations of one request, through Prefill and Decode."""
    response = stub.Prefill(
        pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=[request], size=1))
    )
    out = list(response.generations)
    while response.HasField("batch"):
        response = stub.Decode(pb.DecodeRequest(batches=[response.batch]))
        out += response.generations
    return out


def request(i, max_new_tokens=12, **parameters):
    message = text_request(i, PROMPT, max_new_tokens)
    for key, value in parameters.items():
        setattr(message.parameters, key, value)
    return message


def log_softmax_per_step(hf, prompt_ids, generated):
    """transformers' log-softmax at every position that produced a generated token."""
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt_ids + generated])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(generated)]


def prompt_ids(tiny_model_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])(PROMPT)["input_ids"]


def test_chosen_and_prompt_logprobs_equal_transformers(stub, hf, tiny_model_dirs):
    message = request(1)
    message.prefill_logprobs = True
    out = generate(stub, message, 1)
    ids = prompt_ids(tiny_model_dirs)
    generated = [g.tokens.ids[0] for g in out]
    reference = log_softmax_per_step(hf, ids, generated)
    assert generated == reference.argmax(-1).tolist()
    assert [g.tokens.logprobs[0] for g in out] == pytest.approx(
        reference.gather(1, torch.tensor(generated)[:, None]).squeeze(1).tolist(), abs=1e-4
    )
    assert list(out[0].prefill_tokens.ids) == ids


def test_same_seed_same_tokens_different_seed_different(stub):
    runs = [
        generate(stub, request(10 + i, do_sample=True, seed=seed, temperature=1.2), 10 + i)
        for i, seed in enumerate((5, 5, 6))
    ]
    tokens = [[g.tokens.ids[0] for g in run] for run in runs]
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2]
    assert runs[0][-1].generated_text.seed == 5 and runs[2][-1].generated_text.seed == 6


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_top_k_and_top_p_stay_inside_the_allowed_set(stub, hf, tiny_model_dirs, seed):
    ids = prompt_ids(tiny_model_dirs)
    top_k = generate(stub, request(20, max_new_tokens=16, do_sample=True, seed=seed, top_k=3), 20)
    tokens = [g.tokens.ids[0] for g in top_k]
    allowed = log_softmax_per_step(hf, ids, tokens).topk(3).indices
    assert all(token in allowed[step].tolist() for step, token in enumerate(tokens))

    top_p = generate(stub, request(21, max_new_tokens=16, do_sample=True, seed=seed, top_p=0.3), 21)
    tokens = [g.tokens.ids[0] for g in top_p]
    probs = log_softmax_per_step(hf, ids, tokens).exp()
    for step, token in enumerate(tokens):
        ordered, order = probs[step].sort(descending=True)
        # the smallest prefix of the sorted distribution whose mass reaches 0.3
        keep = int((ordered.cumsum(0) < 0.3).sum()) + 1
        assert token in order[:keep].tolist()


def test_repetition_penalty_matches_transformers_processor(stub, hf, tiny_model_dirs):
    ids = prompt_ids(tiny_model_dirs)
    out = generate(stub, request(30, max_new_tokens=16, repetition_penalty=1.8), 30)
    hf.generation_config.eos_token_id = None
    with torch.inference_mode():
        expected = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.8,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pad_token_id=0,
        )
    assert [g.tokens.ids[0] for g in out] == expected[0, len(ids) :].tolist()


def test_stop_sequence_and_grammars_over_the_wire(stub):
    free = generate(stub, request(40, max_new_tokens=10), 40)
    text = "".join(free[2].tokens.texts) + "".join(free[3].tokens.texts)
    message = request(41, max_new_tokens=10)
    message.stopping_parameters.stop_sequences.append(text[-3:])
    stopped = generate(stub, message, 41)[-1].generated_text
    assert stopped.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and stopped.generated_tokens <= 4

    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
    }
    message = request(
        42, max_new_tokens=30, grammar=json.dumps(schema), grammar_type=pb.GRAMMAR_TYPE_JSON
    )
    message.stopping_parameters.ignore_eos_token = False
    assert json.loads(generate(stub, message, 42)[-1].generated_text.text)["answer"] in {
        "yes",
        "no",
    }

    message = request(
        43, max_new_tokens=30, grammar=r"[0-9]{2}:[0-9]{2}", grammar_type=pb.GRAMMAR_TYPE_REGEX
    )
    message.stopping_parameters.ignore_eos_token = False
    assert re.fullmatch(r"[0-9]{2}:[0-9]{2}", generate(stub, message, 43)[-1].generated_text.text)
