"""DeepSeek-V3 (multi-head latent attention, DeepSeek's MoE routing) served over HTTP: greedy
equal to transformers' ``DeepseekV3ForCausalLM`` token for token for concurrent requests of
different lengths, with chunked prefill (16-token steps), prefix-cache hits (a shared system
prompt) and preemption (a cache of 20 blocks of 4 tokens, what /metrics' ``cache_config_info``
reports; the latent bytes per token and the byte budget -> block count arithmetic are
tests/model/test_mla.py's)."""

from __future__ import annotations

import random
import re

from shoal.runtime.model.make_mla_model import cached_mla_model

from tests.api.conftest import assert_equal_up_to_a_near_tie, greedy_token_ids
from tests.hf_reference import NEAR_TIE

MAX_TOKENS = 16
BLOCK = 4


def test_deepseek_v3_over_http_equals_hf_with_chunking_prefix_hits_and_preemption(
        start_server, hf_greedy):
    model_dir = cached_mla_model("deepseek_v3")
    server = start_server("--block-size", str(BLOCK), "--num-kv-blocks", "20",
                          "--max-num-batched-tokens", "16", "--max-model-len", "64",
                          model_dir=model_dir)
    info = re.search(r'^shoal:cache_config_info\{([^}]*)\}', _metrics(server), re.M)
    assert info and 'num_gpu_blocks="20"' in info.group(1)

    rng = random.Random(3)
    system = [rng.randrange(3, 1000) for _ in range(16)]
    prompts = [system + [rng.randrange(3, 1000) for _ in range(n)] for n in (2, 5, 9, 14)]
    prompts.append([rng.randrange(3, 1000) for _ in range(7)])  # no shared prefix
    outputs = greedy_token_ids(server, prompts, MAX_TOKENS)
    assert server.metric("shoal:num_preemptions_total") > 0
    assert server.metric("shoal:prefix_cache_hits_total") >= 16

    reference = hf_greedy(model_dir)
    for prompt, ours in zip(prompts, outputs, strict=True):
        want, margins = reference.generate(prompt, MAX_TOKENS)
        assert_equal_up_to_a_near_tie(ours, want, margins, NEAR_TIE)


def _metrics(server) -> str:
    import httpx

    return httpx.get(server.base_url + "/metrics", headers=server.headers(), timeout=5).text
