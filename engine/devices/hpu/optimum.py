"""optimum-habana on the transformers fallback (HPU only): `adapt_transformers_to_gaudi()`, with the
Gaudi model classes that would bypass our paged KV cache taken back out.

What optimum-habana does (read in huggingface/optimum-habana v1.19.1, commit 1aa991e4, the release
for Gaudi software 1.22 / torch 2.7.1, file optimum/habana/transformers/modeling_utils.py):
`adapt_transformers_to_gaudi()` (no arguments) replaces, in place and for the whole process, methods
of transformers (GenerationMixin's generation loop, Conv1D.forward, ...) and whole classes in the
transformers modeling modules (`modeling_llama.LlamaForCausalLM = GaudiLlamaForCausalLM`,
`LlamaAttention = GaudiLlamaAttention`, the same for Mistral, Qwen2/3, Gemma 1/2, Mixtral, Phi,
Starcoder2, Falcon, GPT-NeoX, ...). Those Gaudi attention classes keep their own KV cache (KVCache
modules) and call FusedSDPA themselves: none of them looks its attention function up in
transformers' ALL_ATTENTION_FUNCTIONS in v1.19.1 (v1.20.0 adds it for gpt_oss and whisper only). Our
fallback only works through that interface, so such a variant is refused here: the model keeps the
un-adapted transformers class (its module names are put back), with a warning that says why; the
process-wide adaptations stay. A variant whose module does use the interface is served as
optimum-habana built it.

optimum-habana pins transformers (v1.19.1: >= 4.51, < 4.52; v1.20.0: < 4.56); bucketserve needs
transformers >= 4.56, and v1.19.1 cannot be imported with transformers 5 (68 of its imported names
are gone, e.g. transformers.modeling_attn_mask_utils). An import that fails is reported once and the
fallback runs un-adapted.
"""

from __future__ import annotations

import ast
import inspect
import logging
import sys

log = logging.getLogger(__name__)
PINNED = (
    "1.19.1",
    "1.22",
)  # the optimum-habana release Dockerfile_gaudi pins, and the Gaudi software it is for
INTERFACE = "ALL_ATTENTION_FUNCTIONS"
_state = {"adapted": False, "reported": False}


def adapt_for_fallback(cls):
    """The class the fallback should build for `cls` (a transformers causal LM class)."""
    adapt = _adapt_function()
    if adapt is None:
        return cls
    original = _original(cls)
    module = sys.modules[original.__module__]
    before = dict(vars(module))
    if not _state["adapted"]:
        adapt()  # process-wide and in place, as optimum-habana means it
        _state["adapted"] = True
    variant = getattr(module, original.__name__)
    if not _is_gaudi(variant):
        log.info(
            "optimum-habana has no Gaudi variant of %s: its process-wide adaptations apply",
            original.__name__,
        )
        return original
    if routes_through_interface(variant):
        log.info(
            "serving optimum-habana's %s: its attention goes through transformers' attention "
            "interface",
            variant.__name__,
        )
        return variant
    _restore(module, before)
    log.warning(
        "optimum-habana's %s keeps its own KV cache and attention (it never calls transformers' "
        "attention interface), which would bypass bucketserve's paged KV cache: serving the "
        "un-adapted %s",
        variant.__name__,
        original.__name__,
    )
    return original


def routes_through_interface(variant) -> bool:
    """Whether the variant's modeling module looks attention up in transformers'
    ALL_ATTENTION_FUNCTIONS (as code, not in a comment); a module whose source cannot be read is not
    trusted to."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[variant.__module__]))
    except (OSError, TypeError, KeyError, SyntaxError):
        return False
    names = {
        getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Name, ast.Attribute, ast.alias))
    }
    return INTERFACE in names


def _adapt_function():
    try:
        from optimum.habana.transformers.modeling_utils import adapt_transformers_to_gaudi
    except ModuleNotFoundError as err:
        if (err.name or "").startswith("optimum"):
            _report("optimum-habana is not installed: the transformers fallback runs un-adapted")
        else:
            _report(
                f"optimum-habana cannot be imported with this transformers ({err}): the fallback "
                "runs un-adapted"
            )
        return None
    except Exception as err:  # noqa: BLE001 - its imports of transformers internals fail in many ways
        _report(
            f"optimum-habana cannot be imported with this transformers ({err}): the fallback runs "
            "un-adapted"
        )
        return None
    return adapt_transformers_to_gaudi


def _report(message: str) -> None:
    if not _state["reported"]:
        _state["reported"] = True
        log.warning(message) if "cannot" in message else log.info(message)


def _is_gaudi(obj) -> bool:
    return str(getattr(obj, "__module__", "")).startswith("optimum.habana")


def _original(cls):
    """A class resolved after an earlier adaptation may be the Gaudi variant: its transformers
    base."""
    while _is_gaudi(cls):
        cls = next(base for base in cls.__mro__[1:] if not _is_gaudi(base))
    return cls


def _restore(module, before: dict) -> None:
    """Put back every name of the modeling module that now holds an optimum-habana object."""
    for name, value in list(vars(module).items()):
        previous = before.get(name)
        if not _is_gaudi(value):
            continue
        if previous is not None and not _is_gaudi(previous):
            setattr(module, name, previous)
        elif isinstance(value, type):
            setattr(module, name, _original(value))
