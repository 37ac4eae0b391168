"""Reasoning output (router/http/reasoning.py): the split of `<think>...</think>` from the answer,
whole and streamed, and the grammar that constrains the answer after the reasoning
(engine/grammar.py after_reasoning). End to end: a tiny random Qwen3 whose chat template opens the
block and whose `</think>` is brought forward by a logit bias, served by real shard and router
processes, through the `openai` client; the expected split is cut by hand from the same greedy
reply taken raw from /v1/completions, which parses nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.batch import GrammarType
from engine.errors import InvalidRequestError
from router.http.chat import check_template_kwargs
from router.http.reasoning import (
    PARSERS,
    Phase,
    ReasoningStream,
    ReplyReasoning,
    parser_for,
)
from router.http.validation import ValidationError
from tests.models import build_tiny_model

CI = os.environ.get("CI", "").lower() == "true"
QWEN3, R1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]


def streamed(parser, phase, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(parser, phase)
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


def whole(parser, phase, text: str) -> tuple[str, str]:
    split = parser.split(text, phase)
    return split.reasoning or "", split.content


# --- the split ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parser, phase, text, reasoning, content",
    [
        (QWEN3, Phase.LEADING, "<think>\nplan\n</think>\n\nanswer", "plan", "answer"),
        (QWEN3, Phase.LEADING, "\n<think>a</think>b", "a", "b"),
        (QWEN3, Phase.LEADING, "no block</think> here", None, "no block</think> here"),
        (QWEN3, Phase.LEADING, "<think>cut short", "cut short", ""),
        (QWEN3, Phase.LEADING, "<thi", None, "<thi"),
        (QWEN3, Phase.REASONING, "plan</think>answer</think>", "plan", "answer</think>"),
        (QWEN3, Phase.ANSWER, "<think>x</think>y", None, "<think>x</think>y"),
        (R1, Phase.LEADING, "plan\n</think>\n\nanswer", "plan", "answer"),
        (R1, Phase.LEADING, "<think>plan</think>answer", "plan", "answer"),
        (R1, Phase.LEADING, "all reasoning", "all reasoning", ""),
        (R1, Phase.ANSWER, "answer</think>", None, "answer</think>"),
    ],
)
def test_split(parser, phase, text, reasoning, content):
    split = parser.split(text, phase)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_the_prompt_says_where_the_reply_starts():
    assert QWEN3.first_phase("<|im_start|>assistant\n") is Phase.LEADING
    assert QWEN3.first_phase("<|im_start|>assistant\n<think>\n") is Phase.REASONING
    assert QWEN3.first_phase("assistant\n<think>\n\n</think>\n\n") is Phase.ANSWER
    assert R1.first_phase("<｜Assistant｜>") is Phase.LEADING


def test_auto_picks_the_parser_from_the_template():
    assert parser_for("auto", "{{ '<think>' }}...{{ '</think>' }}") is QWEN3
    assert parser_for("auto", "{% set c = c.split('</think>')[-1] %}") is R1
    assert parser_for("auto", "<｜Assistant｜><think>\n ... </think>") is R1
    assert parser_for("auto", "{{ messages }}") is None
    assert parser_for("auto", None) is None
    assert parser_for("none", "<think></think>") is None
    assert parser_for("deepseek_r1", None) is R1


def test_grammar_blocks():
    assert QWEN3.grammar_block(Phase.LEADING) == ("<think>", "</think>")
    assert QWEN3.grammar_block(Phase.REASONING) == ("", "</think>")
    assert R1.grammar_block(Phase.LEADING) == ("", "</think>")
    assert QWEN3.grammar_block(Phase.ANSWER) is None


# --- the split of a stream ------------------------------------------------------------------------

TEXTS = [
    "<think>\nplan it\n</think>\n\nthe answer",
    "  <think>a </think> b",
    "<think>x</thin></think>y",
    "<think>unfinished </thi",
    "<thinker>not a block",
    "plan </think>  answer </think>",
    "<thi",
    "   ",
]


@pytest.mark.parametrize("parser", [QWEN3, R1], ids=["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("phase", list(Phase), ids=[p.value for p in Phase])
@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_cut_anywhere_splits_as_the_whole_text(parser, phase, text):
    """Every place a text may be cut in two, and into single characters: a tag split across
    pieces (and whitespace beside it) ends up where the whole text puts it."""
    expected = whole(parser, phase, text)
    for cut in range(len(text) + 1):
        assert streamed(parser, phase, [text[:cut], text[cut:]]) == expected, cut
    assert streamed(parser, phase, list(text)) == expected


FRAGMENTS = st.sampled_from(
    ["<think>", "</think>", "<", "</", "think", ">", "\n", " ", "\n\n", "a", "é", "{", "}", "x y"]
)


@settings(max_examples=400, deadline=None, derandomize=CI)
@given(
    parser=st.sampled_from([QWEN3, R1]),
    phase=st.sampled_from(list(Phase)),
    fragments=st.lists(FRAGMENTS, max_size=16),
    cuts=st.lists(st.integers(0, 64), max_size=8),
)
def test_random_streams_split_as_the_whole_text(parser, phase, fragments, cuts):
    text = "".join(fragments)
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    assert streamed(parser, phase, pieces) == whole(parser, phase, text)


def test_reasoning_tokens_count_the_block_and_its_tags():
    reply = ReplyReasoning(QWEN3, Phase.LEADING)
    assert reply.tokens(["<think>", "\n", "plan", "</think>", "\n\n", "answer"]) == 4
    assert reply.tokens(["\n", "answer", "<think>"]) == 0
    assert ReplyReasoning(QWEN3, Phase.REASONING).tokens(["a", "</", "think>", "b"]) == 3
    assert ReplyReasoning(R1, Phase.LEADING).tokens(["a", "b"]) == 2


def test_template_kwargs_may_not_set_the_templates_call():
    class Tokenizer:
        def apply_chat_template(self, conversation, tools=None, tokenize=True, **kwargs):
            pass

    check_template_kwargs(Tokenizer(), {"enable_thinking": False})
    for name in ("tokenize", "tools", "messages", "not a name"):
        with pytest.raises(ValidationError, match="chat_template_kwargs"):
            check_template_kwargs(Tokenizer(), {name: True})


# --- the grammar after the reasoning --------------------------------------------------------------


@pytest.fixture(scope="module")
def think_tokenizer(smollm_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.fixture(scope="module")
def compiler(think_tokenizer):
    from engine.grammar import GrammarCompiler

    return GrammarCompiler(think_tokenizer, len(think_tokenizer), frozenset([2]))


ANSWER = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}})


def accepts(compiler, tokenizer, reasoning, text: str, *, complete: bool = True) -> bool:
    state = compiler.new_state(compiler.compile(GrammarType.JSON, ANSWER, reasoning=reasoning))
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if not state.allowed_mask()[token]:
            return False
        state.advance(token)
    return state.is_complete or not complete


def test_the_grammar_constrains_the_answer_after_the_reasoning(compiler, think_tokenizer):
    opened = ("", "</think>")  # the prompt opened the block
    check = lambda text, reasoning=opened: accepts(compiler, think_tokenizer, reasoning, text)  # noqa: E731
    assert check('free "text" {not json</think>\n\n{"ok": true}')
    assert check('</think>{"ok": false}')
    assert not check("plan</think>\n\nnot json")
    assert not check('{"ok": true}')  # the block is not optional when the prompt opened it
    optional = ("<think>", "</think>")
    assert check('<think>\nplan</think>\n\n{"ok": true}', optional)
    assert check('{"ok": true}', optional)
    assert not check('plan</think>{"ok": true}', optional)
    assert not check('plan</think>{"ok": true}', ("", ""))  # no block: the whole text is JSON


def test_a_closing_tag_spelled_in_pieces_ends_the_block(compiler, think_tokenizer):
    pieces = think_tokenizer("plan </", add_special_tokens=False)["input_ids"]
    state = compiler.new_state(
        compiler.compile(GrammarType.JSON, ANSWER, reasoning=("", "</think>"))
    )
    for token in pieces + think_tokenizer("think>", add_special_tokens=False)["input_ids"]:
        state.advance(token)
    assert not state.failed
    assert not state.allowed_mask()[think_tokenizer.convert_tokens_to_ids("</think>")]
    assert state.allowed_mask()[think_tokenizer('{"', add_special_tokens=False)["input_ids"][0]]


def test_an_opening_tag_needs_a_closing_one(compiler):
    with pytest.raises(InvalidRequestError, match="grammar_reasoning_end"):
        compiler.compile(GrammarType.JSON, ANSWER, reasoning=("<think>", ""))


# --- end to end: a tiny Qwen3 that thinks -----------------------------------------------------------

# Qwen3's switch, in a template that opens the block for the model (as DeepSeek-R1's later ones do)
THINK_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
MAX_TOKENS = 80
MAX_REASONING = 24  # tokens, so that the answer has room
ASK = [{"role": "user", "content": "Is it going to rain in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
VERDICT = {"type": "object", "properties": {"rain": {"type": "boolean"}}, "required": ["rain"]}


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, think_tokenizer, smollm_dir) -> Path:
    model_dir = build_tiny_model(
        "qwen3",
        tmp_path_factory.mktemp("reasoning") / "qwen3-think",
        smollm_dir,
        variants={"qwen3": ("Qwen3Config", dict(tie_word_embeddings=False))},
        vocab_size=len(think_tokenizer) + 62,
        max_position_embeddings=2048,
    )
    think_tokenizer.save_pretrained(model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").write_text(THINK_TEMPLATE)
    return model_dir


@pytest.fixture(scope="module")
def url(thinking_model):
    from tests.test_router_http import shard_and_router
    from tests.test_router_tools import LIMITS, SHARD_LIMITS
    from tests.test_server import short_socket_dir

    # the router's default, --reasoning-parser auto, finds `<think>` in the template: qwen3's
    with shard_and_router(thinking_model, short_socket_dir() / "r", SHARD_LIMITS, LIMITS) as served:
        yield served[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def raw_reply(url: str, bias: dict, **fields) -> tuple[str, list[str]]:
    """The greedy reply as text and token texts, unparsed: the templated prompt's tokens (of a
    chat request with `fields`) through /v1/completions."""
    body = {"messages": ASK, **fields}
    tokens = httpx.post(f"{url}/chat_tokenize", json=body, timeout=60).json()["tokenize_response"]
    completion = {
        "prompt": [t["id"] for t in tokens],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logit_bias": bias,
        "logprobs": 0,
    }
    reply = httpx.post(f"{url}/v1/completions", json=completion, timeout=60).json()["choices"][0]
    return reply["text"], reply["logprobs"]["tokens"]


def steer(url: str, think_tokenizer, **fields) -> tuple[dict, str, int]:
    """A logit bias on `</think>` that closes the block after a few tokens of reasoning, for the
    prompt of a chat request with `fields`, and the unparsed greedy reply under it: (bias, text,
    index of the `</think>` token)."""
    end = think_tokenizer.convert_tokens_to_ids("</think>")
    for value in (2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30):
        text, tokens = raw_reply(url, {str(end): value}, **fields)
        if "</think>" in tokens and 3 <= tokens.index("</think>") < MAX_REASONING:
            if text.partition("</think>")[2].strip():
                return {str(end): value}, text, tokens.index("</think>")
    pytest.fail("no logit bias brings `</think>` a few tokens into the reply")


@pytest.fixture(scope="module")
def steered(url, think_tokenizer):
    return steer(url, think_tokenizer)


def expected_split(text: str) -> tuple[str, str]:
    reasoning, _, answer = text.partition("</think>")
    return reasoning.strip(), answer.lstrip()


def chat(client, bias, **extra):
    return client.chat.completions.create(
        model="tgi",
        messages=ASK,
        temperature=0,
        max_tokens=MAX_TOKENS,
        logit_bias=bias,
        **extra,
    )


@pytest.mark.slow
def test_chat_completions_split_the_reasoning(client, steered):
    bias, text, end = steered
    reasoning, answer = expected_split(text)
    reply = chat(client, bias)
    message = reply.choices[0].message
    assert reasoning and answer
    assert (message.reasoning_content, message.content) == (reasoning, answer)
    assert reply.usage.completion_tokens_details.reasoning_tokens == end + 1


@pytest.mark.slow
def test_a_stream_sends_the_reasoning_as_its_own_deltas(client, steered):
    bias, text, end = steered
    chunks = list(chat(client, bias, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    said = [d.content for d in deltas if d.content]
    assert ("".join(thought), "".join(said)) == expected_split(text)
    assert len(thought) > 1  # streamed as it came, not once at the end
    first_said = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first_said:])
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == end + 1


@pytest.mark.slow
def test_enable_thinking_false_reaches_the_template(client, url, steered):
    bias = steered[0]
    text, _ = raw_reply(url, bias, chat_template_kwargs={"enable_thinking": False})
    extra_body = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(client, bias, extra_body=extra_body).choices[0].message
    assert (message.reasoning_content, message.content) == (None, text)
    with pytest.raises(openai.UnprocessableEntityError, match="tokenize"):
        chat(client, bias, extra_body={"chat_template_kwargs": {"tokenize": True}})


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_is_constrained_after_the_reasoning(client, url, think_tokenizer, stream):
    choice = {"type": "function", "function": {"name": "weather"}}
    bias, text, _ = steer(url, think_tokenizer, tools=[WEATHER], tool_choice=choice)
    reply = chat(client, bias, tools=[WEATHER], tool_choice=choice, stream=stream)
    if stream:
        deltas = [c.choices[0].delta for c in reply if c.choices]
        thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        calls = [call for d in deltas for call in d.tool_calls or []]
    else:
        message = reply.choices[0].message
        thought, calls = message.reasoning_content, message.tool_calls
    assert thought == expected_split(text)[0]
    assert [call.function.name for call in calls] == ["weather"]
    arguments = json.loads(calls[0].function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


@pytest.mark.slow
def test_a_json_schema_answer_follows_the_reasoning(client, steered):
    bias, text, _ = steered
    response_format = {"type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT}}
    message = chat(client, bias, response_format=response_format).choices[0].message
    assert message.reasoning_content == expected_split(text)[0]
    jsonschema.validate(json.loads(message.content), VERDICT)


# --- Anthropic's Messages API: a `thinking` block -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_return_the_reasoning_as_a_thinking_block(url, steered, stream):
    import anthropic

    bias, text, _ = steered
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    request = dict(
        model="tgi",
        max_tokens=MAX_TOKENS,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0, "logit_bias": bias},
    )
    if stream:
        with client.messages.stream(**request) as events:
            kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
            reply = events.get_final_message()
        assert kinds[0] == "thinking_delta"
    else:
        reply = client.messages.create(**request)
    assert [block.type for block in reply.content] == ["thinking", "text"]
    assert (reply.content[0].thinking, reply.content[1].text) == expected_split(text)


@pytest.mark.slow
def test_messages_thinking_disabled_reaches_the_template(url, steered):
    import anthropic

    bias = steered[0]
    text, _ = raw_reply(url, bias, chat_template_kwargs={"enable_thinking": False})
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    reply = client.messages.create(
        model="tgi",
        max_tokens=MAX_TOKENS,
        messages=ASK,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0, "logit_bias": bias},
    )
    assert [(block.type, block.text) for block in reply.content] == [("text", text)]


# --- OpenAI's Responses API: a `reasoning` item ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_return_the_reasoning_as_an_item(client, steered, stream):
    bias, text, end = steered
    request = dict(
        model="tgi",
        input=ASK[0]["content"],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        reasoning={"effort": "medium"},
        extra_body={"logit_bias": bias},
    )
    if stream:  # the reply reaches max_output_tokens: it ends with `response.incomplete`
        events = list(client.responses.create(**request, stream=True))
        kinds = [event.type for event in events]
        response = events[-1].response
        assert "response.reasoning_text.delta" in kinds
    else:
        response = client.responses.create(**request)
    reasoning, message = response.output
    assert (reasoning.type, message.type) == ("reasoning", "message")
    assert (reasoning.content[0].text, message.content[0].text) == expected_split(text)
    assert response.usage.output_tokens_details.reasoning_tokens == end + 1


@pytest.mark.slow
def test_responses_effort_none_switches_thinking_off(client, url, steered):
    bias = steered[0]
    text, _ = raw_reply(url, bias, chat_template_kwargs={"enable_thinking": False})
    response = client.responses.create(
        model="tgi",
        input=ASK[0]["content"],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        reasoning={"effort": "none"},
        extra_body={"logit_bias": bias},
    )
    assert [item.type for item in response.output] == ["message"]
    assert response.output[0].content[0].text == text
    assert response.usage.output_tokens_details.reasoning_tokens == 0
