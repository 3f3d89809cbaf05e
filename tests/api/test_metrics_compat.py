"""The vLLM-compatible exposition endpoint pickers scrape, and its render cache."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from shoal.runtime.api.metrics import ServerMetrics
from shoal.runtime.wire.messages import SchedulerStats


def samples(text: bytes) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text.decode())}


def test_vllm_names_and_cache_config_info() -> None:
    metrics = ServerMetrics("m", ["vllm"])
    metrics.update_stats(SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25))
    assert samples(metrics.render())["vllm:cache_config_info"] == []  # unknown before sizing
    metrics.set_cache_config(16, 512, "fp8")
    parsed = samples(metrics.render())
    assert parsed["vllm:num_requests_running"][0].value == 3
    assert parsed["vllm:num_requests_waiting"][0].value == 2
    assert parsed["vllm:kv_cache_usage_perc"][0].value == 0.25
    (info,) = parsed["vllm:cache_config_info"]
    assert info.labels == {"block_size": "16", "cache_dtype": "fp8", "num_gpu_blocks": "512"}
    assert info.value == 1.0
    assert "shoal:cache_config_info" in parsed


def test_render_is_reused_until_something_changes() -> None:
    metrics = ServerMetrics("m", ["vllm"])
    first = metrics.render()
    assert metrics.render() is first  # nothing moved: the same bytes, no second render
    metrics.observe_first_token(0.02)
    after_token = metrics.render()
    assert after_token is not first
    count = next(s for s in samples(after_token)["vllm:time_to_first_token_seconds"]
                 if s.name.endswith("_count"))
    assert count.value == 1
    metrics.update_stats(SchedulerStats(num_waiting=7))
    assert samples(metrics.render())["vllm:num_requests_waiting"][0].value == 7


def test_a_p_d_engine_says_its_kv_role_and_an_ordinary_one_says_nothing() -> None:
    metrics = ServerMetrics("m", ["vllm"])
    assert samples(metrics.render())["shoal:kv_transfer_config_info"] == []
    metrics.set_kv_transfer_config("TcpConnector", "kv_producer", "e1")
    parsed = samples(metrics.render())
    for prefix in ("shoal", "vllm"):
        (info,) = parsed[f"{prefix}:kv_transfer_config_info"]
        assert info.labels == {"model_name": "m", "kv_connector": "TcpConnector",
                               "kv_role": "kv_producer", "engine_id": "e1"}
        assert info.value == 1.0
