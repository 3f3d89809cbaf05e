"""Parsing a replica's Prometheus text into routing inputs."""

from __future__ import annotations

from shoal.runtime.router.proxy.metrics import imbalance

from shoal.contract.metrics import only_samples, parse_engine_metrics

TEXT = """\
# HELP shoal:num_requests_running Requests in the running batch
# TYPE shoal:num_requests_running gauge
shoal:num_requests_running{model_name="qwen3"} 3.0
shoal:num_requests_waiting{model_name="qwen3"} 2
shoal:kv_cache_usage_perc{model_name="qwen3"} 0.25
shoal:prefix_cache_queries_total{model_name="qwen3"} 1200.0
shoal:prefix_cache_hits_total{model_name="qwen3"} 300.0
shoal:prefix_cache_hits_created{model_name="qwen3"} 1.7e9
shoal:time_to_first_token_seconds_bucket{le="0.1",model_name="qwen3"} 4
garbage line without value
"""


def test_engine_metrics_are_read_by_name_and_summed_over_labels():
    m = parse_engine_metrics(TEXT)
    assert (m.running, m.waiting, m.kv_cache_usage) == (3.0, 2.0, 0.25)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (1200.0, 300.0)
    assert parse_engine_metrics("").running == 0.0


def test_a_reader_parses_only_the_lines_of_the_samples_it_reads():
    text = TEXT + 'shoal:num_requests_running_peak{model_name="qwen3"} 9\n' \
        'shoal:num_requests_running 1\n'
    kept = only_samples(text, ["shoal:num_requests_running", "shoal:kv_cache_usage_perc"])
    assert kept.splitlines() == ['shoal:num_requests_running{model_name="qwen3"} 3.0',
                                 'shoal:kv_cache_usage_perc{model_name="qwen3"} 0.25',
                                 "shoal:num_requests_running 1"]  # not a longer name's
    assert parse_engine_metrics(text).running == 4.0
    assert only_samples(text, ["shoal:absent"]) == ""


def test_imbalance_is_max_over_mean():
    assert imbalance([2, 2, 2, 2]) == 1.0
    assert imbalance([4, 0, 0, 0]) == 4.0
    assert imbalance([0, 0]) == 1.0
