"""Request keys: what a prompt's prefix looks like to the router."""

from __future__ import annotations

import pytest
from shoal.runtime.kv.block_hash import ExtraKeys, hash_prefix_blocks
from shoal.runtime.router.policies.block_index import BlockIndex
from shoal.runtime.router.policies.request_keys import (
    KeyConfig,
    PromptTokenizer,
    RequestKeyError,
    request_keys,
)

CFG = KeyConfig(block_size=4, chars_per_block=8)


def test_shared_text_prefix_shares_leading_keys():
    a = request_keys("/v1/completions", {"prompt": "A" * 40 + "tail one"}, CFG)
    b = request_keys("/v1/completions", {"prompt": "A" * 40 + "other tail"}, CFG)
    assert not a.precise
    assert a.block_keys[:5] == b.block_keys[:5]
    assert a.block_keys[5] != b.block_keys[5]
    assert a.ring_key == b.ring_key


def test_chat_turns_extend_the_previous_turns_keys():
    first = [{"role": "system", "content": "S" * 30}, {"role": "user", "content": "hi " * 10}]
    later = first + [{"role": "assistant", "content": "answer " * 5},
                     {"role": "user", "content": "more"}]
    a = request_keys("/v1/chat/completions", {"messages": first}, CFG)
    b = request_keys("/v1/chat/completions", {"messages": later}, CFG)
    assert b.block_keys[:len(a.block_keys)] == a.block_keys
    assert len(b.block_keys) > len(a.block_keys)


def test_token_id_prompts_hash_like_the_engine():
    ids = list(range(100, 118))
    keys = request_keys("/v1/completions", {"prompt": ids, "cache_salt": "t1"},
                        KeyConfig(block_size=4, model_revision="r1"))
    assert keys.precise
    assert keys.block_keys == hash_prefix_blocks(ids, 4, ExtraKeys("r1", None, "t1").digest())


def test_cache_salt_separates_tenants():
    a = request_keys("/v1/completions", {"prompt": "x" * 32, "cache_salt": "a"}, CFG)
    b = request_keys("/v1/completions", {"prompt": "x" * 32, "cache_salt": "b"}, CFG)
    assert set(a.block_keys).isdisjoint(b.block_keys)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"prompt": "x"}),
    ("/v1/completions", {"messages": []}),
    ("/v1/completions", {"prompt": 3}),
])
def test_bad_bodies_are_rejected_clearly(path, body):
    with pytest.raises(RequestKeyError):
        request_keys(path, body, CFG)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_precise_keys_are_the_block_hashes_of_hfs_token_ids(arch, tiny_model_dirs):
    """The router keys over the ids HF (and so the engine) runs: the chat template's
    rendering, and text prompts with the BOS a llama-style tokenizer adds."""
    from transformers import AutoTokenizer

    model_dir = tiny_model_dirs[arch]
    hf = AutoTokenizer.from_pretrained(model_dir)
    router_tok = PromptTokenizer(model_dir)
    messages = [{"role": "system", "content": "You are terse. " * 10},
                {"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    keys = request_keys("/v1/chat/completions", {"messages": messages},
                        KeyConfig(block_size=16), router_tok)
    ids = list(hf.apply_chat_template(
        [messages[0], {"role": "user", "content": "Hello there"}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"])
    assert keys.precise and keys.num_units == len(ids)
    assert keys.block_keys == hash_prefix_blocks(ids, 16, ExtraKeys().digest())
    prompt = "Once upon a time " * 8
    keys = request_keys("/v1/completions", {"prompt": prompt}, KeyConfig(block_size=16),
                        router_tok)
    assert keys.num_units == len(hf.encode(prompt))
    assert keys.block_keys == hash_prefix_blocks(hf.encode(prompt), 16, ExtraKeys().digest())


def test_block_index_matches_leading_run_and_follows_events():
    approx = BlockIndex(precise=False, capacity=4)
    approx.record_routed([1, 2, 3], now=0)
    assert approx.match_length([1, 2, 9, 3], now=0) == 2
    approx.record_routed([7, 8], now=0)  # capacity 4: the oldest key (1) is forgotten
    assert approx.match_length([1, 2], now=0) == 0
    precise = BlockIndex(precise=True, pending_ttl_s=5)
    precise.record_routed([1, 2], now=0)
    assert precise.blocks() == frozenset()  # routed is not cached until the engine says so
    assert precise.match_length([1, 2], now=1) == 2  # ... but counts as pending for a while
    assert precise.match_length([1, 2], now=6) == 0
    precise.stored([1, 2, 3])
    precise.removed([2])
    assert precise.blocks() == {1, 3}
    assert precise.match_length([1, 2, 3], now=10) == 1
    precise.cleared()
    assert len(precise) == 0


def test_the_engines_tokenizer_over_the_wire_encodes_the_same(tiny_qwen3):
    """`GET /tokenizer` (Tokenizer.to_wire) rebuilt in the router encodes like the engine."""
    import json

    from shoal.runtime.frontend.tokenizer import Tokenizer

    local = Tokenizer.from_dir(tiny_qwen3)
    fetched = PromptTokenizer(Tokenizer.from_wire(json.loads(json.dumps(local.to_wire()))))
    messages = [{"role": "user", "content": "Where is the harbor master?"}]
    assert fetched.encode_chat(messages) == PromptTokenizer(tiny_qwen3).encode_chat(messages)
    assert fetched.tokenizer.special_token_ids == local.special_token_ids
    with pytest.raises(ValueError):
        Tokenizer.from_wire({"chat_template": "x"})


def test_a_template_that_raises_is_a_request_key_error(alternating_qwen3):
    """The router then forwards the request and the engine answers its own 400."""
    tokenizer = PromptTokenizer(alternating_qwen3)
    body = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(RequestKeyError, match="alternate"):
        request_keys("/v1/chat/completions", body, KeyConfig(), tokenizer)
    ok = {"messages": [{"role": "user", "content": "a"}]}
    assert request_keys("/v1/chat/completions", ok, KeyConfig(), tokenizer).precise


def test_an_authenticated_tenants_keys_are_salted_as_the_engines_salt_its_blocks():
    from shoal.runtime.kv.block_hash import effective_cache_salt

    from shoal.contract.tenant import tenant_of_key

    ids, tenant = list(range(100, 118)), tenant_of_key("key-of-a")
    body = {"prompt": ids, "cache_salt": "s"}
    per_tenant = KeyConfig(block_size=4, model_revision="r1")
    keys = request_keys("/v1/completions", body, per_tenant, None, tenant)
    engine_salt = effective_cache_salt(tenant, "s")  # what serving_common gives the engine
    assert keys.block_keys == hash_prefix_blocks(ids, 4, ExtraKeys("r1", None, engine_salt).digest())
    other = request_keys("/v1/completions", body, per_tenant, None, tenant_of_key("key-of-b"))
    assert set(keys.block_keys).isdisjoint(other.block_keys)
    shared = KeyConfig(block_size=4, model_revision="r1", per_tenant_cache=False)
    assert (request_keys("/v1/completions", body, shared, None, tenant).block_keys
            == request_keys("/v1/completions", body, shared).block_keys)
