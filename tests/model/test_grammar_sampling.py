"""Grammar masks in the batched sampler: constrained rows only emit what their grammar
allows, unconstrained batch mates are untouched, and a rebuilt state (preemption) replays
the output so far to the same grammar position."""

from __future__ import annotations

import json

import pytest
import torch
from shoal.runtime.sample.sampler import Sampler
from shoal.runtime.sample.state import build_sampling_metadata, new_request_state
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.structured.backend import GrammarBackend
from shoal.runtime.structured.spec import GrammarSpec, json_schema_spec

CPU = torch.device("cpu")
SCHEMA = {"type": "object", "required": ["n", "ok"], "additionalProperties": False,
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def grammars(tiny_qwen2) -> GrammarBackend:
    config = json.loads((tiny_qwen2 / "config.json").read_text())
    return GrammarBackend(str(tiny_qwen2), config["vocab_size"], [1, 2])


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2):
    from shoal.runtime.frontend.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_qwen2)


def run(states, grammars, steps, seed=0):
    """Sample ``steps`` tokens for every state from random logits; returns them per row."""
    gen = torch.Generator().manual_seed(seed)
    sampler = Sampler(torch.Generator().manual_seed(seed))
    vocab = grammars.vocab_size
    out: list[list[int]] = [[] for _ in states]
    for _ in range(steps):
        logits = torch.randn(len(states), vocab, generator=gen) * 5
        result = sampler(logits, build_sampling_metadata(states, vocab, CPU))
        for row, (state, token) in enumerate(zip(states, result.sampled_token_ids.tolist(),
                                                 strict=True)):
            if state.grammar is not None and state.grammar.finished:
                continue
            state.append(token)
            out[row].append(token)
    return out


def test_constrained_rows_follow_their_grammars_beside_a_free_row(grammars, tokenizer) -> None:
    specs = [json_schema_spec(SCHEMA, "response_format"),
             GrammarSpec(kind="choice", source='["alpha", "beta"]'), None]
    states = [new_request_state(SamplingParams(temperature=t, structured=s), [5], [], 0, [1, 2],
                                grammars.vocab_size, CPU, grammars if s else None)
              for s, t in zip(specs, (1.0, 0.0, 1.0), strict=True)]
    rows = run(states, grammars, 40)
    text = tokenizer.decode(rows[0][:-1])  # the last token is the stop token
    assert rows[0][-1] in (1, 2) and states[0].grammar.finished
    value = json.loads(text)
    assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99
    assert tokenizer.decode(rows[1][:-1]) in ("alpha", "beta")
    assert len(rows[2]) == 40  # the free row sampled every step, unconstrained
    assert not set(rows[2]) <= set(rows[0] + rows[1])


def test_a_rebuilt_state_resumes_the_grammar_where_the_output_left_it(grammars,
                                                                      tokenizer) -> None:
    spec = json_schema_spec(SCHEMA, "response_format")
    params = SamplingParams(temperature=1.0, structured=spec)
    first = new_request_state(params, [5], [], 0, [1, 2], grammars.vocab_size, CPU, grammars)
    head = run([first], grammars, 4, seed=1)[0]
    # preemption: the worker drops the state; the plan re-sends the output so far
    resumed = new_request_state(params, [5], head, 0, [1, 2], grammars.vocab_size, CPU,
                                grammars)
    tail = run([resumed], grammars, 40, seed=2)[0]
    assert json.loads(tokenizer.decode(head + tail[:-1]))["ok"] in (True, False)
    with pytest.raises(ValueError, match="breaks its grammar"):
        new_request_state(params, [5], tokenizer.encode("nope"), 0, [1, 2],
                          grammars.vocab_size, CPU, grammars)


def test_compiled_grammars_are_cached_per_spec(grammars) -> None:
    spec = GrammarSpec(kind="regex", source="[0-9]{4}")
    assert grammars.compiled(spec) is grammars.compiled(GrammarSpec(kind="regex",
                                                                    source="[0-9]{4}"))
    assert grammars.compiled(spec) is not grammars.compiled(GrammarSpec(kind="regex",
                                                                        source="[0-9]{5}"))


def test_the_grammar_cache_is_bounded_in_bytes_oldest_out_first(tiny_qwen2) -> None:
    """Issue 36: compiled grammars hold memory by the vocabulary (a large choice list, tens
    of MB on a real one); the cache keeps what xgrammar reports under ``cache_bytes``."""
    config = json.loads((tiny_qwen2 / "config.json").read_text())
    specs = [GrammarSpec(kind="choice", source=json.dumps([f"option {k} {i}" for i in range(40)]))
             for k in range(6)]
    probe = GrammarBackend(str(tiny_qwen2), config["vocab_size"], [1, 2])
    probe.compiled(specs[0])
    one = probe.memory_bytes(specs[0])
    assert one > 0  # xgrammar reports a size
    backend = GrammarBackend(str(tiny_qwen2), config["vocab_size"], [1, 2],
                             cache_bytes=int(one * 2.5))
    for spec in specs:
        backend.compiled(spec)
        assert 0 < backend.cached_bytes <= backend.cache_bytes
    assert backend.cached(specs[-1]) and not backend.cached(specs[0])
    assert sum(backend.cached(spec) for spec in specs) <= 2


def test_the_compiler_is_built_once_by_prepare_and_requests_reuse_it(tiny_qwen2) -> None:
    config = json.loads((tiny_qwen2 / "config.json").read_text())
    backend = GrammarBackend(str(tiny_qwen2), config["vocab_size"], [1, 2])
    assert not backend.prepared
    assert backend.prepare()
    assert backend.prepared
    compiler = backend._get_compiler()
    assert backend.compiled(GrammarSpec(kind="regex", source="[a-z]{3}")) is not None
    assert backend.prepare()
    assert backend._get_compiler() is compiler  # not rebuilt by a request or a second call


def test_a_compiler_that_cannot_be_built_does_not_stop_the_worker(tmp_path, caplog) -> None:
    backend = GrammarBackend(str(tmp_path), 1024, [1])  # no tokenizer files here
    assert not backend.prepare()  # logged, not raised: unconstrained requests still run
    assert "preparing the grammar compiler failed" in caplog.text
    with pytest.raises(ValueError):  # a structured request gets the error
        backend.compiled(GrammarSpec(kind="regex", source="[a-z]"))


def test_a_grammar_after_a_marker_leaves_the_reasoning_free_then_constrains(grammars,
                                                                            tokenizer) -> None:
    """Reasoning models: ``start_after`` (the ``</think>`` tokens) frees every token before
    it, and the output after it matches the grammar, also when the state is rebuilt."""
    marker = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    spec = GrammarSpec(kind="choice", source='["alpha", "beta"]', start_after=marker)
    params = SamplingParams(temperature=1.0, structured=spec)
    state = new_request_state(params, [5], [], 0, [1, 2], grammars.vocab_size, CPU, grammars)
    free = run([state], grammars, 12, seed=3)[0]
    assert state.grammar is None and state.pending_grammar is not None
    assert not all(tokenizer.decode([t]) in "alphabeta" for t in free)  # not constrained
    for token in marker:  # the model writes the end of its reasoning
        state.append(token)
    assert state.grammar is not None
    after = run([state], grammars, 10, seed=4)[0]
    assert tokenizer.decode(after) in ("alpha", "beta")
    rebuilt = new_request_state(params, [5], free + list(marker) + after[:1], 0, [1, 2],
                                grammars.vocab_size, CPU, grammars)
    assert rebuilt.grammar is not None and rebuilt.pending_grammar is None
    rest = run([rebuilt], grammars, 10, seed=5)[0]
    assert tokenizer.decode(after[:1] + rest) in ("alpha", "beta")
