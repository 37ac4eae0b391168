"""torch.compile's own proof that nothing compiles once warmup is done (`--graph-mode compile`).

Warmup compiles one static graph per bucket. Once the shard serves, every compiled call runs
under `torch.compiler.set_stance("fail_on_recompile")`: a call that would compile (a guard failing
on a warmed bucket: a new stride, dtype or Python value) raises in torch instead of compiling
silently, and is refused as an unwarmed shape is in strict mode (or, lenient, run eagerly and
counted). Dynamo's own counters say what compiled and when: graphs (`unique_graphs`), graph
breaks (`counters["graph_break"]`) and recompiles (a frame compiled again, `FRAME_COMPILE_COUNTER`).
A warm call after serving began (progressive warmup) counts as warmup.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable

import torch

from engine.errors import UnwarmedShapeError

RECOMPILE_ERROR = "Detected recompile when torch.compile stance is 'fail_on_recompile'"
KINDS = ("compiles", "breaks", "recompiles")


def dynamo_counts() -> Counter:
    """What dynamo compiled in this process so far, by its own counters."""
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import counters

    compiles_per_frame = convert_frame.FRAME_COMPILE_COUNTER.values()
    return Counter(
        compiles=counters["stats"]["unique_graphs"],
        breaks=sum(counters["graph_break"].values()),
        recompiles=sum(n - 1 for n in compiles_per_frame if n > 1),
    )


class CompileLedger:
    """Dynamo's counts split into warmup and serving, and the recompiles refused while serving."""

    def __init__(self):
        self.serving_base: Counter | None = None  # the counts when serving began
        self.warmed_since: Counter = Counter()  # what warm calls compiled after that
        self.refused = 0  # calls that would have recompiled while serving

    @property
    def serving(self) -> bool:
        return self.serving_base is not None

    def start_serving(self) -> None:
        self.serving_base, self.warmed_since, self.refused = dynamo_counts(), Counter(), 0

    def start_warmup(self) -> None:
        self.serving_base = None

    def counts(self) -> dict[str, int]:
        total = dynamo_counts()
        serving = Counter()
        if self.serving_base is not None:
            serving = total - self.serving_base - self.warmed_since
        serving["recompiles"] += self.refused
        return {
            f"graph_{kind}_{phase}": value[kind]
            for kind in KINDS
            for phase, value in (("warmup", total - serving), ("serving", serving))
        }


def ledger_of(adapter) -> CompileLedger:
    return adapter.__dict__.setdefault("compile_ledger", CompileLedger())


def call_compiled(
    adapter, shape: Hashable, compiled: Callable, fn: Callable, args: tuple, warming: bool
):
    """One call of a compiled graph: free to compile while warming, forbidden to once serving."""
    ledger = ledger_of(adapter)
    if warming or not ledger.serving:
        before = dynamo_counts()
        out = compiled(*args)
        if ledger.serving:  # progressive warmup: a warm call after serving began
            ledger.warmed_since += dynamo_counts() - before
        return out
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            return compiled(*args)
    except RuntimeError as err:
        if not str(err).startswith(RECOMPILE_ERROR):
            raise
        ledger.refused += 1
        adapter.shapes.unwarmed[shape] += 1
        if adapter.shapes.strict:
            reason = " ".join(str(err).split("\n", 2)[-1].split())
            raise UnwarmedShapeError(
                f"forward at shape {shape} would compile a new graph after warmup ({reason})"
            ) from None
        return fn(*args)
