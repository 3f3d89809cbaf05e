"""Grammars for ranks in their own processes (TP > 1): compiled once, in the engine core,
sent to the ranks once.

The engine core compiles a request's grammar off its loop before scheduling it (the
grammar compiler thread), and there also serializes it (``GrammarBackend`` built with
``serialize_on_compile``). A plan carries a new request's grammar, as xgrammar's JSON, only
the first time the ranks need it: ``ShippedGrammars`` remembers what was sent, so a request
whose grammar the ranks already hold travels with none, and each rank finds it in its own
cache. Measured before this (bench/tp_grammar_step.py): every plan with a new structured
request serialized its grammar on the step (~10-30 ms for a small JSON schema on this
machine) and every rank decoded it again.

The ledger is an LRU over half the entries and half the bytes of a rank's grammar cache.
Ranks touch their cache in the order the plans name the grammars, which is the order the
ledger is touched in, so a rank always holds at least what the ledger remembers. Should a
rank miss all the same, it compiles the grammar itself: slower, never wrong.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from shoal.runtime.structured.backend import CACHE_BYTES, CACHE_SIZE, GrammarBackend
from shoal.runtime.structured.spec import GrammarSpec
from shoal.runtime.wire.plan import StepPlan


class ShippedGrammars:
    """The grammars the ranks hold, as far as the engine core can tell (an LRU)."""

    def __init__(self, max_entries: int = CACHE_SIZE // 2,
                 max_bytes: int = CACHE_BYTES // 2) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._held: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._held)

    def must_send(self, spec: GrammarSpec, memory_bytes: int) -> bool:
        """Whether a plan naming ``spec`` must carry it; either way it is now the most
        recently used, and what no longer fits is forgotten (it will be sent again)."""
        key = (spec.kind, spec.source)
        if key in self._held:
            self._held.move_to_end(key)
            return False
        self._held[key] = memory_bytes
        self._bytes += memory_bytes
        while len(self._held) > 1 and (len(self._held) > self.max_entries
                                       or self._bytes > self.max_bytes):
            _, dropped = self._held.popitem(last=False)
            self._bytes -= dropped
        return True


def with_compiled_grammars(plan: StepPlan, grammars: GrammarBackend,
                           shipped: ShippedGrammars | None = None) -> StepPlan:
    """The plan with each new structured request's grammar attached, serialized, unless
    ``shipped`` says the ranks hold it. The scheduler's own plan is left as it was. A
    grammar evicted from the core since it compiled is compiled again here, in at most the
    budget it already passed once (as a rank of one process would on a miss)."""
    if not any(new.sampling_params.structured is not None for new in plan.new_requests):
        return plan
    news = []
    for new in plan.new_requests:
        spec = new.sampling_params.structured
        if spec is not None:
            grammars.compiled(spec)  # a cache hit: the core compiled it before scheduling
            if shipped is None or shipped.must_send(spec, grammars.memory_bytes(spec)):
                new = replace(new, compiled_grammar=grammars.serialized(spec))
        news.append(new)
    return replace(plan, new_requests=news)
