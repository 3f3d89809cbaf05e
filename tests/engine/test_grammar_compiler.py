"""The engine core's background grammar compiler (runtime/structured/compiler.py) and the
size bounds checked before it (runtime/structured/spec.py). A stand-in backend whose
compile blocks until released makes the budget deterministic."""

from __future__ import annotations

import json
import threading
import time

import pytest
from shoal.runtime.sampling_params import InvalidParameter, SamplingParams
from shoal.runtime.structured.compiler import GrammarCompiler
from shoal.runtime.structured.spec import (
    MAX_CHOICES,
    MAX_GRAMMAR_BYTES,
    MAX_REGEX_CHARS,
    GrammarError,
    GrammarSpec,
    grammar_bounds_error,
)


class HeldBackend:
    """compiled() blocks on ``release`` for sources starting with "slow"; "bad" raises."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[str] = []

    def compiled(self, spec: GrammarSpec) -> object:
        self.calls.append(spec.source)
        if spec.source.startswith("slow"):
            self.release.wait(30)
        if spec.source.startswith("bad"):
            raise GrammarError(f"invalid grammar for {spec.param}: nope")
        return object()

    def cached(self, spec: GrammarSpec) -> bool:
        return False


def poll_until(compiler: GrammarCompiler, done, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    ready, failed = [], []
    while time.monotonic() < deadline:
        r, f = compiler.poll()
        ready += r
        failed += f
        if done(ready, failed):
            return ready, failed
        compiler.wait(0.01)
    raise AssertionError(f"not done: ready={ready} failed={failed}")


def spec(source: str, param: str = "structured_outputs.grammar") -> GrammarSpec:
    return GrammarSpec(kind="grammar", source=source, param=param)


def test_ready_and_invalid_grammars_come_back_in_order_naming_the_field() -> None:
    compiler = GrammarCompiler(HeldBackend(), budget_s=5.0)  # type: ignore[arg-type]
    assert compiler.submit("a", spec("root ::= 'x'")) is None
    assert compiler.submit("b", spec("bad one")) is None
    ready, failed = poll_until(compiler, lambda r, f: len(r) + len(f) == 2)
    assert ready == ["a"]
    assert [(f.request_id, f.param) for f in failed] == [("b", "structured_outputs.grammar")]
    assert len(compiler) == 0
    compiler.shutdown()


def test_a_compile_over_budget_fails_its_request_and_a_repeat_fails_at_once() -> None:
    backend = HeldBackend()
    compiler = GrammarCompiler(backend, budget_s=0.05)  # type: ignore[arg-type]
    try:
        compiler.submit("slow-1", spec("slow grammar"))
        _, failed = poll_until(compiler, lambda r, f: f)
        assert failed[0].request_id == "slow-1"
        assert "longer than 0.05 s to compile" in failed[0].message
        # the same spec again (another user, another id): refused without compiling
        repeat = compiler.submit("slow-2", spec("slow grammar"))
        assert repeat is not None and repeat.request_id == "slow-2"
        assert backend.calls.count("slow grammar") == 1
    finally:
        backend.release.set()
        compiler.shutdown()


def test_the_budget_counts_from_when_a_compile_starts_not_while_it_queues() -> None:
    backend = HeldBackend()
    compiler = GrammarCompiler(backend, budget_s=0.2)  # type: ignore[arg-type]
    try:
        compiler.submit("first", spec("slow first"))
        compiler.submit("queued", spec("root ::= 'y'"))
        _, failed = poll_until(compiler, lambda r, f: f)
        assert [f.request_id for f in failed] == ["first"]
        time.sleep(0.3)  # queued behind the thread still compiling "first", past the budget
        assert compiler.poll() == ([], []) and "queued" in compiler
        backend.release.set()
        ready, failed = poll_until(compiler, lambda r, f: r or f)
        assert ready == ["queued"] and not failed
    finally:
        backend.release.set()
        compiler.shutdown()


def test_a_cancelled_request_is_never_reported() -> None:
    backend = HeldBackend()
    compiler = GrammarCompiler(backend, budget_s=5.0)  # type: ignore[arg-type]
    try:
        compiler.submit("slow", spec("slow x"))
        compiler.submit("gone", spec("root ::= 'z'"))
        compiler.cancel(["gone"])
        backend.release.set()
        ready, failed = poll_until(compiler, lambda r, f: r)
        assert ready == ["slow"] and not failed and "gone" not in compiler
    finally:
        backend.release.set()
        compiler.shutdown()


@pytest.mark.parametrize("grammar, fragment", [
    (GrammarSpec(kind="choice", source=json.dumps(["x"] * (MAX_CHOICES + 1)),
                 param="structured_outputs.choice"), "entries"),
    (GrammarSpec(kind="regex", source="a" * (MAX_REGEX_CHARS + 1),
                 param="structured_outputs.regex"), "characters"),
    (GrammarSpec(kind="json", source=json.dumps({"enum": ["v" * 64] * 5000}),
                 param="response_format.json_schema"), "bytes"),
    (GrammarSpec(kind="grammar", source="root ::= " + "'a' | " * MAX_GRAMMAR_BYTES,
                 param="structured_outputs.grammar"), "bytes"),
])
def test_sources_over_the_bounds_are_invalid_parameters_naming_the_field(grammar,
                                                                          fragment) -> None:
    assert fragment in (grammar_bounds_error(grammar) or "")
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(structured=grammar).validate()
    assert err.value.param == grammar.param


def test_sources_within_the_bounds_pass() -> None:
    for grammar in (GrammarSpec(kind="choice", source=json.dumps(["x"] * MAX_CHOICES)),
                    GrammarSpec(kind="regex", source="[0-9]{4}"),
                    GrammarSpec(kind="json_object")):
        assert grammar_bounds_error(grammar) is None
        SamplingParams(structured=grammar).validate()
