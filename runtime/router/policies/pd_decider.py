"""P/D disaggregation's per-request decision, shared by the proxy (``proxy/pd.py``) and the
Endpoint Picker (``epp/picker.py``) so ``--pd-threshold`` means the same in both modes.

As llm-d's prefix-based P/D decider does: the decode replica is chosen first (cache affinity,
load), then the prompt tokens that replica is not believed to hold decide: above the threshold
a prefill replica computes the prompt and the decode replica pulls its KV; short or cached
prompts go straight to decode, where moving the KV would cost more than computing it.

Uncached tokens: with token-precise keys (a tokenizer), the prompt's tokens less the matched
blocks'; with approximate keys, characters over ``CHARS_PER_TOKEN``.
"""

from __future__ import annotations

from collections.abc import Sequence

from shoal.runtime.router.policies.base import Decision, ReplicaSnapshot
from shoal.runtime.router.policies.request_keys import KeyConfig, RequestKeys

CHARS_PER_TOKEN = 4  # approximate keys count characters; English text runs ~4 per token


def uncached_tokens(keys: RequestKeys, matched_blocks: int, config: KeyConfig) -> int:
    """Prompt tokens the chosen replica is not believed to hold."""
    if keys.precise:
        return max(0, keys.num_units - matched_blocks * config.block_size)
    return max(0, keys.num_units - matched_blocks * config.chars_per_block) // CHARS_PER_TOKEN


def wants_remote_prefill(keys: RequestKeys | None, decision: Decision, config: KeyConfig,
                         threshold: int) -> bool:
    """No keys (a body the router cannot read): no P/D, the decode replica answers it."""
    return keys is not None and uncached_tokens(keys, decision.matched_blocks,
                                                config) > threshold


def least_loaded(replicas: Sequence[ReplicaSnapshot]) -> ReplicaSnapshot:
    """The prefill replica for a prompt: fewest requests open or queued on it (prefill is
    compute-bound, so queue depth is its latency); the url breaks ties deterministically."""
    return min(replicas, key=lambda r: (r.in_flight + r.num_waiting, r.url))
