"""The scheduler's wire check (router/sched/admission.py) reads each field against its protocol type
instead of serializing the request: it refuses exactly what protobuf would refuse, naming the field,
and serializes nothing itself."""

import pytest

from engine.batch import GrammarType, Request, StoppingCriteriaParameters
from engine.wire import convert
from router.sched.admission import check_wire

# (a field path, a value): at and past each integer type's bounds, and text no wire carries.
CASES = [
    ("id", 2**64 - 1),
    ("id", 2**64),
    ("id", -1),
    ("truncate", 2**32 - 1),
    ("truncate", 2**32),
    ("top_n_tokens", 2**32),
    ("parameters.top_k", 2**32 - 1),
    ("parameters.top_k", 2**32),
    ("parameters.seed", 2**64 - 1),
    ("parameters.seed", 2**64),
    ("parameters.grammar", "\ud800"),
    ("parameters.grammar_type", GrammarType.REGEX),
    ("stopping_parameters.max_new_tokens", 2**32),
    ("stopping_parameters.stop_sequences", ["ok", "\ud800"]),
    ("inputs", "a\ud800"),
    ("blocks", [1, 2**32]),
    ("slots", [2**32 - 1]),
    ("cache_len", -1),
    ("chunk_len", 2**32),
    ("adapter_id", "\udfff"),
]


def request_with(path: str, value) -> Request:
    request = Request(7, "hello", stopping_parameters=StoppingCriteriaParameters(4))
    *parents, name = path.split(".")
    target = request
    for parent in parents:
        target = getattr(target, parent)
    setattr(target, name, value)
    return request


def serializes(request: Request) -> bool:
    try:
        convert.request_to_pb(request)
    except (ValueError, TypeError):
        return False
    return True


@pytest.mark.parametrize("path, value", CASES)
def test_refuses_exactly_what_protobuf_refuses(path, value):
    request = request_with(path, value)
    if serializes(request):
        check_wire(request)
    else:
        with pytest.raises(ValueError, match=path.split(".")[-1]):
            check_wire(request)


def test_logit_bias_ids_must_be_uint32():
    request = request_with("parameters.logit_bias", {2**32: 1.0})
    assert not serializes(request)
    with pytest.raises(ValueError, match="logit_bias"):
        check_wire(request)


def test_serializes_nothing(monkeypatch):
    def refuse(request):
        raise AssertionError("the wire check serialized the request")

    monkeypatch.setattr(convert, "request_to_pb", refuse)
    check_wire(request_with("parameters.seed", 2**64 - 1))
    with pytest.raises(ValueError, match="seed"):
        check_wire(request_with("parameters.seed", 2**64))
