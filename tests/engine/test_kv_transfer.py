"""P/D disaggregation at the engine core: a prefill engine's prompt blocks pulled over TCP
(loopback) into a decode engine, which continues the generation from them.

Two real engines (tiny Llama, float32 on CPU) in this process, each with its own
``TcpConnector``; the greedy tokens of the decode engine are compared with one engine
computing the whole request. Faults: a prefill engine that is gone, a transfer that stalls
past its timeout, hashes that differ, an offer nobody pulls; after each, every block is back
in both pools.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from shoal.runtime.config import EngineConfig
from shoal.runtime.engine.core import EngineCore
from shoal.runtime.kv_transfer.params import KVTransferConfig, KVTransferParams
from shoal.runtime.sampling_params import SamplingParams
from shoal.runtime.wire.messages import EngineCoreRequest

BLOCK = 16


def engine(model_dir, role: str | None, **extra) -> EngineCore:
    transfer = None if role is None else KVTransferConfig(
        kv_role=role, kv_ip="127.0.0.1", kv_port=0, kv_connector_extra_config=extra)
    return EngineCore(EngineConfig.from_kwargs(
        str(model_dir), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64,
        block_size=BLOCK, kv_transfer_config=transfer))


def request(req_id: str, prompt: list[int], max_tokens: int,
            transfer: KVTransferParams | None = None, salt: str | None = None
            ) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(temperature=0.0,
                                                            max_tokens=max_tokens,
                                                            ignore_eos=True),
                             kv_transfer=transfer, cache_salt=salt)


def run(core: EngineCore, req: EngineCoreRequest) -> tuple[list[int], object]:
    """Tokens of one request, and its last output."""
    core.add_request(req)
    tokens, last = [], None
    deadline = time.monotonic() + 60
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.extend(out.new_token_ids)
            last = out
        core.check_invariants()
        assert time.monotonic() < deadline
    return tokens, last


def settle(core: EngineCore) -> None:
    """Offers released by a pull come back through the loop's idle poll."""
    deadline = time.monotonic() + 10
    while core.scheduler.kv.holds and time.monotonic() < deadline:
        core.poll_transfers()
        time.sleep(0.01)
    core.check_invariants()
    assert core.stats().kv_cache_usage == 0.0


def prefill(core: EngineCore, req_id: str, prompt: list[int]) -> KVTransferParams:
    _, last = run(core, request(req_id, prompt, 1, KVTransferParams(do_remote_decode=True)))
    assert last.kv_transfer_params is not None
    return last.kv_transfer_params


@pytest.fixture(scope="module")
def engines(tiny_llama):
    prefill_engine = engine(tiny_llama, "kv_producer")
    decode_engine = engine(tiny_llama, "kv_consumer", transfer_timeout=2.0)
    yield prefill_engine, decode_engine
    prefill_engine.shutdown()
    decode_engine.shutdown()


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def test_the_decode_engine_continues_from_the_pulled_blocks_token_for_token(engines):
    prefill_engine, decode_engine = engines
    prompt = prompt_of(70, 1)  # 4 full blocks before the last token's block
    params = prefill(prefill_engine, "p-1", prompt)
    assert params.do_remote_prefill and params.remote_request_id == "p-1"
    assert params.remote_port == prefill_engine.remote.connector.port
    assert len(params.remote_block_ids or []) == 4
    assert prefill_engine.stats().kv_cache_usage > 0  # held for the pull

    before = decode_engine.stats()
    tokens, last = run(decode_engine, request("d-1", prompt, 12, params))
    after = decode_engine.stats()
    assert after.prompt_tokens_external - before.prompt_tokens_external == 4 * BLOCK
    computed = (after.prompt_tokens - after.prompt_tokens_cached) - (
        before.prompt_tokens - before.prompt_tokens_cached)
    assert computed == 70 - 4 * BLOCK  # only the tail: none of the pulled tokens
    assert after.kv_transfer_pulls - before.kv_transfer_pulls == 1
    assert after.kv_transfer_failures == before.kv_transfer_failures
    layout = decode_engine.executor.kv_block_io().layout()
    assert after.kv_transfer_bytes_received - before.kv_transfer_bytes_received == \
        4 * layout.block_bytes * layout.num_layers
    settle(prefill_engine)
    assert prefill_engine.stats().kv_transfer_bytes_sent > 0

    reference = engine(prefill_engine.config.model, None)
    want, _ = run(reference, request("r-1", prompt, 12))
    reference.shutdown()
    assert tokens == want
    settle(decode_engine)


def test_blocks_the_decode_side_has_cached_are_not_sent_again(engines):
    prefill_engine, decode_engine = engines
    shared = prompt_of(48, 2)
    run(decode_engine, request("d-warm", shared + [7], 2))  # 3 blocks cached on the decode side
    prompt = shared + prompt_of(40, 3)  # 5 full blocks before the last token's
    params = prefill(prefill_engine, "p-2", prompt)
    before = decode_engine.stats()
    tokens, _ = run(decode_engine, request("d-2", prompt, 6, params))
    after = decode_engine.stats()
    layout = decode_engine.executor.kv_block_io().layout()
    assert after.kv_transfer_blocks_skipped - before.kv_transfer_blocks_skipped == 3
    assert after.kv_transfer_bytes_received - before.kv_transfer_bytes_received == \
        2 * layout.block_bytes * layout.num_layers  # blocks 3 and 4 only
    assert after.prompt_tokens_external - before.prompt_tokens_external == 2 * BLOCK
    settle(prefill_engine)
    settle(decode_engine)
    want, _ = run(prefill_engine, request("r-2", prompt, 6, salt="reference"))
    assert tokens == want


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_gone_prefill_engine_or_a_stalled_transfer_falls_back_to_computing(engines):
    _, decode_engine = engines
    prompt = prompt_of(50, 4)
    want, _ = run(decode_engine, request("r-3", prompt, 6, salt="reference"))
    settle(decode_engine)
    gone = KVTransferParams(do_remote_prefill=True, remote_request_id="p-x",
                            remote_host="127.0.0.1", remote_port=closed_port())
    failures = decode_engine.stats().kv_transfer_failures
    tokens, _ = run(decode_engine, request("d-3", prompt, 6, gone))
    assert tokens == want
    assert decode_engine.stats().kv_transfer_failures == failures + 1
    settle(decode_engine)

    with socket.socket() as silent:  # accepts, never answers: the pull times out (2 s)
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        stalled = KVTransferParams(do_remote_prefill=True, remote_request_id="p-y",
                                   remote_host="127.0.0.1", remote_port=silent.getsockname()[1])
        started = time.monotonic()
        tokens, _ = run(decode_engine, request("d-4", prompt_of(50, 4), 6, stalled,
                                               salt="stalled"))
        assert time.monotonic() - started >= 1.9
    assert tokens == want
    assert decode_engine.stats().kv_transfer_failures == failures + 2
    settle(decode_engine)


def test_a_pull_with_other_hashes_is_refused_and_computed(engines):
    prefill_engine, decode_engine = engines
    prompt = prompt_of(40, 5)
    params = prefill(prefill_engine, "p-5", prompt)
    failures = decode_engine.stats().kv_transfer_failures
    tokens, _ = run(decode_engine, request("d-5", prompt, 4, params, salt="another tenant"))
    assert decode_engine.stats().kv_transfer_failures == failures + 1
    want, _ = run(decode_engine, request("r-5", prompt, 4, salt="reference"))
    assert tokens == want
    settle(decode_engine)
    assert "p-5" in prefill_engine.scheduler.kv.holds  # a refused pull takes nothing ...
    pulls = decode_engine.stats().kv_transfer_pulls
    run(decode_engine, request("d-5b", prompt, 1, params))  # ... the right one still can
    assert decode_engine.stats().kv_transfer_pulls == pulls + 1
    assert decode_engine.stats().kv_transfer_failures == failures + 1
    settle(prefill_engine)


def test_an_offer_nobody_pulls_is_freed_after_its_timeout(tiny_llama):
    prefill_engine = engine(tiny_llama, "kv_producer", abort_request_timeout=0.2)
    try:
        prefill(prefill_engine, "p-6", prompt_of(40, 6))
        assert prefill_engine.stats().kv_cache_usage > 0
        time.sleep(0.25)
        assert prefill_engine.poll_transfers()
        assert prefill_engine.stats().kv_transfer_expired == 1
        settle(prefill_engine)
    finally:
        prefill_engine.shutdown()


def test_an_aborted_decode_releases_its_blocks_when_its_pull_ends(engines):
    _, decode_engine = engines
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        stalled = KVTransferParams(do_remote_prefill=True, remote_request_id="p-z",
                                   remote_host="127.0.0.1", remote_port=silent.getsockname()[1])
        decode_engine.add_request(request("d-7", prompt_of(50, 7), 4, stalled))
        assert decode_engine.stats().kv_cache_usage > 0  # held for the pull
        decode_engine.abort_requests(["d-7"])
        deadline = time.monotonic() + 10
        while decode_engine.has_unfinished_requests():
            assert decode_engine.step() == []
            assert time.monotonic() < deadline
    settle(decode_engine)


@pytest.mark.parametrize("text, message", [
    ("[]", "must be a JSON object"),
    ('{"kv_rol": "kv_both"}', "unknown key(s) kv_rol"),
    ('{"kv_role": "boss"}', "kv_role 'boss' is not one of"),
    ('{"kv_connector": "NixlConnector"}', "'NixlConnector' is not served here"),
    ('{"kv_port": 70000}', "kv_port 70000 is not a port"),
    ('{"kv_connector_extra_config": {"transfer_timeout": 0}}', "transfer_timeout must be"),
])
def test_the_transfer_config_is_refused_naming_the_flag_and_the_key(text, message):
    from shoal.runtime.kv_transfer.params import parse_transfer_config

    with pytest.raises(ValueError, match="--kv-transfer-config") as info:
        parse_transfer_config(text)
    assert message in str(info.value)


def test_a_transfer_needs_one_rank_and_a_decode_side_prefix_cache(tiny_llama):
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineCore(EngineConfig.from_kwargs(
            str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=16,
            enable_prefix_caching=False, kv_transfer_config=KVTransferConfig(kv_role="kv_both")))


@contextmanager
def a_pair_of(model_dir: object) -> Iterator[tuple[EngineCore, EngineCore]]:
    """A prefill and a decode engine of one model, shut down after the test."""
    prefill_engine = engine(model_dir, "kv_producer")
    decode_engine = engine(model_dir, "kv_consumer")
    try:
        yield prefill_engine, decode_engine
    finally:
        prefill_engine.shutdown()
        decode_engine.shutdown()


def assert_a_prompt_moves(prefill_engine: EngineCore, decode_engine: EngineCore) -> None:
    """A 40-token prompt's two full blocks pulled, greedy equal to one engine, all released."""
    prompt = prompt_of(40, 8)
    params = prefill(prefill_engine, "p-8", prompt)
    tokens, _ = run(decode_engine, request("d-8", prompt, 8, params))
    assert decode_engine.stats().prompt_tokens_external == 2 * BLOCK
    want, _ = run(prefill_engine, request("r-8", prompt, 8, salt="reference"))
    assert tokens == want
    settle(prefill_engine)
    settle(decode_engine)


def test_a_model_mixing_sliding_and_full_layers_moves_with_one_table():
    """Gemma 2 mixes sliding and full layers; with a KV connector it keeps one block table
    for every layer (the hybrid KV cache manager off, as vLLM does), and its blocks move."""
    from shoal.runtime.model.make_family_model import cached_family_model

    with a_pair_of(cached_family_model("gemma2")) as (prefill_engine, decode_engine):
        assert not prefill_engine.kv_groups.hybrid and not decode_engine.kv_groups.hybrid
        assert_a_prompt_moves(prefill_engine, decode_engine)


def test_a_latent_attention_cache_moves_too():
    """DeepSeek-V3's cache holds a latent and a rotary key per layer (different widths)."""
    from shoal.runtime.model.make_mla_model import cached_mla_model

    with a_pair_of(cached_mla_model("deepseek_v3")) as (prefill_engine, decode_engine):
        layout = decode_engine.executor.kv_block_io().layout()
        assert layout.k_shape != layout.v_shape
        assert_a_prompt_moves(prefill_engine, decode_engine)


def test_a_prefill_engine_dying_mid_transfer_falls_back_to_computing(engines):
    """A producer that answers the header and half a layer, then closes (killed mid-send)."""
    import threading

    import msgspec
    from shoal.runtime.kv_transfer.tcp_connector import _Header, _recv_frame, _send_frame

    _, decode_engine = engines
    layout = decode_engine.executor.kv_block_io().layout()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def die_mid_transfer() -> None:
        conn, _ = server.accept()
        with conn:
            _recv_frame(conn)
            _send_frame(conn, msgspec.msgpack.encode(_Header("", layout.as_list(), 3)))
            conn.sendall(b"\0" * (layout.block_bytes * 3 // 2))

    thread = threading.Thread(target=die_mid_transfer, daemon=True)
    thread.start()
    prompt = prompt_of(60, 9)  # 3 full blocks before the last token's
    params = KVTransferParams(do_remote_prefill=True, remote_request_id="p-w",
                              remote_host="127.0.0.1", remote_port=server.getsockname()[1])
    failures = decode_engine.stats().kv_transfer_failures
    tokens, _ = run(decode_engine, request("d-10", prompt, 6, params))
    thread.join(5)
    server.close()
    assert decode_engine.stats().kv_transfer_failures == failures + 1
    want, _ = run(decode_engine, request("r-10", prompt, 6, salt="reference"))
    assert tokens == want  # the half-written blocks were never published
    settle(decode_engine)


def test_a_decode_engine_dying_mid_pull_leaves_no_block_held_on_the_prefill_side(engines):
    """The consumer asks, then goes away without reading: the offer is released anyway."""
    import msgspec
    from shoal.runtime.kv_transfer.tcp_connector import _Pull, _send_frame

    prefill_engine, _ = engines
    prompt = prompt_of(80, 10)
    params = prefill(prefill_engine, "p-11", prompt)
    assert prefill_engine.stats().kv_cache_usage > 0
    hashes = prefill_engine.scheduler.kv.holds["p-11"]
    wanted = [b.block_hash for b in hashes]
    with socket.create_connection(("127.0.0.1", params.remote_port)) as conn:
        _send_frame(conn, msgspec.msgpack.encode(_Pull("p-11", 0, wanted)))
    settle(prefill_engine)  # copied out, then released; the send failing changes nothing
