"""Hypothesis strategies for OpenAI tools: function schemas with nested objects, enums, arrays, and required and
optional fields. Strings and arrays are bounded so that a random model at temperature 1 finishes its reply."""
from __future__ import annotations

from hypothesis import strategies as st

NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


def leaf() -> st.SearchStrategy[dict]:
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 100)),
        st.just({"type": "boolean"}),
        st.builds(lambda values: {"enum": values}, st.lists(NAMES, min_size=1, max_size=4, unique=True)),
    )


def objects(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    def build(props: dict, required_mask: list[bool]) -> dict:
        names = sorted(props)
        required = [n for n, on in zip(names, required_mask) if on]
        return {"type": "object", "properties": props, "required": required}

    return st.dictionaries(NAMES, children, min_size=0, max_size=3).flatmap(
        lambda props: st.builds(build, st.just(props), st.lists(st.booleans(), min_size=len(props),
                                                                max_size=len(props))))


def schema_tree() -> st.SearchStrategy[dict]:
    arrays = lambda inner: st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                                     inner, st.integers(1, 3))
    nested = st.recursive(leaf(), lambda inner: st.one_of(arrays(inner), objects(inner)), max_leaves=5)
    return objects(nested)


@st.composite
def tools(draw, max_tools: int = 3) -> list[dict]:
    names = draw(st.lists(NAMES, min_size=1, max_size=max_tools, unique=True))
    return [{"type": "function", "function": {"name": name, "description": f"the {name} function",
                                               "parameters": draw(schema_tree())}} for name in names]
