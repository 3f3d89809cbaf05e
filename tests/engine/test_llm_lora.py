"""The offline API with LoRA adapters, vLLM's shape: ``LLM(..., enable_lora=True)`` and
``generate(..., lora_request=LoRARequest(name, id, path))``, one for all prompts or one per
prompt (None: the base), greedy equal to transformers + peft; misuse refused clearly."""

from __future__ import annotations

import random

import pytest
from shoal.runtime.llm import LLM, LoRARequest
from shoal.runtime.sampling_params import SamplingParams

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=128,
               num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=16)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_per_prompt_adapters_and_the_base_mixed_equal_peft(llm, tiny_llama, llama_adapters,
                                                           hf_greedy):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 19, 9, 30)]
    qv8 = LoRARequest("qv8", 1, str(llama_adapters["qv8"]))
    mlp16 = LoRARequest("mlp16", 2, str(llama_adapters["mlp16"]))
    chosen = [qv8, None, mlp16, qv8]
    results = llm.generate(prompts, greedy(), lora_request=chosen)
    for prompt, request, result in zip(prompts, chosen, results, strict=True):
        reference = hf_greedy(tiny_llama, llama_adapters[request.lora_name] if request else None)
        got = result.outputs[0].token_ids
        assert reference.agrees(prompt, got), (request, got,
                                               reference.generate(prompt, MAX_TOKENS))
    # one request for every prompt; the adapter (already loaded) is reused
    together = llm.generate(prompts, greedy(), lora_request=mlp16)
    base = llm.generate(prompts, greedy())
    reference = hf_greedy(tiny_llama, llama_adapters["mlp16"])
    for prompt, result in zip(prompts, together, strict=True):
        assert reference.agrees(prompt, result.outputs[0].token_ids)
    assert sum(a.outputs[0].token_ids != b.outputs[0].token_ids
               for a, b in zip(together, base, strict=True)) >= 2  # the adapter acts


def test_misuse_is_refused_before_anything_runs(llm, tiny_llama, llama_adapters, tmp_path):
    qv8 = LoRARequest("qv8", 1, str(llama_adapters["qv8"]))
    llm.generate([[5, 6, 7]], greedy(), lora_request=qv8)
    with pytest.raises(ValueError, match="already loaded as id 1"):
        llm.generate([[5, 6]], greedy(), lora_request=LoRARequest("qv8", 9,
                                                                 str(llama_adapters["qv8"])))
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'qv8'"):
        llm.generate([[5, 6]], greedy(), lora_request=LoRARequest("other", 1,
                                                                 str(llama_adapters["mlp16"])))
    with pytest.raises(ValueError, match="2 lora requests for 1 prompts"):
        llm.generate([[5, 6]], greedy(), lora_request=[qv8, None])
    with pytest.raises(ValueError, match="not a directory"):
        llm.generate([[5, 6]], greedy(),
                     lora_request=LoRARequest("missing", 5, str(tmp_path / "absent")))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/x")
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[5, 6, 7]], greedy(), lora_request=qv8)[0].outputs[0].token_ids) \
        == MAX_TOKENS  # still serving


def test_lora_request_without_enable_lora_is_refused(tiny_llama, llama_adapters):
    plain = LLM(tiny_llama, dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate([[5, 6]], greedy(),
                       lora_request=LoRARequest("qv8", 1, str(llama_adapters["qv8"])))
