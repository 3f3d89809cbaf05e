"""Worker-side grammars: specs compiled against the model's vocabulary, one matcher per
request, and the step's token bitmask.

Why the worker: it samples, so it is where a token is accepted the moment it exists; the
engine core would see it a step later and would have to send the mask across the plan wire
to every rank. A matcher is rebuilt, by replaying the output so far, whenever the plan
(re)sends a request in ``new_requests`` (first step, and after a preemption, which keeps the
output), and dropped with ``finished_req_ids`` (finish, abort): grammar state always equals
the engine's token list.

The vocabulary comes from the checkpoint's tokenizer files through xgrammar's
``TokenizerInfo``. Building it costs seconds of Python (importing xgrammar pulls in
transformers), so the worker builds it during its warm-up, before the engine reports ready
(``prepare``): built on a thread after /ready it held the GIL against the engine loop for
those seconds, and the first requests a new replica served were twice as slow (16 requests
at once: TTFT p50 1.94 s right after /ready, 0.76 s 30 s later). Compiled grammars are
cached per spec (LRU).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from shoal.runtime.structured.spec import GrammarSpec, choice_ebnf

log = logging.getLogger(__name__)

CACHE_SIZE = 256


class GrammarMatcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_terminated())

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it (it stays put)."""
        if self.finished:
            return True  # past its end (ignore_eos): nothing left to constrain
        return bool(self._matcher.accept_token(token_id))

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if not self.finished:
            self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarBackend:
    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds = 0.0  # total, for logs and tests

    def matcher(self, spec: GrammarSpec, replay: Sequence[int] = ()) -> GrammarMatcher:
        import xgrammar as xgr

        matcher = GrammarMatcher(xgr.GrammarMatcher(self.compiled(spec)))
        for token in replay:
            if not matcher.accept(token):
                raise ValueError(f"token {token} of the output so far breaks its grammar")
        return matcher

    def compiled(self, spec: GrammarSpec) -> Any:
        key = (spec.kind, spec.source)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        started = time.perf_counter()
        grammar = self._compile(spec)
        elapsed = time.perf_counter() - started
        self.compile_seconds += elapsed
        log.debug("compiled a %s grammar in %.1f ms", spec.kind, elapsed * 1e3)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(rows, self.vocab_size)  # all allowed

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler = self._get_compiler()
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.source, any_whitespace=False,
                                                strict_mode=True)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                strict_mode=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "choice":
            import json

            return compiler.compile_grammar(choice_ebnf(json.loads(spec.source)))
        return compiler.compile_grammar(spec.source)

    @property
    def prepared(self) -> bool:
        return self._compiler is not None

    def prepare(self) -> bool:
        """Build the compiler now (once); False when xgrammar is not installed or the build
        fails (logged: unconstrained requests are served all the same, and a structured
        request tries again and gets the error)."""
        if importlib.util.find_spec("xgrammar") is None:
            return False
        try:
            self._get_compiler()
        except Exception:
            log.exception("preparing the grammar compiler failed")
            return False
        return True

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            started = time.perf_counter()
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            log.info("grammar compiler ready in %.2f s (vocabulary of %d)",
                     time.perf_counter() - started, self.vocab_size)
        return self._compiler


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: list[int] | None) -> None:
    """-inf on every token the rows' grammars forbid (in place)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[-1], indices=rows)
