"""The offline API: text and token-id prompts, greedy equal to HF, n > 1, seeds, stop
strings, logprobs, and bad input rejected before anything reaches the engine."""

from __future__ import annotations

import pytest
from shoal.runtime.llm import LLM
from shoal.runtime.sampling_params import InvalidParameter, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_qwen3):
    return LLM(tiny_qwen3, dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64,
               block_size=8)


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def test_text_prompts_decode_to_text_and_match_hf_greedy(llm, tiny_qwen3, hf_greedy,
                                                        assert_matches_hf):
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    prompts = ["def main():\n    return", "import os\nimport sys", "class Foo"]
    results = llm.generate(prompts, greedy())
    assert [r.prompt for r in results] == prompts
    for result in results:
        (completion,) = result.outputs
        assert result.prompt_token_ids == hf_tokenizer.encode(result.prompt)
        assert completion.text == llm.tokenizer.decode(completion.token_ids,
                                                       skip_special_tokens=True)
        assert completion.finish_reason == "length" and len(completion.token_ids) == 12
    near_ties = assert_matches_hf(
        hf_greedy(tiny_qwen3), {r.request_id: r.prompt_token_ids for r in results},
        {r.request_id: r.outputs[0].token_ids for r in results},
        {r.request_id: 12 for r in results})
    assert near_ties <= 1
    assert llm.engine.stats().num_running == 0


def test_token_id_prompts_single_and_batched(llm):
    single = llm.generate([5, 6, 7, 8], greedy(4))
    batched = llm.generate([[5, 6, 7, 8], [9, 10]], greedy(4))
    assert len(single) == 1 and single[0].prompt is None
    assert single[0].outputs[0].token_ids == batched[0].outputs[0].token_ids
    assert [len(r.outputs[0].token_ids) for r in batched] == [4, 4]


def test_n_samples_are_seeded_reproducible_distinct_and_share_the_prompt(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=10, ignore_eos=True)
    prompt = list(range(100, 140))  # 40 tokens: 4 full blocks of 8 are shared
    first = llm.generate(prompt, params)[0]
    again = llm.generate(prompt, params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert first.num_cached_tokens == 32
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1  # seeds differ per sample


def test_top_k_1_equals_greedy(llm):
    a = llm.generate("for x in range", greedy(10))[0].outputs[0].token_ids
    b = llm.generate("for x in range", SamplingParams(top_k=1, max_tokens=10,
                                                      ignore_eos=True))[0].outputs[0].token_ids
    assert a == b


def test_stop_string_ends_the_request_and_trims_the_text(llm):
    full = llm.generate("while True:", greedy(24))[0].outputs[0]
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip(), "the generated text is blank; pick another prompt"
    cut = llm.generate("while True:", greedy(24, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.find(stop)]
    assert len(cut.token_ids) < 24
    kept = llm.generate("while True:", greedy(24, stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == full.text[:full.text.find(stop) + len(stop)]
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()


def test_logprobs_carry_the_sampled_token_and_top_alternatives(llm):
    completion = llm.generate("x = 1", greedy(5, logprobs=3))[0].outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 5
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert len(entry.top_token_ids) == 3 and entry.top_token_ids[0] == token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0], abs=1e-5)
        assert entry.top_logprobs == sorted(entry.top_logprobs, reverse=True)


def test_one_bad_prompt_rejects_the_whole_call_before_the_engine_sees_it(llm):
    before = llm.engine.stats()
    with pytest.raises(InvalidParameter) as err:
        llm.generate(["fine", list(range(3, 200))], greedy())
    assert err.value.param == "prompt"
    with pytest.raises(InvalidParameter, match="top_p"):
        llm.generate("fine", SamplingParams(top_p=0.0))
    assert llm.engine.stats() == before
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()


def test_unknown_engine_argument_is_an_error(tiny_qwen3):
    with pytest.raises(TypeError, match="bogus_flag"):
        LLM(tiny_qwen3, bogus_flag=1)


def test_prompt_logprobs_over_chunked_prefill_equal_hfs_log_softmax(tiny_llama):
    """A prompt longer than the step budget is scored chunk by chunk; a cached copy of it
    is still computed in full (no prefix-cache reads for such a request)."""
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_llama, max_num_batched_tokens=16, num_kv_blocks=64)
    text = "def main():\n    return some_value + other_value * 2  # and a longer line"
    llm.generate(text, greedy(2))  # its full blocks are now cached
    (out,) = llm.generate(text, greedy(2, prompt_logprobs=2))
    ids = out.prompt_token_ids
    assert len(ids) > 16 and out.num_cached_tokens == 0
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert entry is not None
        assert abs(entry.logprob - reference[i - 1, ids[i]].item()) < 1e-4
        assert entry.top_token_ids == reference[i - 1].topk(2).indices.tolist()
