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
from dataclasses import dataclass

from shoal.runtime.router.policies.base import Decision, ReplicaSnapshot
from shoal.runtime.router.policies.request_keys import KeyConfig, RequestKeys

CHARS_PER_TOKEN = 4  # approximate keys count characters; English text runs ~4 per token


def uncached_tokens(keys: RequestKeys, matched_blocks: int, config: KeyConfig) -> int:
    """Prompt tokens the chosen replica is not believed to hold."""
    if keys.precise:
        return max(0, keys.num_units - matched_blocks * config.block_size)
    return max(0, keys.num_units - matched_blocks * config.chars_per_block) // CHARS_PER_TOKEN


# why a prompt did or did not get a prefill leg: the ``reason`` label of
# ``shoal:router_pd_decisions`` (the proxy's and the Endpoint Picker's /metrics)
REASON_UNCACHED = "uncached_prompt"  # remote: more uncached tokens than the threshold
REASON_SHORT = "short_prompt"  # local: the whole prompt is within the threshold
REASON_CACHED = "cached_prefix"  # local: long, but the decode replica holds enough of it
REASON_NO_KEYS = "unkeyed_body"  # local: a body the router cannot read (the engine judges it)
REASON_NO_PREFILL = "no_prefill_replica"  # local: worth it, but no prefill replica is ready
REASON_PREFILL_ERROR = "prefill_error"  # failed: the prefill leg failed, decode computes it


@dataclass(frozen=True)
class PDChoice:
    remote: bool  # a prefill replica computes the prompt
    reason: str  # one of the REASON_* above


def pd_choice(keys: RequestKeys | None, decision: Decision, config: KeyConfig,
              threshold: int) -> PDChoice:
    """No keys (a body the router cannot read): no P/D, the decode replica answers it."""
    if keys is None:
        return PDChoice(False, REASON_NO_KEYS)
    if uncached_tokens(keys, decision.matched_blocks, config) > threshold:
        return PDChoice(True, REASON_UNCACHED)
    if uncached_tokens(keys, 0, config) > threshold:
        return PDChoice(False, REASON_CACHED)
    return PDChoice(False, REASON_SHORT)


def least_loaded(replicas: Sequence[ReplicaSnapshot]) -> ReplicaSnapshot:
    """The prefill replica for a prompt: fewest requests open or queued on it (prefill is
    compute-bound, so queue depth is its latency); the url breaks ties deterministically."""
    return min(replicas, key=lambda r: (r.in_flight + r.num_waiting, r.url))
