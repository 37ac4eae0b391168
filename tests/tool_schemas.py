"""Hypothesis strategies for OpenAI tools and JSON schemas: function schemas with nested objects,
enums, arrays, references, and required and optional fields, over every keyword that
engine/grammar_schema.py supports. Strings, numbers and arrays are bounded so that a random model
at temperature 1 finishes its reply."""

from __future__ import annotations

from hypothesis import strategies as st

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
PATTERNS = [r"[a-z]{1,5}", r"\d{3}-\d{2}", r"(yes|no|maybe)", r"[A-Z][a-z]{0,3}", r"\w{2}"]


def strings() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(
            lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
            st.integers(0, 4),
            st.integers(0, 4),
        ),
        st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
        st.just({"type": "string", "format": "uuid"}),
    )


def numbers() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 100),
        ),
        st.builds(
            lambda lo, span: {
                "type": "integer",
                "exclusiveMinimum": lo,
                "exclusiveMaximum": lo + span,
            },
            st.integers(-50, 50),
            st.integers(2, 100),
        ),
        st.builds(
            lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
            st.integers(-20, 20).map(lambda x: x / 4),
            st.integers(1, 40).map(lambda x: x / 2),
        ),
        st.builds(
            lambda lo: {"type": ["integer", "null"], "minimum": lo, "maximum": lo + 9},
            st.integers(-9, 9),
        ),
    )


def literals() -> st.SearchStrategy[dict]:
    values = st.one_of(NAMES, st.integers(-5, 5), st.booleans(), st.none())
    return st.one_of(
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(
            lambda values: {"enum": values}, st.lists(NAMES, min_size=1, max_size=4, unique=True)
        ),
        st.builds(
            lambda values: {"enum": values}, st.lists(values, min_size=1, max_size=4, unique=True)
        ),
        st.builds(lambda value: {"const": value}, values),
    )


def leaf() -> st.SearchStrategy[dict]:
    simple = st.one_of(strings(), numbers(), literals())
    either = st.builds(lambda a, b: {"anyOf": [a, b]}, simple, simple)
    return st.one_of(simple, either)


def objects(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def build(props: dict, required_mask: list[bool], closed: bool) -> dict:
        names = sorted(props)
        required = [n for n, on in zip(names, required_mask) if on]
        schema = {"type": "object", "properties": props, "required": required}
        return {**schema, "additionalProperties": False} if closed else schema

    return st.dictionaries(NAMES, children, min_size=0, max_size=3).flatmap(
        lambda props: st.builds(
            build,
            st.just(props),
            st.lists(st.booleans(), min_size=len(props), max_size=len(props)),
            st.booleans(),
        )
    )


def arrays(inner: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    listed = st.builds(
        lambda items, lo, span: {
            "type": "array",
            "items": items,
            "minItems": lo,
            "maxItems": lo + span,
        },
        inner,
        st.integers(0, 2),
        st.integers(0, 2),
    )
    tuples = st.builds(
        lambda first, rest: {"type": "array", "prefixItems": [first, *rest], "items": False},
        inner,
        st.lists(inner, max_size=1),
    )
    return st.one_of(listed, tuples)


def schema_tree() -> st.SearchStrategy[dict]:
    nested = st.recursive(
        leaf(), lambda inner: st.one_of(arrays(inner), objects(inner)), max_leaves=5
    )
    return st.one_of(objects(nested), with_definitions(nested))


def with_definitions(nested: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    """An object whose properties refer to a shared definition (`$defs` and `$ref`)."""

    def build(definition: dict, name: str, other: dict) -> dict:
        return {
            "type": "object",
            "$defs": {"shared": definition},
            "properties": {name: {"$ref": "#/$defs/shared"}, f"{name}_other": other},
            "required": [name],
        }

    return st.builds(build, nested, NAMES, nested)


@st.composite
def tools(draw, max_tools: int = 3) -> list[dict]:
    names = draw(st.lists(NAMES, min_size=1, max_size=max_tools, unique=True))
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"the {name} function",
                "parameters": draw(schema_tree()),
            },
        }
        for name in names
    ]
