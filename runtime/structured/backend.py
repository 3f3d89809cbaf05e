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
cached per spec (LRU), bounded in entries and in bytes (xgrammar reports each one's size: a
5,000-string choice list is ~28 MB on a 151k vocabulary).

The engine core compiles a request's grammar before scheduling it, off its loop
(``compiler.py``, through ``compiled``); in one process with the worker (TP = 1) the step then
finds it here. Ranks in their own processes (TP > 1) get it serialized in the plan
(``serialized`` in the core, ``install`` on the rank: read back, not compiled). A miss
(evicted meanwhile) compiles again, in at most the compile budget the spec already passed once.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from shoal.runtime.model_source import gguf_file
from shoal.runtime.structured.spec import GrammarError, GrammarSpec, choice_ebnf, first_line

log = logging.getLogger(__name__)

CACHE_SIZE = 256
CACHE_BYTES = 512 * 1024 * 1024
# xgrammar compiles with threads of its own; leave cores to the engine loop beside it
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


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
    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_bytes: int = CACHE_BYTES, serialize_on_compile: bool = False) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_bytes = cache_bytes
        # the engine core's backend at TP > 1: serializing takes ~10-30 ms even for a small
        # JSON schema (more than compiling it), so the compile thread pays it, not the step
        self.serialize_on_compile = serialize_on_compile
        self._compiler: Any = None
        self._tokenizer_info: Any = None
        # (kind, source) -> (compiled, bytes held, xgrammar JSON or None)
        self._cache: OrderedDict[tuple[str, str], tuple[Any, int, str | None]] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self.compile_seconds = 0.0  # total, for logs and tests

    def cached(self, spec: GrammarSpec) -> bool:
        with self._lock:
            return (spec.kind, spec.source) in self._cache

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def matcher(self, spec: GrammarSpec, replay: Sequence[int] = ()) -> GrammarMatcher:
        import xgrammar as xgr

        matcher = GrammarMatcher(xgr.GrammarMatcher(self.compiled(spec)))
        for token in replay:
            if not matcher.accept(token):
                raise ValueError(f"token {token} of the output so far breaks its grammar")
        return matcher

    def compiled(self, spec: GrammarSpec) -> Any:
        """The spec compiled against the vocabulary (cached); GrammarError naming the field
        when it does not parse."""
        key = (spec.kind, spec.source)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]
        started = time.perf_counter()
        try:
            grammar = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError
            raise GrammarError(f"invalid {spec.kind} for {spec.param}: "
                               f"{first_line(exc)}") from exc
        serialized = str(grammar.serialize_json()) if self.serialize_on_compile else None
        elapsed = time.perf_counter() - started
        self.compile_seconds += elapsed
        log.debug("compiled a %s grammar in %.1f ms", spec.kind, elapsed * 1e3)
        self._store(key, grammar, serialized)
        return grammar

    def _store(self, key: tuple[str, str], grammar: Any, serialized: str | None = None) -> None:
        size = int(getattr(grammar, "memory_size_bytes", 0)) + len(serialized or "")
        with self._lock:
            if key not in self._cache:
                self._cache[key] = (grammar, size, serialized)
                self._cached_bytes += size
            while self._cache and (len(self._cache) > CACHE_SIZE
                                   or self._cached_bytes > self.cache_bytes):
                _, (_, dropped, _) = self._cache.popitem(last=False)
                self._cached_bytes -= dropped

    def serialized(self, spec: GrammarSpec) -> str:
        """The compiled spec as xgrammar's JSON, for a rank in another process (``install``);
        kept with the compiled grammar, so it is made once per grammar, not per request."""
        key = (spec.kind, spec.source)
        grammar = self.compiled(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[2] is not None:
                return hit[2]
        serialized = str(grammar.serialize_json())
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[2] is None:
                self._cache[key] = (grammar, hit[1] + len(serialized), serialized)
                self._cached_bytes += len(serialized)
        return serialized

    def memory_bytes(self, spec: GrammarSpec) -> int:
        """What the compiled grammar holds in memory (xgrammar's count; 0 if not cached): a
        rank that installs it holds as much."""
        with self._lock:
            hit = self._cache.get((spec.kind, spec.source))
        return int(getattr(hit[0], "memory_size_bytes", 0)) if hit is not None else 0

    def install(self, spec: GrammarSpec, serialized: str) -> None:
        """Cache a grammar another process compiled (``serialized``), unless already cached;
        reading it back skips the compile (no walk over the vocabulary)."""
        import xgrammar as xgr

        key = (spec.kind, spec.source)
        with self._lock:
            if key in self._cache:
                return
        grammar = xgr.CompiledGrammar.deserialize_json(serialized, self._get_tokenizer_info())
        self._store(key, grammar)

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

    def _get_tokenizer_info(self) -> Any:
        self._get_compiler()
        return self._tokenizer_info

    def _get_compiler(self) -> Any:
        with self._compiler_lock:  # the engine's compile thread and the step may both ask
            return self._build_compiler()

    def _build_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from shoal.runtime.frontend.gguf_tokenizer import gguf_hf_tokenizer
            from transformers import AutoTokenizer

            started = time.perf_counter()
            gguf = gguf_file(self.model_dir)
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir) if gguf is None else \
                gguf_hf_tokenizer(gguf)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._tokenizer_info = info
            self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS,
                                                 cache_enabled=False)
            log.info("grammar compiler ready in %.2f s (vocabulary of %d)",
                     time.perf_counter() - started, self.vocab_size)
        return self._compiler


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: list[int] | None) -> None:
    """-inf on every token the rows' grammars forbid (in place)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[-1], indices=rows)
