"""A finished `response_format` reply is checked against its schema: a mismatch is logged, naming
the request, and counted, and the text is returned as it is; a reply cut by the token limit is not
checked. Driven with crafted generations, as if the grammar had let a wrong reply through."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from engine.batch import FinishReason, GeneratedText, Generation, Tokens
from router.http.metrics import RouterMetrics
from router.http.openai_api import ChatRequest, chat_response, reply_check
from router.http.openai_render import ChatChunks, Envelope, reply_problem

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}},
    "required": ["color"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "color", "schema": SCHEMA}}


def generation(text: str, reason: FinishReason = FinishReason.EOS_TOKEN) -> Generation:
    tokens = Tokens([1], [0.0], [text], [False])
    return Generation(0, None, tokens, GeneratedText(text, 1, reason))


def request(response_format: dict, stream: bool = False) -> ChatRequest:
    return ChatRequest(
        messages=[{"role": "user", "content": "a color"}],
        response_format=response_format,
        stream=stream,
    )


def invalid_count(metrics: RouterMetrics) -> float:
    samples = metrics.invalid_replies.collect()[0].samples
    return next(s.value for s in samples if s.name == "bucketserve_invalid_replies_total")


def answer(text: str, response_format: dict, reason=FinishReason.EOS_TOKEN, stream=False):
    """(the reply's text as the client gets it, the invalid-reply count, the envelope's id)."""
    metrics = RouterMetrics(SimpleNamespace(), SimpleNamespace())
    body, envelope = (
        request(response_format, stream),
        Envelope("tiny", "chat.completion", "chatcmpl"),
    )
    check = reply_check(SimpleNamespace(metrics=metrics), envelope, body)
    if stream:
        events = ChatChunks(envelope, body, 0, check)(generation(text, reason))
        chunks = [json.loads(e.removeprefix("data: ")) for e in events]
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    else:
        response = chat_response(envelope, body, [[generation(text, reason)]], 3, check)
        content = response["choices"][0]["message"]["content"]
    return content, invalid_count(metrics), envelope.id


@pytest.mark.parametrize("stream", [False, True])
def test_a_finished_reply_that_fails_its_schema_is_logged_counted_and_returned(stream, caplog):
    with caplog.at_level(logging.WARNING, logger="router.http.openai_render"):
        content, count, request_id = answer('{"color": "blue"}', JSON_SCHEMA, stream=stream)
    assert content == '{"color": "blue"}' and count == 1
    assert request_id in caplog.text and "'blue' is not one of ['red', 'green']" in caplog.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_valid_reply_and_a_cut_reply_are_not_counted(stream, caplog):
    with caplog.at_level(logging.WARNING):
        assert answer('{"color": "red"}', JSON_SCHEMA, stream=stream)[:2] == ('{"color": "red"}', 0)
        cut = answer('{"color": "gr', JSON_SCHEMA, FinishReason.LENGTH, stream)
        assert cut[:2] == ('{"color": "gr', 0)
    assert not caplog.records


def test_json_object_replies_must_be_one_json_object():
    json_object = {"type": "json_object"}
    assert answer('{"any": [1, 2]}', json_object)[1] == 0
    assert answer("[1, 2]", json_object)[1] == 1
    assert answer('{"open": ', json_object, FinishReason.STOP_SEQUENCE)[1] == 1


def test_reply_problem_names_what_is_wrong():
    assert reply_problem(JSON_SCHEMA, "not json").startswith("it is not JSON")
    assert "'color' is a required property" in reply_problem(JSON_SCHEMA, "{}")
    assert reply_problem({"type": "json", "value": SCHEMA}, '{"color": "red", "x": 1}')
    assert reply_problem({"type": "text"}, "not json") is None
    assert reply_problem({"type": "regex", "value": "a+"}, "b") is None
