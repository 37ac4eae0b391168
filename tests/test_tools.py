"""Tool calling's grammar (router/http/tools.py) and JSON-schema replies on the shard's grammar
compiler and the embedded tokenizer.

The "model" draws each token at temperature 1 from random logits over the tokens the grammar
allows, many times over hypothesis-generated tool schemas: every reply must parse into calls of
declared functions whose arguments validate against the function's schema (jsonschema), or, under
`auto`, into text. Under CI=true the examples are derandomized, so every run samples the same 200
replies of each kind.
"""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine.batch import GrammarType
from engine.errors import InvalidRequestError
from engine.grammar import GrammarCompiler
from engine.grammar_schema import FORMATS
from router.http import tools
from router.http.openai_api import response_grammar
from router.http.validation import ValidationError
from tests.tool_schemas import schema_tree
from tests.tool_schemas import tools as tool_lists

VOCAB = 49152 + 64
EOS = 2
MAX_TOKENS = 300
SCHEMAS = 100  # random schemas per test
RUNS_PER_SCHEMA = 2  # 100 schemas x 2 = 200 sampled replies
TEXT_START, TEXT_CHECK = '{"content": "', 8
CI = os.environ.get("CI", "").lower() == "true"
SAMPLED = settings(
    max_examples=SCHEMAS,
    deadline=None,
    derandomize=CI,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)  # shrinking a sampled run takes minutes
FORMAT_CHECKER = jsonschema.FormatChecker()
# The replies that failed before bounded strings excluded control characters (a raw \x11 in a
# JSON string), as tools.
BOUNDED_STRINGS = [
    {
        "type": "function",
        "function": {
            "name": "clock",
            "parameters": {
                "type": "object",
                "properties": {
                    "zone": {"type": "string", "maxLength": 6},
                    "note": {"type": "string", "minLength": 2, "maxLength": 5},
                },
                "required": ["zone", "note"],
            },
        },
    }
]
WEATHER_AND_SUM = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add_numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]

# References are relative to a tool's parameters, which sit deep inside the reply's grammar.
RECURSIVE = {
    "type": "function",
    "function": {
        "name": "tree",
        "parameters": {
            "type": "object",
            "$defs": {"leaf": {"enum": [1, 2]}},
            "properties": {
                "value": {"$ref": "#/$defs/leaf"},
                "next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]},
            },
            "required": ["value", "next"],
        },
    },
}

# The reply that once put an encoded surrogate (ED BE 96: three U+FFFD once decoded) in a string of
# maxLength 4, found by the derandomized run: two tools whose arguments share a `$defs` array.


def _shared_strings(min_items: int, max_items: int) -> dict:
    strings = {"type": "string", "minLength": 2, "maxLength": 4}
    array = {"type": "array", "items": strings, "minItems": min_items, "maxItems": max_items}
    empty = {"type": "object", "properties": {}, "required": [], "additionalProperties": False}
    other = {"type": "object", "properties": {"kbhsf": empty}, "required": ["kbhsf"]}
    return {
        "type": "object",
        "$defs": {"shared": array},
        "properties": {"_": {"$ref": "#/$defs/shared"}, "__other": other},
        "required": ["_"],
    }


SURROGATE_IN_SHARED_STRING = [
    {"type": "function", "function": {"name": "lvfgoq_", "parameters": _shared_strings(0, 2)}},
    {"type": "function", "function": {"name": "bk", "parameters": _shared_strings(2, 4)}},
]


@pytest.fixture(scope="module")
def compiler(smollm_dir):
    return GrammarCompiler(AutoTokenizer.from_pretrained(smollm_dir), VOCAB, frozenset({EOS}))


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    return AutoTokenizer.from_pretrained(smollm_dir)


def sample_reply(
    compiler, tokenizer, schema, seed: int, stop_at_text: bool = True
) -> tuple[str, bool]:
    """Temperature-1 draws from random logits, masked by the grammar, until EOS; the text and whether EOS came."""
    state = compiler.new_state(compiler.compile(GrammarType.JSON, json.dumps(schema)))
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
        if (
            stop_at_text
            and len(tokens) == TEXT_CHECK
            and tokenizer.decode(tokens).startswith(TEXT_START)
        ):
            break  # random logits rarely close a free-text string: stop once the reply is text
    return tokenizer.decode(tokens), False


def check_calls(reply: tools.Reply, declared: list[dict], allowed_names: set[str]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in declared}
    assert reply.tool_calls and reply.content is None
    for call in reply.tool_calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] in allowed_names
        jsonschema.validate(
            json.loads(call["function"]["arguments"]),
            schemas[call["function"]["name"]],
            format_checker=FORMAT_CHECKER,
        )


def request_plan(
    declared: list[dict], choice: str, parallel: bool | None
) -> tuple[tools.ToolPlan, set[str]]:
    named = declared[-1]["function"]["name"]
    request_tools = [tools.Tool.model_validate(t) for t in declared]
    tool_choice = choice
    if choice == "named":
        tool_choice = tools.NamedToolChoice.model_validate(
            {"type": "function", "function": {"name": named}}
        )
    allowed_names = {named} if choice == "named" else {t["function"]["name"] for t in declared}
    return tools.plan(request_tools, tool_choice, parallel), allowed_names


@SAMPLED
@given(
    declared=tool_lists(),
    choice=st.sampled_from(["required", "auto", "named"]),
    parallel=st.booleans(),
)
@example(declared=BOUNDED_STRINGS, choice="required", parallel=True)
@example(declared=BOUNDED_STRINGS, choice="named", parallel=True)
@example(declared=WEATHER_AND_SUM, choice="required", parallel=True)
@example(declared=WEATHER_AND_SUM, choice="named", parallel=True)
@example(declared=[*WEATHER_AND_SUM, RECURSIVE], choice="required", parallel=True)
@example(declared=[RECURSIVE], choice="named", parallel=False)
@example(declared=SURROGATE_IN_SHARED_STRING, choice="auto", parallel=True)
def test_sampled_replies_always_validate(compiler, tokenizer, declared, choice, parallel):
    plan, allowed_names = request_plan(declared, choice, parallel)
    for seed in range(RUNS_PER_SCHEMA):
        text, finished = sample_reply(compiler, tokenizer, plan.grammar.value, seed)
        if not finished and text.startswith(TEXT_START):  # only `auto` allows the text branch
            assert choice == "auto", text
            continue
        if not finished:  # random logits may keep adding parallel calls past MAX_TOKENS
            assert parallel and choice != "named" and text.startswith(tools.CALLS_START), text
            continue
        reply = tools.parse_reply(text)
        assert reply is not None, text
        if reply.content is not None:
            assert choice == "auto" and not reply.tool_calls
            continue
        check_calls(reply, declared, allowed_names)
        assert (parallel and choice != "named") or len(reply.tool_calls) == 1
        message, reason = tools.reply_message(text, "stop", plan)  # the router's own check agrees
        assert reason == "tool_calls" and len(message["tool_calls"]) == len(reply.tool_calls), text


@SAMPLED
@given(schema=schema_tree(), seed=st.integers(0, 2**16))
@example(schema=BOUNDED_STRINGS[0]["function"]["parameters"], seed=3)  # once a raw \x11 in "zone"
@example(schema=BOUNDED_STRINGS[0]["function"]["parameters"], seed=47)  # once a raw \x08 in "note"
def test_sampled_json_schema_replies_always_validate(compiler, tokenizer, schema, seed):
    """`response_format: json_schema` (and TGI's JSON grammar): every finished reply validates."""
    response_grammar(
        {"type": "json_schema", "json_schema": {"schema": schema}}
    )  # accepted by the router
    for run in range(seed, seed + RUNS_PER_SCHEMA):
        text, finished = sample_reply(compiler, tokenizer, schema, run, stop_at_text=False)
        assert finished, text
        jsonschema.validate(json.loads(text), schema, format_checker=FORMAT_CHECKER)


# Every supported keyword, alone and in the combinations that take another path through the grammar.
STRING = {"type": "string"}
KEYWORD_CASES = {
    "maxLength": {**STRING, "maxLength": 5},
    "maxLength 0": {**STRING, "maxLength": 0},
    "minLength": {**STRING, "minLength": 3},
    "minLength maxLength": {**STRING, "minLength": 2, "maxLength": 4},
    "minLength = maxLength": {**STRING, "minLength": 3, "maxLength": 3},
    "pattern": {**STRING, "pattern": r"[a-c]{2}\d"},
    **{f"format {f}": {**STRING, "format": f} for f in sorted(FORMATS)},
    "integer bounds": {"type": "integer", "minimum": -3, "maximum": 12},
    "integer exclusive bounds": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4},
    "number bounds": {"type": "number", "minimum": -1.5, "maximum": 2.25},
    "number exclusive bounds": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "type list": {"type": ["boolean", "null"]},
    "enum": {"enum": ["a", 1, None, True, {"k": [1]}]},
    "const": {"const": {"x": 'y"z'}},
    "anyOf": {
        "anyOf": [{**STRING, "maxLength": 2}, {"type": "integer", "minimum": 0, "maximum": 5}]
    },
    "items minItems maxItems": {
        "type": "array",
        "items": {"type": "boolean"},
        "minItems": 1,
        "maxItems": 3,
    },
    "prefixItems": {
        "type": "array",
        "prefixItems": [{"type": "null"}, {"enum": ["p"]}],
        "items": False,
    },
    "properties required": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}},
        "required": ["b"],
    },
    "additionalProperties schema": {
        "type": "object",
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "additionalProperties false": {
        "type": "object",
        "properties": {"a": {"type": "null"}},
        "additionalProperties": False,
    },
    "$ref $defs": {
        "$defs": {"d": {**STRING, "maxLength": 3}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/d"}},
        "required": ["a"],
    },
    "$ref definitions": {
        "definitions": {"d": {"enum": [1, 2]}},
        "type": "array",
        "items": {"$ref": "#/definitions/d"},
        "maxItems": 2,
    },
    "$ref #": {
        "type": "object",
        "properties": {"next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
        "required": ["next"],
    },
    "annotations": {
        "title": "T",
        "description": "D",
        "default": "x",
        "examples": ["x"],
        "$comment": "c",
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **STRING,
        "maxLength": 2,
        "deprecated": False,
        "readOnly": False,
        "writeOnly": False,
        "$id": "urn:t",
    },
}


@pytest.mark.parametrize("name", sorted(KEYWORD_CASES))
def test_every_keyword_case_validates(compiler, tokenizer, name):
    schema, finished_runs = KEYWORD_CASES[name], 0
    for seed in range(6):
        text, finished = sample_reply(compiler, tokenizer, schema, seed, stop_at_text=False)
        # A string without maxLength may run past the token limit: what came has no control character.
        assert not any(ord(c) < 0x20 for c in text), repr(text)
        if finished:
            jsonschema.validate(json.loads(text), schema, format_checker=FORMAT_CHECKER)
            finished_runs += 1
    assert finished_runs >= 2


REFUSED = {
    "allOf": {"allOf": [{"type": "integer"}, {"minimum": 3}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "not": {"not": {"type": "integer"}},
    "if": {"if": {"type": "integer"}, "then": {"minimum": 1}},
    "uniqueItems": {"type": "array", "uniqueItems": True},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "minProperties": {"type": "object", "minProperties": 1},
    "maxProperties": {"type": "object", "maxProperties": 1},
    "patternProperties": {"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
    "propertyNames": {"type": "object", "propertyNames": {"maxLength": 2}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "multipleOf": {"type": "integer", "multipleOf": 3},
    "unevaluatedProperties": {"type": "object", "unevaluatedProperties": False},
    "nullable": {"type": "string", "nullable": True},
    **{
        f"format {f}": {"type": "string", "format": f}
        for f in ("email", "date", "date-time", "ipv4", "hostname")
    },
    "$ref": {"$ref": "https://example.com/schema.json"},
    "pattern": {"type": "string", "pattern": "caf\u00e9"},
}


@pytest.mark.parametrize("keyword", sorted(REFUSED))
def test_keywords_the_grammar_cannot_enforce_are_refused(compiler, keyword):
    schema = {"type": "object", "properties": {"x": REFUSED[keyword]}, "required": ["x"]}
    declared = [
        tools.Tool.model_validate(
            {"type": "function", "function": {"name": "f", "parameters": schema}}
        )
    ]
    keyword = re.escape(keyword.split()[0])
    with pytest.raises(ValidationError, match=rf"tool 'f'.*`{keyword}`.*at /properties/x"):
        tools.plan(declared, "auto", None)
    with pytest.raises(ValidationError, match=rf"response_format.*`{keyword}`"):
        response_grammar({"type": "json_schema", "json_schema": {"schema": schema}})
    with pytest.raises(InvalidRequestError, match=rf"^parameters.grammar: .*`{keyword}`"):
        compiler.compile(GrammarType.JSON, json.dumps(schema))


def test_a_pattern_that_needs_an_escaped_character_is_refused(compiler):
    with pytest.raises(InvalidRequestError, match="`pattern`.*cannot match inside a JSON string"):
        compiler.compile(GrammarType.JSON, json.dumps({"type": "string", "pattern": r"a\nb"}))


def test_a_named_choice_is_one_call_then_the_end(compiler, tokenizer):
    plan, _ = request_plan(WEATHER_AND_SUM, "named", True)
    assert "calls" not in json.dumps(plan.grammar.value)
    state = compiler.new_state(compiler.compile(GrammarType.JSON, json.dumps(plan.grammar.value)))
    for token in tokenizer.encode(
        '{"name": "add_numbers", "arguments": {"a": 1, "b": 2}}', add_special_tokens=False
    ):
        state.advance(token)
    assert not state.failed and state.is_finished  # nothing but EOS may follow one call
    message, reason = tools.reply_message(
        '{"name": "add_numbers", "arguments": {"a": 1, "b": 2}}', "stop", plan
    )
    assert reason == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == [
        "add_numbers"
    ]


def test_a_list_of_calls_may_close_after_each_call_and_is_bounded(compiler, tokenizer):
    plan, _ = request_plan(WEATHER_AND_SUM, "required", True)
    state = compiler.new_state(compiler.compile(GrammarType.JSON, json.dumps(plan.grammar.value)))
    close, more = tokenizer.convert_tokens_to_ids("]"), tokenizer.convert_tokens_to_ids(",")
    call = '{"name": "add_numbers", "arguments": {"a": 1, "b": 2}}'
    for count in range(1, tools.MAX_PARALLEL_CALLS + 1):
        for token in tokenizer.encode(
            (", " if count > 1 else tools.CALLS_START) + call, add_special_tokens=False
        ):
            state.advance(token)
        mask = state.allowed_mask()
        assert not state.failed and mask[close], count
        assert mask[more] == (count < tools.MAX_PARALLEL_CALLS), count
    single, _ = request_plan(WEATHER_AND_SUM, "required", False)
    assert single.grammar.value["properties"]["calls"]["maxItems"] == 1


def test_a_reply_cut_short_keeps_its_complete_calls():
    plan, _ = request_plan(WEATHER_AND_SUM, "required", True)
    first = '{"name": "add_numbers", "arguments": {"a": 1, "b": 2}}'
    second = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    cut = f'{{"calls": [{first}, {second}, {{"name": "get_weath'
    message, reason = tools.reply_message(cut, "length", plan)
    assert reason == "length" and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"a": 1, "b": 2},
        {"city": "Oslo"},
    ]
    deltas, reason = tools.reply_deltas(f'{{"calls": [{first}, {second}]', "length", plan)
    assert reason == "length" and [d["tool_calls"][0]["index"] for d in deltas] == [0, 1]


def test_a_reply_that_does_not_validate_is_not_a_call():
    plan, _ = request_plan(WEATHER_AND_SUM, "required", True)
    for text in (
        '{"calls": [{"name": "add_numbers", "arguments": {"a": "one", "b": 2}}]}',
        '{"calls": [{"name": "delete_all", "arguments": {}}]}',
    ):
        message, reason = tools.reply_message(text, "stop", plan)
        assert "tool_calls" not in message and message["content"] == text and reason == "stop"
    message, reason = tools.reply_message(
        '{"calls": [{"name": "add_numbers", "arguments": {"a": 1}}, {"na', "length", plan
    )
    assert "tool_calls" not in message and reason == "length"


def test_none_sends_no_grammar_and_no_tools():
    declared = [tools.Tool.model_validate({"type": "function", "function": {"name": "f"}})]
    plan = tools.plan(declared, "none", None)
    assert plan.grammar is None and plan.tools == [] and not plan.active


@pytest.mark.parametrize(
    "declared, choice, message",
    [
        (
            [{"type": "function", "function": {"name": "f"}}],
            {"type": "function", "function": {"name": "g"}},
            "names 'g', which is not in `tools`",
        ),
        ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tool name 'bad name'"),
        ([{"type": "function", "function": {"name": "f"}}] * 2, "auto", "repeated: f"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "auto",
            "tool 'f': `parameters` is not a valid JSON schema",
        ),
    ],
)
def test_bad_tools_are_validation_errors(declared, choice, message):
    request_tools = [tools.Tool.model_validate(t) for t in declared]
    if isinstance(choice, dict):
        choice = tools.NamedToolChoice.model_validate(choice)
    with pytest.raises(ValidationError, match=message.replace("(", r"\(")):
        tools.plan(request_tools, choice, None)


def test_a_reply_cut_short_keeps_its_text_and_length():
    message, reason = tools.reply_message('{"calls": [{"name": "f", "argu', "length")
    assert (
        message == {"role": "assistant", "content": '{"calls": [{"name": "f", "argu'}
        and reason == "length"
    )
    message, reason = tools.reply_message(
        '{"calls": [{"name": "f", "arguments": {"a": 1}}]}', "stop"
    )
    assert reason == "tool_calls" and json.loads(
        message["tool_calls"][0]["function"]["arguments"]
    ) == {"a": 1}


def test_a_template_without_tools_gets_them_as_a_system_message(tokenizer):
    from router.http import chat

    declared = [
        {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    ]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        chat.template_message("user", "Weather?", None, None, None),
        chat.template_message("assistant", "", [call], None, None),
        chat.template_message("tool", "sunny", None, "call_1", None),
    ]
    assert not chat.template_reads_tools(tokenizer)  # the embedded model's template knows no tools
    prompt = chat.render(tokenizer, messages, declared)
    assert prompt.startswith("<|im_start|>system\n" + chat.TOOLS_INTRO)
    assert (
        '"name": "weather"' in prompt
        and '{"city": "Oslo"}' in prompt
        and "<|im_start|>tool\nsunny" in prompt
    )
    assert (
        "You are a helpful AI assistant named SmolLM" not in prompt
    )  # our system message replaced the default
    assert chat.render(tokenizer, messages[:1], []).startswith(
        "<|im_start|>system\nYou are a helpful AI"
    )
