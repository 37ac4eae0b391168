"""Grammar-constrained decoding (engine/grammar.py) on the embedded model's tokenizer.

The "model" is random logits from a seeded torch.Generator and the choice is greedy argmax over the allowed tokens,
so every test is deterministic and the grammar is the only thing that keeps the output in shape.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from engine.batch import GrammarType
from engine.errors import InvalidRequestError
from engine.grammar import GrammarCompiler, GrammarState, allowed_masks, fill_masks

TOKENIZER_VOCAB = 49152
VOCAB = TOKENIZER_VOCAB + 64  # the logits are padded past the tokenizer's vocabulary
EOS = 2  # <|im_end|>
MAX_TOKENS = 200

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}
NUMBERS = {"type": "array", "items": {"type": "number"}}
PHONE = r"\d{3}-\d{4}"
ANSWER = r"(yes|no|maybe)"


@pytest.fixture(scope="module")
def tokenizer(smollm_dir):
    tok = AutoTokenizer.from_pretrained(smollm_dir)
    assert len(tok) == TOKENIZER_VOCAB and tok.eos_token_id == EOS
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, frozenset({EOS}))


def pick(mask: torch.Tensor, generator: torch.Generator) -> int:
    """One step of the random model: greedy argmax of random logits over the allowed tokens."""
    assert mask.dtype == torch.bool and mask.shape == (VOCAB,)
    assert mask.any(), "the grammar allows no token at all"
    logits = torch.randn(VOCAB, generator=generator)
    logits[~mask] = -torch.inf
    return int(logits.argmax())


def generate(
    state: GrammarState, seed: int, max_tokens: int = MAX_TOKENS
) -> tuple[list[int], bool]:
    """Drive `state` to EOS or max_tokens; returns the tokens before EOS and whether EOS came."""
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(max_tokens):
        mask = state.allowed_mask()
        assert not mask[TOKENIZER_VOCAB:].any(), (
            "padding ids past the tokenizer's vocabulary were allowed"
        )
        token = pick(mask, generator)
        if token == EOS:
            assert state.is_complete
            state.advance(token)
            assert state.is_finished and not state.failed
            return tokens, True
        state.advance(token)
        assert not state.failed
        tokens.append(token)
    return tokens, False


def run(compiler, tokenizer, grammar_type, grammar, seed) -> str:
    state = compiler.new_state(compiler.compile(grammar_type, grammar))
    tokens, ended = generate(state, seed)
    text = tokenizer.decode(tokens)
    assert ended, f"no EOS within {MAX_TOKENS} tokens: {text!r}"
    return text


def check_person(value) -> None:
    assert isinstance(value, dict) and set(value) == {"name", "age", "color"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 16, value
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool), value
    assert value["color"] in ("red", "green", "blue"), value


def check_numbers(value) -> None:
    assert isinstance(value, list), value
    assert all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value), value


@pytest.mark.parametrize("seed", range(4))
def test_json_object_schema(compiler, tokenizer, seed):
    text = run(compiler, tokenizer, GrammarType.JSON, json.dumps(PERSON), seed)
    check_person(json.loads(text))


@pytest.mark.parametrize("seed", range(4))
def test_json_array_of_numbers(compiler, tokenizer, seed):
    text = run(compiler, tokenizer, GrammarType.JSON, json.dumps(NUMBERS), seed)
    check_numbers(json.loads(text))


def test_unconstrained_random_model_breaks_the_schema(tokenizer):
    """The check above is not vacuous: without the mask the same random model emits no JSON."""
    generator = torch.Generator().manual_seed(0)
    tokens = [pick(torch.ones(VOCAB, dtype=torch.bool), generator) for _ in range(20)]
    with pytest.raises(ValueError):
        check_person(json.loads(tokenizer.decode([t for t in tokens if t < TOKENIZER_VOCAB])))


@pytest.mark.parametrize("regex", [PHONE, ANSWER, r"[a-z]{2,6}@[a-z]{2,6}\.(com|org)"])
@pytest.mark.parametrize("seed", range(3))
def test_regex_full_match(compiler, tokenizer, regex, seed):
    text = run(compiler, tokenizer, GrammarType.REGEX, regex, seed)
    assert re.fullmatch(regex, text, flags=re.ASCII), text


def test_eos_only_once_nothing_else_can_follow(compiler, tokenizer):
    state = compiler.new_state(compiler.compile(GrammarType.REGEX, ANSWER))
    first = state.allowed_mask()
    assert not first[EOS] and not state.is_complete and not state.is_finished
    assert {tokenizer.decode([t]) for t in first.nonzero().flatten().tolist()} <= {
        "y",
        "ye",
        "yes",
        "n",
        "no",
        "m",
        "ma",
        "may",
        "mayb",
        "maybe",
    }
    for token in tokenizer.encode("yes", add_special_tokens=False):
        state.advance(token)
    assert state.is_complete and state.is_finished
    assert state.allowed_mask().nonzero().flatten().tolist() == [EOS]
    state.advance(EOS)
    assert state.is_finished and state.allowed_mask().nonzero().flatten().tolist() == [EOS]


def test_eos_allowed_with_more_when_match_can_go_on(compiler, tokenizer):
    state = compiler.new_state(compiler.compile(GrammarType.REGEX, r"a+"))
    assert not state.allowed_mask()[EOS]
    state.advance(tokenizer.convert_tokens_to_ids("a"))
    mask = state.allowed_mask()
    assert state.is_complete and not state.is_finished
    assert mask[EOS] and mask.sum() > 1
    assert mask[tokenizer.convert_tokens_to_ids("aa")]


def test_every_eos_id_allowed_at_the_end(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, frozenset({EOS, 0}))
    state = compiler.new_state(compiler.compile(GrammarType.REGEX, "no"))
    state.advance(tokenizer.convert_tokens_to_ids("no"))
    assert state.allowed_mask().nonzero().flatten().tolist() == [0, EOS]


def test_mask_sized_to_the_logits_vocabulary(compiler, tokenizer):
    state = compiler.new_state(compiler.compile(GrammarType.JSON, json.dumps(NUMBERS)))
    mask = state.allowed_mask()
    assert mask.shape == (VOCAB,) and mask.dtype == torch.bool
    assert not mask[TOKENIZER_VOCAB:].any()
    assert not mask[tokenizer.convert_tokens_to_ids("<|im_start|>")]
    assert mask[tokenizer.convert_tokens_to_ids("[")]


def test_interleaved_states_are_independent(compiler, tokenizer):
    """Two requests of different grammars stepped in turn give exactly what each gives alone."""
    specs = [(GrammarType.JSON, json.dumps(PERSON), 11), (GrammarType.REGEX, PHONE, 12)]
    alone = [generate(compiler.new_state(compiler.compile(t, g)), seed)[0] for t, g, seed in specs]
    states = [compiler.new_state(compiler.compile(t, g)) for t, g, _ in specs]
    generators = [torch.Generator().manual_seed(seed) for _, _, seed in specs]
    together: list[list[int]] = [[], []]
    done = [False, False]
    while not all(done):
        for i, state in enumerate(states):
            if done[i]:
                continue
            token = pick(state.allowed_mask(), generators[i])
            state.advance(token)
            if token == EOS:
                done[i] = True
            else:
                together[i].append(token)
    assert together == alone
    check_person(json.loads(tokenizer.decode(together[0])))
    assert re.fullmatch(PHONE, tokenizer.decode(together[1]), flags=re.ASCII)


def test_states_survive_batch_filtering_and_concatenation(compiler, tokenizer):
    """Batched masks (fill_masks) while states move between lists, as Sequences do when batches change."""
    specs = [
        (GrammarType.REGEX, ANSWER, 1),
        (GrammarType.JSON, json.dumps(NUMBERS), 2),
        (GrammarType.JSON, json.dumps(PERSON), 3),
        (GrammarType.REGEX, PHONE, 4),
    ]
    alone = [generate(compiler.new_state(compiler.compile(t, g)), seed)[0] for t, g, seed in specs]
    # rows: [request index, state, generator, tokens]
    batch = [
        [i, compiler.new_state(compiler.compile(t, g)), torch.Generator().manual_seed(s), []]
        for i, (t, g, s) in enumerate(specs[:2])
    ]
    waiting = [
        [i + 2, compiler.new_state(compiler.compile(t, g)), torch.Generator().manual_seed(s), []]
        for i, (t, g, s) in enumerate(specs[2:])
    ]
    results: dict[int, list[int]] = {}
    out = torch.empty(8, VOCAB, dtype=torch.bool)
    step = 0
    while batch or waiting:
        if step == 2:  # concatenate: a new batch joins, then rows are reordered
            batch = list(reversed(batch + [waiting.pop(0)]))
        if step == 4:
            batch = [waiting.pop(0)] + batch
        states = [row[1] for row in batch] + [None]  # a request without a grammar shares the batch
        fill_masks(states, out)
        assert out[len(batch)].all()
        for r, row in enumerate(batch):
            assert torch.equal(out[r], row[1].allowed_mask())
            token = pick(out[r], row[2])
            row[1].advance(token)
            if token != EOS:
                row[3].append(token)
        results.update({row[0]: row[3] for row in batch if row[3] and row[1].terminated})
        batch = [row for row in batch if not row[1].terminated]  # filter: finished requests leave
        step += 1
        assert step < MAX_TOKENS
    assert [results[i] for i in range(4)] == alone
    assert tokenizer.decode(results[0]) in ("yes", "no", "maybe")
    check_numbers(json.loads(tokenizer.decode(results[1])))
    check_person(json.loads(tokenizer.decode(results[2])))


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, GrammarState.fork])
def test_copied_state_is_independent(compiler, tokenizer, how):
    state = compiler.new_state(compiler.compile(GrammarType.REGEX, PHONE))
    for token in tokenizer.encode("12", add_special_tokens=False):
        state.advance(token)
    twin = how(state)
    assert twin is not state and torch.equal(twin.allowed_mask(), state.allowed_mask())
    a, _ = generate(state, seed=5)
    b, _ = generate(twin, seed=6)
    for tokens in (a, b):
        assert re.fullmatch(PHONE, "12" + tokenizer.decode(tokens), flags=re.ASCII)
    assert a != b


def test_forbidden_token_ends_the_request(compiler, tokenizer):
    state = compiler.new_state(compiler.compile(GrammarType.REGEX, PHONE))
    state.advance(tokenizer.convert_tokens_to_ids("x"))
    assert state.failed and state.is_finished
    assert state.allowed_mask().nonzero().flatten().tolist() == [EOS]


@pytest.mark.parametrize(
    "grammar_type,grammar,kind",
    [
        (GrammarType.JSON, '{"type": "object", "properties": ', "invalid JSON schema"),
        (GrammarType.JSON, '{"type": "foo"}', "invalid JSON schema"),
        (GrammarType.JSON, '{"type": "object", "properties": 5}', "invalid JSON schema"),
        (GrammarType.JSON, "[1, 2]", "invalid JSON schema"),
        (GrammarType.REGEX, "(ab", "invalid regex"),
        (GrammarType.REGEX, "[a-", "invalid regex"),
        (GrammarType.REGEX, r"(a)\1", "invalid regex"),
    ],
)
def test_invalid_grammar_names_the_field(compiler, grammar_type, grammar, kind):
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(grammar_type, grammar)
    message = str(err.value)
    assert message.startswith(f"parameters.grammar: {kind}: "), message
    assert ".cc:" not in message and len(message) > len(kind) + 25


def test_grammar_type_none_is_rejected(compiler):
    with pytest.raises(InvalidRequestError, match="parameters.grammar_type"):
        compiler.compile(GrammarType.NONE, "")


def test_compilation_is_cached(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, frozenset({EOS}), cache_size=2)
    first = compiler.compile(GrammarType.REGEX, PHONE)
    assert compiler.compile(GrammarType.REGEX, PHONE) is first
    assert compiler.compile(GrammarType.JSON, json.dumps(NUMBERS)) is not first
    assert compiler.compile(GrammarType.REGEX, PHONE) is first  # now the most recently used
    compiler.compile(GrammarType.REGEX, ANSWER)  # evicts the JSON grammar
    assert compiler.cache_len() == 2
    assert compiler.compile(GrammarType.REGEX, PHONE) is first
    s1, s2 = (
        compiler.new_state(first),
        compiler.new_state(first),
    )  # one compiled grammar, separate states
    s1.advance(tokenizer.convert_tokens_to_ids("1"))
    assert s1.tokens == 1 and s2.tokens == 0


def test_fill_masks_rows(compiler, tokenizer):
    assert allowed_masks([None, None], VOCAB) is None
    state = compiler.new_state(compiler.compile(GrammarType.REGEX, ANSWER))
    masks = allowed_masks([None, state], VOCAB)
    assert (
        masks.shape == (2, VOCAB) and masks[0].all() and torch.equal(masks[1], state.allowed_mask())
    )
    with pytest.raises(ValueError):
        fill_masks([state], torch.empty(1, VOCAB - 1, dtype=torch.bool))
    with pytest.raises(ValueError):
        fill_masks([state], torch.empty(1, VOCAB))


@pytest.mark.parametrize(
    "schema, prefix",
    [
        ({"type": "string", "maxLength": 6}, '"'),
        ({"type": "string", "minLength": 2}, '"a'),
        ({"type": "string", "minLength": 1, "maxLength": 4}, '"'),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string", "maxLength": 3}},
                "required": ["a"],
            },
            '{"a": "',
        ),
        ({"type": "array", "items": {"type": "string", "minLength": 3}}, '["x'),
        ({"type": "string"}, '"'),
    ],
)
def test_no_string_admits_a_raw_control_character(compiler, tokenizer, schema, prefix):
    """JSON forbids U+0000-U+001F inside a string; a bounded string once let 26 such tokens in."""
    control = [
        i for i in range(TOKENIZER_VOCAB) if any(ord(c) < 0x20 for c in tokenizer.decode([i]))
    ]
    assert len(control) > 100
    state = compiler.new_state(compiler.compile(GrammarType.JSON, json.dumps(schema)))
    for token in tokenizer.encode(prefix, add_special_tokens=False):
        state.advance(token)
    mask = state.allowed_mask()
    assert not state.failed and mask.sum() > 100
    assert [tokenizer.decode([i]) for i in control if mask[i]] == []


def byte_tokens(tokenizer) -> dict[int, bytes]:
    """Each token id's bytes under the byte-level vocabulary (GPT-2's byte-to-character map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]  # mapped to U+0100 on, in order
    to_byte = {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}
    vocab = tokenizer.convert_ids_to_tokens(list(range(TOKENIZER_VOCAB)))
    return {
        i: bytes(to_byte[c] for c in piece)
        for i, piece in enumerate(vocab)
        if all(c in to_byte for c in piece)
    }


@pytest.mark.parametrize(
    "grammar_type, grammar, prefix",
    [
        (GrammarType.JSON, json.dumps({"type": "string", "maxLength": 4}), b'"'),
        (GrammarType.JSON, json.dumps({"type": "string"}), b'"ab'),
        (GrammarType.JSON, json.dumps({"type": "string", "pattern": "^[^a]+$"}), b'"'),
        (GrammarType.REGEX, r"[^a]+", b""),
        (GrammarType.REGEX, r".*", b"x"),
    ],
)
def test_no_grammar_admits_an_encoded_surrogate(compiler, tokenizer, grammar_type, grammar, prefix):
    """xgrammar's classes take ED A0-BF (U+D800-U+DFFF, invalid UTF-8): a `maxLength` 4 tool
    argument once came out as '_dv' and three U+FFFD. After the lead byte ED only 80-9F may follow."""
    pieces = byte_tokens(tokenizer)
    lead = next(i for i, data in pieces.items() if data == b"\xed")
    surrogate_seconds = [i for i, data in pieces.items() if 0xA0 <= data[0] <= 0xBF]
    valid_seconds = [i for i, data in pieces.items() if 0x80 <= data[0] <= 0x9F]
    assert len(surrogate_seconds) > 10 and valid_seconds
    state = compiler.new_state(compiler.compile(grammar_type, grammar))
    for token in tokenizer.encode(prefix.decode(), add_special_tokens=False):
        state.advance(token)
    assert state.allowed_mask()[lead]
    state.advance(lead)
    for mask in (
        state.allowed_mask(),
        fill_masks([None, state], torch.empty(2, VOCAB, dtype=torch.bool))[1],
    ):
        assert not state.failed and mask[valid_seconds].any()
        assert [pieces[i] for i in surrogate_seconds if mask[i]] == []
    twin = state.fork()
    twin.advance(valid_seconds[0])  # now mid-character: any continuation byte may follow
    assert twin.allowed_mask()[surrogate_seconds].any()


class _UntouchableTokenizer:
    """A request without a grammar must not build the router's compiler (its first build took
    0.4 s of the first request's time): any use of the tokenizer fails the test."""

    def __getattr__(self, name):
        raise AssertionError(
            f"the grammar check read tokenizer.{name} for a request without grammar"
        )

    def __len__(self):
        raise AssertionError("the grammar check sized the vocabulary for a request without grammar")


def test_router_check_skips_the_compiler_without_a_grammar():
    from router.http.grammar_check import GrammarCheck

    check = GrammarCheck(_UntouchableTokenizer())
    check("", GrammarType.NONE)
    assert check._compiler is None


def test_router_check_builds_the_compiler_for_a_grammar(tokenizer):
    from router.http.grammar_check import GrammarCheck
    from router.http.validation import ValidationError

    check = GrammarCheck(tokenizer)
    check("[0-9]+", GrammarType.REGEX)
    assert check._compiler is not None
    with pytest.raises(ValidationError, match="allows no token"):
        check("[^\\s\\S]", GrammarType.REGEX)


def test_router_check_compiles_on_the_thread_it_is_given(tokenizer):
    """In one process with the shard, the compiler's torch calls run on the shard's thread."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from router.http.grammar_check import GrammarCheck
    from router.http.validation import ValidationError

    ran_on = []
    with ThreadPoolExecutor(1, thread_name_prefix="fake-shard") as shard_thread:

        def on_shard_thread(fn):
            return shard_thread.submit(
                lambda: (ran_on.append(threading.current_thread().name), fn())[1]
            ).result()

        check = GrammarCheck(tokenizer, on_shard_thread=on_shard_thread)
        check("", GrammarType.NONE)
        assert ran_on == []  # nothing to compile, nothing sent there
        check("[0-9]+", GrammarType.REGEX)
        with pytest.raises(ValidationError, match="allows no token"):
            check("[^\\s\\S]", GrammarType.REGEX)
    assert len(ran_on) == 2 and all(name.startswith("fake-shard") for name in ran_on)
