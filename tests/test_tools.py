"""Tool calling's grammar (router/http/tools.py) on the shard's grammar compiler and the embedded tokenizer.

The "model" draws each token at temperature 1 from random logits over the tokens the grammar allows, many
times over hypothesis-generated tool schemas: every reply must parse into calls of declared functions whose
arguments validate against the function's schema (jsonschema), or, under `auto`, into text.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from transformers import AutoTokenizer

from engine.batch import GrammarType
from engine.grammar import GrammarCompiler
from router.http import tools
from router.http.validation import ValidationError
from tests.tool_schemas import tools as tool_lists

VOCAB = 49152 + 64
EOS = 2
MAX_TOKENS = 300
RUNS_PER_SCHEMA = 3     # 34 schemas x 3 = 102 sampled replies
TEXT_START, TEXT_CHECK = '{"content": "', 8


@pytest.fixture(scope="module")
def compiler(smollm_dir):
    return GrammarCompiler(AutoTokenizer.from_pretrained(smollm_dir), VOCAB, frozenset({EOS}))


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    return AutoTokenizer.from_pretrained(smollm_dir)


def sample_reply(compiler, tokenizer, grammar, seed: int) -> tuple[str, bool]:
    """Temperature-1 draws from random logits, masked by the grammar, until EOS; the text and whether EOS came."""
    state = compiler.new_state(compiler.compile(GrammarType.JSON, json.dumps(grammar.value)))
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(MAX_TOKENS):
        # Random logits on the allowed tokens only: the same draw as masking the whole vocabulary, far cheaper.
        allowed = state.allowed_mask().nonzero().squeeze(1)
        logits = torch.randn(allowed.numel(), generator=generator)
        token = int(allowed[torch.multinomial(logits.softmax(0), 1, generator=generator)])
        if token == EOS:
            return tokenizer.decode(tokens), True
        state.advance(token)
        tokens.append(token)
        if len(tokens) == TEXT_CHECK and tokenizer.decode(tokens).startswith(TEXT_START):
            break   # random logits rarely close a free-text string: stop once the reply is text
    return tokenizer.decode(tokens), False


def check_calls(reply: tools.Reply, declared: list[dict], allowed_names: set[str]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in declared}
    assert reply.tool_calls and reply.content is None
    for call in reply.tool_calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] in allowed_names
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


@settings(max_examples=34, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # shrinking a sampled run takes minutes
@given(declared=tool_lists(), choice=st.sampled_from(["required", "auto", "named"]), parallel=st.booleans())
def test_sampled_replies_always_validate(compiler, tokenizer, declared, choice, parallel):
    named = declared[-1]["function"]["name"]
    tool_choice = {"type": "function", "function": {"name": named}} if choice == "named" else choice
    request_tools = [tools.Tool.model_validate(t) for t in declared]
    tool_choice = tools.NamedToolChoice.model_validate(tool_choice) if choice == "named" else tool_choice
    plan = tools.plan(request_tools, tool_choice, parallel)
    allowed_names = {named} if choice == "named" else {t["function"]["name"] for t in declared}
    for seed in range(RUNS_PER_SCHEMA):
        text, finished = sample_reply(compiler, tokenizer, plan.grammar, seed)
        if not finished:  # only `auto` allows the text branch
            assert choice == "auto" and text.startswith(TEXT_START), text
            continue
        reply = tools.parse_reply(text)
        assert reply is not None, text
        if reply.content is not None:
            assert choice == "auto" and not reply.tool_calls
            continue
        check_calls(reply, declared, allowed_names)
        assert parallel or len(reply.tool_calls) == 1


def test_none_sends_no_grammar_and_no_tools():
    declared = [tools.Tool.model_validate({"type": "function", "function": {"name": "f"}})]
    plan = tools.plan(declared, "none", None)
    assert plan.grammar is None and plan.tools == [] and not plan.active


@pytest.mark.parametrize("declared, choice, message", [
    ([{"type": "function", "function": {"name": "f"}}], {"type": "function", "function": {"name": "g"}},
     "names 'g', which is not in `tools`"),
    ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tool name 'bad name'"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, "auto", "repeated: f"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "auto",
     "tool 'f': `parameters` is not a valid JSON schema"),
])
def test_bad_tools_are_validation_errors(declared, choice, message):
    request_tools = [tools.Tool.model_validate(t) for t in declared]
    if isinstance(choice, dict):
        choice = tools.NamedToolChoice.model_validate(choice)
    with pytest.raises(ValidationError, match=message.replace("(", r"\(")):
        tools.plan(request_tools, choice, None)


def test_a_reply_cut_short_keeps_its_text_and_length():
    message, reason = tools.reply_message('{"calls": [{"name": "f", "argu', "length")
    assert message == {"role": "assistant", "content": '{"calls": [{"name": "f", "argu'} and reason == "length"
    message, reason = tools.reply_message('{"calls": [{"name": "f", "arguments": {"a": 1}}]}', "stop")
    assert reason == "tool_calls" and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1}


def test_a_template_without_tools_gets_them_as_a_system_message(tokenizer):
    from router.http import chat

    declared = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [chat.template_message("user", "Weather?", None, None, None),
                chat.template_message("assistant", "", [call], None, None),
                chat.template_message("tool", "sunny", None, "call_1", None)]
    assert not chat.template_reads_tools(tokenizer)   # the embedded model's template knows no tools
    prompt = chat.render(tokenizer, messages, declared)
    assert prompt.startswith("<|im_start|>system\n" + chat.TOOLS_INTRO)
    assert '"name": "weather"' in prompt and '{"city": "Oslo"}' in prompt and "<|im_start|>tool\nsunny" in prompt
    assert "You are a helpful AI assistant named SmolLM" not in prompt   # our system message replaced the default
    assert chat.render(tokenizer, messages[:1], []).startswith("<|im_start|>system\nYou are a helpful AI")
