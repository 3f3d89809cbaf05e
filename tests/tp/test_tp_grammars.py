"""TP > 1: grammars compile in the engine core, off its loop and within its budget, as with
one rank; the plan carries each new request's grammar serialized and the ranks read it back
instead of compiling on the step (issue 36)."""

from __future__ import annotations

import json

import pytest
from shoal.runtime.executor.grammar_shipping import with_compiled_grammars
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.structured.backend import GrammarBackend
from shoal.runtime.structured.spec import GrammarSpec
from shoal.runtime.wire.messages import EngineCoreRequest
from shoal.runtime.wire.plan import NewRequestData, StepPlan

pytestmark = pytest.mark.slow

CHOICES = ["alpha beta", "gamma", "delta epsilon zeta"]


def choice_request(req_id: str, prompt: list[int], spec: GrammarSpec) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=12, structured=spec)
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt, sampling_params=params)


def test_tp2_grammar_tokens_equal_tp1_and_bad_grammars_fail_in_the_core(
        tiny_qwen2, make_engine, run_to_completion):
    spec = GrammarSpec(kind="choice", source=json.dumps(CHOICES))
    requests = [choice_request(f"r{i}", p, spec) for i, p in enumerate(
        [[3, 4, 5, 6], [900, 17, 33], list(range(40, 70))])]
    single = run_to_completion(make_engine(tiny_qwen2, tp=1), requests)
    tp2 = make_engine(tiny_qwen2, tp=2)
    backend = tp2.executor.grammar_backend()
    assert backend is not None and backend.prepared  # built before ready, in the core
    tensor_parallel = run_to_completion(tp2, requests)
    for req_id, outs in single.items():
        want = [t for o in outs for t in o.new_token_ids]
        assert [t for o in tensor_parallel[req_id] for t in o.new_token_ids] == want
    assert backend.cached(spec) and backend.compile_seconds > 0  # compiled by the core
    # an invalid grammar is a failure naming the field, decided in the core (as at TP=1)
    bad = GrammarSpec(kind="regex", source="(unclosed", param="structured_outputs.regex")
    tp2.add_request(choice_request("bad", [3, 4], bad))
    failures = []
    while tp2.has_unfinished_requests():
        tp2.step()
        failures += tp2.take_failures()
    assert [(f.request_id, f.param) for f in failures] == [("bad", "structured_outputs.regex")]


def test_a_rank_reads_the_serialized_grammar_back_without_compiling(tiny_qwen2):
    """The core's backend serializes; a rank's backend (another process in serving) installs
    it and builds a matcher from it with no compile of its own."""
    from shoal.runtime.model.config import load_model_config

    mc = load_model_config(str(tiny_qwen2))
    core, rank = (GrammarBackend(str(tiny_qwen2), mc.vocab_size, mc.eos_token_ids)
                  for _ in range(2))
    spec = GrammarSpec(kind="choice", source=json.dumps(CHOICES))
    new = NewRequestData("r", [1, 2], [], SamplingParams(structured=spec))
    plain = NewRequestData("p", [1, 2], [], SamplingParams())
    plan = StepPlan(step_id=0, req_ids=[], input_ids=None, positions=None,  # type: ignore[arg-type]
                    query_start_loc=None, seq_lens=None, block_tables=None,  # type: ignore[arg-type]
                    slot_mapping=None, sample_rows=None,  # type: ignore[arg-type]
                    new_requests=[new, plain], finished_req_ids=[])
    sent = with_compiled_grammars(plan, core)
    assert new.compiled_grammar is None  # the scheduler's own plan is left as it was
    assert sent.new_requests[1] is plain and sent.new_requests[0].compiled_grammar
    rank.install(spec, sent.new_requests[0].compiled_grammar)
    matcher = rank.matcher(spec)
    assert rank.compile_seconds == 0.0 and rank.cached(spec)
    from shoal.runtime.frontend.tokenizer import Tokenizer

    tokens = Tokenizer.from_dir(tiny_qwen2).encode("gamma", add_special_tokens=False)
    assert all(matcher.accept(t) for t in tokens)


def test_a_grammar_travels_to_the_ranks_once_and_is_serialized_by_the_compile(tiny_qwen2):
    """The core's backend serializes when it compiles (its compile thread, not the step);
    the second plan naming the same grammar carries none and the rank's cache serves it."""
    from shoal.runtime.executor.grammar_shipping import ShippedGrammars
    from shoal.runtime.model.config import load_model_config

    mc = load_model_config(str(tiny_qwen2))
    core = GrammarBackend(str(tiny_qwen2), mc.vocab_size, mc.eos_token_ids,
                          serialize_on_compile=True)
    rank = GrammarBackend(str(tiny_qwen2), mc.vocab_size, mc.eos_token_ids)
    spec = GrammarSpec(kind="choice", source=json.dumps(CHOICES))
    core.compiled(spec)  # what the core's compile thread does
    made_by_the_compile = core._cache[(spec.kind, spec.source)][2]
    assert made_by_the_compile is not None
    shipped = ShippedGrammars()
    sent: list[NewRequestData] = []
    for step, ids in enumerate((["a"], ["b", "c"])):
        news = [NewRequestData(i, [1, 2], [], SamplingParams(structured=spec)) for i in ids]
        plan = StepPlan(step_id=step, req_ids=[], input_ids=None,  # type: ignore[arg-type]
                        positions=None, query_start_loc=None,  # type: ignore[arg-type]
                        seq_lens=None, block_tables=None,  # type: ignore[arg-type]
                        slot_mapping=None, sample_rows=None,  # type: ignore[arg-type]
                        new_requests=news, finished_req_ids=[])
        sent += with_compiled_grammars(plan, core, shipped).new_requests
    assert [n.compiled_grammar is not None for n in sent] == [True, False, False]
    assert sent[0].compiled_grammar is made_by_the_compile  # not serialized on the step
    rank.install(spec, sent[0].compiled_grammar)
    for _ in sent[1:]:
        rank.matcher(spec)  # a hit: nothing compiled on the rank
    assert rank.compile_seconds == 0.0


def test_the_ledger_forgets_least_recently_used_grammars_within_its_bounds():
    from shoal.runtime.executor.grammar_shipping import ShippedGrammars

    specs = [GrammarSpec(kind="regex", source=f"a{i}") for i in range(4)]
    shipped = ShippedGrammars(max_entries=2, max_bytes=100)
    assert [shipped.must_send(s, 10) for s in specs[:2]] == [True, True]
    assert not shipped.must_send(specs[0], 10)  # now the most recent
    assert shipped.must_send(specs[2], 10)  # specs[1] forgotten
    assert shipped.must_send(specs[1], 10) and not shipped.must_send(specs[1], 10)
    big = ShippedGrammars(max_entries=8, max_bytes=100)
    assert big.must_send(specs[0], 60) and big.must_send(specs[1], 60)  # over the bytes
    assert len(big) == 1 and big.must_send(specs[0], 60)
