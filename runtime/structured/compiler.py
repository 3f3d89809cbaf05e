"""Grammar compilation off the engine loop, with a time budget per grammar.

Compiling a grammar against the vocabulary takes from milliseconds to tens of seconds (a
250k-string choice list: over 30 s, during which every other request of the replica waited
and the step-time limit declared the engine dead). So the engine core does not schedule a
request with a grammar until its grammar is compiled, as vLLM does: ``submit`` starts the
compile on a background thread (xgrammar releases the GIL while it compiles: the loop's worst
pause beside a 2 s compile measured 95 ms on 2 loaded cores), and ``poll`` hands back, between
steps, the requests whose grammar is ready and those that failed.

A compile still running ``budget_s`` after it started fails its request with a 400 (the
thread cannot be stopped; it finishes in the background and its spec is remembered as too
slow, so a repeat is refused at once). An invalid spec is a 400 naming the field. Requests
wait here in submission order; ``threads`` compiles run at once.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from shoal.runtime.structured.backend import GrammarBackend
from shoal.runtime.structured.spec import GrammarError, GrammarSpec

TOO_SLOW_MEMORY = 1024  # specs remembered as over budget (oldest forgotten first)


@dataclass(frozen=True)
class GrammarFailure:
    request_id: str
    param: str
    message: str


@dataclass
class _Pending:
    spec: GrammarSpec
    future: Future[None]
    started: list[float] = field(default_factory=list)  # set by the thread when it begins


def spec_digest(spec: GrammarSpec) -> bytes:
    return hashlib.sha256(f"{spec.kind}\0".encode() + spec.source.encode(
        "utf-8", "surrogatepass")).digest()


class GrammarCompiler:
    def __init__(self, backend: GrammarBackend, budget_s: float, threads: int = 1) -> None:
        self.backend = backend
        self.budget_s = budget_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._too_slow: OrderedDict[bytes, None] = OrderedDict()
        self._wake = threading.Event()

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def submit(self, request_id: str, spec: GrammarSpec) -> GrammarFailure | None:
        """Start compiling; a failure now when the spec is known to be over budget."""
        if spec_digest(spec) in self._too_slow:
            return self._over_budget(request_id, spec)
        started: list[float] = []

        def compile_it() -> None:
            started.append(time.monotonic())
            try:
                self.backend.compiled(spec)
            finally:
                self._wake.set()

        self._pending[request_id] = _Pending(spec, self._pool.submit(compile_it), started)
        return None

    def cancel(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            pending = self._pending.pop(request_id, None)
            if pending is not None:
                pending.future.cancel()  # only if it has not started

    def poll(self, now: float | None = None) -> tuple[list[str], list[GrammarFailure]]:
        """(requests now ready to schedule, requests failed), both in submission order."""
        now = time.monotonic() if now is None else now
        ready: list[str] = []
        failed: list[GrammarFailure] = []
        for request_id, pending in list(self._pending.items()):
            if pending.future.done():
                del self._pending[request_id]
                error = pending.future.exception()
                if error is None:
                    ready.append(request_id)
                elif isinstance(error, GrammarError):
                    failed.append(GrammarFailure(request_id, pending.spec.param, str(error)))
                else:  # the spec made the compiler fail: still the request's content
                    failed.append(GrammarFailure(
                        request_id, pending.spec.param,
                        f"{pending.spec.param} could not be compiled: {type(error).__name__}"))
            elif pending.started and now - pending.started[0] > self.budget_s:
                del self._pending[request_id]
                self._remember_too_slow(pending.spec)
                failed.append(self._over_budget(request_id, pending.spec))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a compile ends or ``timeout`` passes (the loop has nothing else)."""
        self._wake.wait(timeout)
        self._wake.clear()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _remember_too_slow(self, spec: GrammarSpec) -> None:
        self._too_slow[spec_digest(spec)] = None
        while len(self._too_slow) > TOO_SLOW_MEMORY:
            self._too_slow.popitem(last=False)

    def _over_budget(self, request_id: str, spec: GrammarSpec) -> GrammarFailure:
        return GrammarFailure(request_id, spec.param,
                              f"{spec.param} takes longer than {self.budget_s:g} s to compile "
                              "(--grammar-compile-timeout); simplify it")
