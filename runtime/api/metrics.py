"""Prometheus metrics with vLLM's names under the ``shoal:`` prefix (and ``vllm:`` on request).

``--metrics-compat vllm`` makes an engine pod a model server that Gateway API Inference
Extension endpoint pickers can score: they read ``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` and the labels ``block_size`` and
``num_gpu_blocks`` of the info gauge ``vllm:cache_config_info`` (value 1, as vLLM exports it;
its ``cache_dtype`` label says ``--kv-cache-dtype``: fp8 doubles the blocks in the same memory),
scraping as often as every 50 ms: a scrape only renders numbers already held here.

Engine-side numbers come from the ``SchedulerStats`` the core attaches to its outputs: the
gauges are current values, the counters are cumulative in the core, so they are exported by a
collector that reads the latest stats (no double counting, no drift). Request latencies are
measured here, in the API process, where the request starts and ends; the phase histograms
(queue, prefill, decode, inference) split a finished request's time at the engine's own
stamps (arrival in the core, first scheduling) carried by its first output. Both processes
read ``time.monotonic()``, which on Linux is one system-wide clock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from shoal.runtime.wire.messages import SchedulerStats

from shoal.contract import metrics as names

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)




@dataclass(frozen=True)
class RequestPhases:
    """One finished engine request's timeline, split as vLLM splits it (seconds)."""

    queue: float  # arrival in the engine core -> first scheduled
    prefill: float  # first scheduled -> first token (preemptions included)
    decode: float  # first token -> last token
    inference: float  # first scheduled -> last token
    per_output_token: float  # decode / (tokens - 1); 0 for a single token, as vLLM does


def request_phases(queued: float, scheduled: float, first_token: float, last_token: float,
                   num_tokens: int) -> RequestPhases:
    """Pure: the phases from the four stamps (clamped at 0 against clock granularity)."""
    decode = max(0.0, last_token - first_token)
    return RequestPhases(
        queue=max(0.0, scheduled - queued),
        prefill=max(0.0, first_token - scheduled),
        decode=decode,
        inference=max(0.0, last_token - scheduled),
        per_output_token=decode / (num_tokens - 1) if num_tokens > 1 else 0.0)


class EngineStatsCollector(Collector):
    def __init__(self, prefixes: list[str], model_name: str) -> None:
        self.prefixes = prefixes
        self.model_name = model_name
        self.stats = SchedulerStats()
        self.phase_durations: dict[str, float] = {}
        # (block_size, cache_dtype, num_gpu_blocks)
        self.cache_config: tuple[int, str, int] | None = None
        self.quantization: str | None = None  # "none" or the method, once the engine is ready
        # (kv_connector, kv_role, engine_id) of --kv-transfer-config: the engine's P/D role
        self.kv_transfer: tuple[str, str, str] | None = None
        self.max_loras = 0  # LoRA slots (--max-loras); 0: LoRA off, no lora_requests_info
        self.stats_time = 0.0  # time.time() of the latest stats: lora_requests_info's value
        self.adapters: list[str] = []  # LoRA adapters this server serves (lora_adapter_info)

    def collect(self) -> Iterator:
        s, labels = self.stats, [self.model_name]
        for p in self.prefixes:
            for name, doc, value in (
                (names.NUM_REQUESTS_RUNNING, "Requests in the running batch", s.num_running),
                (names.NUM_REQUESTS_WAITING, "Requests waiting to be scheduled", s.num_waiting),
                (names.KV_CACHE_USAGE, "KV-cache usage, 1 = full", s.kv_cache_usage),
            ):
                gauge = GaugeMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
                gauge.add_metric(labels, value)
                yield gauge
            for name, doc, value in (
                (names.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache",
                 s.prefix_cache_queries),
                (names.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache",
                 s.prefix_cache_hits),
                (names.NUM_PREEMPTIONS, "Preemptions by the scheduler", s.num_preemptions),
                ("prompt_tokens", "Prompt tokens processed", s.prompt_tokens),
                ("generation_tokens", "Tokens generated", s.generation_tokens),
            ):
                counter = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
                counter.add_metric(labels, value)
                yield counter
            yield from self._transfer_counters(p)
            phases = GaugeMetricFamily(f"{p}:startup_phase_duration_seconds",
                                       "Seconds each engine startup phase took",
                                       labels=["model_name", "phase"])
            for phase, seconds in self.phase_durations.items():
                phases.add_metric([self.model_name, phase], seconds)
            yield phases
            info = GaugeMetricFamily(f"{p}:cache_config_info",
                                     "Information of the KV cache config (value 1); no sample "
                                     "until the engine has sized its cache",
                                     labels=["block_size", "cache_dtype", "num_gpu_blocks"])
            if self.cache_config is not None:
                block_size, cache_dtype, num_blocks = self.cache_config
                info.add_metric([str(block_size), cache_dtype, str(num_blocks)], 1.0)
            yield info
            model = GaugeMetricFamily(f"{p}:model_config_info",
                                      "Information of the served model (value 1): its "
                                      "weights' quantization method, none for full precision",
                                      labels=["model_name", "quantization"])
            if self.quantization is not None:
                model.add_metric([self.model_name, self.quantization], 1.0)
            yield model
            if self.max_loras:
                yield self._lora_info(p)
                loaded = GaugeMetricFamily(f"{p}:{names.LORA_ADAPTER_INFO}",
                                           "LoRA adapters this server serves (value 1)",
                                           labels=[names.LORA_NAME_LABEL])
                for adapter in self.adapters:
                    loaded.add_metric([adapter], 1.0)
                yield loaded

    def _transfer_counters(self, p: str) -> Iterator:
        """Where prompt tokens came from (vLLM's prompt_tokens_by_source) and the KV
        transfers of P/D disaggregation (vLLM's nixl_* metrics, as counters)."""
        s, model = self.stats, self.model_name
        sources = CounterMetricFamily(f"{p}:prompt_tokens_by_source",
                                      "Prompt tokens by where their KV came from",
                                      labels=["model_name", "source"])
        sources.add_metric([model, "local_compute"], s.prompt_tokens - s.prompt_tokens_cached)
        sources.add_metric([model, "local_cache_hit"],
                           s.prompt_tokens_cached - s.prompt_tokens_external)
        sources.add_metric([model, "external_kv_transfer"], s.prompt_tokens_external)
        yield sources
        moved = CounterMetricFamily(f"{p}:kv_transfer_bytes", "KV bytes moved between engines",
                                    labels=["model_name", "direction"])
        moved.add_metric([model, "received"], s.kv_transfer_bytes_received)
        moved.add_metric([model, "sent"], s.kv_transfer_bytes_sent)
        yield moved
        for name, doc, value in (
            ("kv_transfers", "KV pulls finished (ok or failed)", s.kv_transfer_pulls),
            ("kv_transfer_failures", "KV pulls that failed (the prompt was computed here)",
             s.kv_transfer_failures),
            ("kv_transfer_seconds", "Seconds the successful KV pulls took", s.kv_transfer_seconds),
            ("kv_transfer_expired_requests", "Prefills whose offered KV was never pulled in "
             "time", s.kv_transfer_expired),
            ("kv_transfer_blocks_skipped", "Prompt blocks not pulled: already in this "
             "engine's prefix cache", s.kv_transfer_blocks_skipped),
        ):
            counter = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            counter.add_metric([model], value)
            yield counter
        # joined on, it splits queue and KV usage by role; no sample without P/D
        info = GaugeMetricFamily(f"{p}:kv_transfer_config_info", "P/D: the engine's "
                                 "--kv-transfer-config (value 1); kv_role kv_producer is a "
                                 "prefill engine, kv_consumer a decode engine",
                                 labels=["model_name", "kv_connector", "kv_role", "engine_id"])
        if self.kv_transfer is not None:
            info.add_metric([model, *self.kv_transfer], 1.0)
        yield info

    def _lora_info(self, prefix: str) -> GaugeMetricFamily:
        """As vLLM exports it: one sample, the adapters as comma lists in the labels, the
        value the time of the update (readers take the newest sample)."""
        s = self.stats
        info = GaugeMetricFamily(f"{prefix}:{names.LORA_REQUESTS_INFO}",
                                 "Running stats on LoRA requests",
                                 labels=[names.LORA_MAX_LABEL, names.LORA_RUNNING_LABEL,
                                         names.LORA_WAITING_LABEL])
        info.add_metric([str(self.max_loras), ",".join(s.running_lora_adapters),
                         ",".join(s.waiting_lora_adapters)], self.stats_time or time.time())
        return info


class ServerMetrics:
    def __init__(self, model_name: str, compat: list[str] | None = None) -> None:
        self.model_name = model_name
        self.prefixes = [names.PREFIX, *(compat or [])]
        self.registry = CollectorRegistry()
        self._rendered: bytes | None = None  # the last render while nothing has changed
        self.engine = EngineStatsCollector(self.prefixes, model_name)
        self.registry.register(self.engine)
        self._success = [Counter(f"{p}:{names.REQUEST_SUCCESS}", "Requests finished, by reason",
                                 ["model_name", "finished_reason"], registry=self.registry)
                         for p in self.prefixes]
        self._ttft = self._histograms("time_to_first_token_seconds",
                                      "Time to first token", TTFT_BUCKETS)
        self._itl = self._histograms("inter_token_latency_seconds",
                                     "Time between output tokens", ITL_BUCKETS)
        self._e2e = self._histograms("e2e_request_latency_seconds",
                                     "Request latency, arrival to last token", E2E_BUCKETS)
        self._queue = self._histograms("request_queue_time_seconds",
                                       "Time in the WAITING phase: engine arrival to first "
                                       "scheduled", E2E_BUCKETS)
        self._prefill = self._histograms("request_prefill_time_seconds",
                                         "Time in the PREFILL phase: first scheduled to first "
                                         "token", E2E_BUCKETS)
        self._decode = self._histograms("request_decode_time_seconds",
                                        "Time in the DECODE phase: first to last token",
                                        E2E_BUCKETS)
        self._inference = self._histograms("request_inference_time_seconds",
                                           "Time in the RUNNING phase: first scheduled to last "
                                           "token", E2E_BUCKETS)
        self._tpot = self._histograms("request_time_per_output_token_seconds",
                                      "Mean time per output token of each request",
                                      ITL_BUCKETS)
        self._rejected = [Counter(f"{p}:request_rejected", "Requests rejected before the engine",
                                  ["model_name", "status"], registry=self.registry)
                          for p in self.prefixes]
        self._lora_requests = [Counter(f"{p}:{names.LORA_REQUESTS}",
                                       "Engine requests sent with each LoRA adapter",
                                       ["model_name", names.LORA_NAME_LABEL],
                                       registry=self.registry)
                               for p in self.prefixes]

    def enable_lora(self, max_loras: int) -> None:
        self._rendered = None
        self.engine.max_loras = max_loras

    def set_adapters(self, adapters: list[str]) -> None:
        self._rendered = None
        self.engine.adapters = sorted(adapters)

    def observe_lora_request(self, adapter: str, count: int = 1) -> None:
        self._rendered = None
        for c in self._lora_requests:
            c.labels(self.model_name, adapter).inc(count)

    def _histograms(self, name: str, doc: str, buckets: tuple[float, ...]) -> list[Histogram]:
        """One per prefix, its model_name child made now so it exports zeros from the start."""
        return [Histogram(f"{p}:{name}", doc, ["model_name"], buckets=buckets,
                          registry=self.registry).labels(self.model_name)
                for p in self.prefixes]

    def update_stats(self, stats: SchedulerStats) -> None:
        self._rendered = None
        self.engine.stats = stats
        self.engine.stats_time = time.time()

    def set_phase_durations(self, durations: dict[str, float]) -> None:
        self._rendered = None
        self.engine.phase_durations = dict(durations)

    def set_cache_config(self, block_size: int, num_gpu_blocks: int,
                         cache_dtype: str = "auto") -> None:
        """Known once the engine has sized its KV cache (after profiling)."""
        self._rendered = None
        self.engine.cache_config = (block_size, cache_dtype, num_gpu_blocks)

    def set_kv_transfer_config(self, kv_connector: str, kv_role: str, engine_id: str) -> None:
        self._rendered = None
        self.engine.kv_transfer = (kv_connector, kv_role, engine_id)

    def set_model_config(self, quantization: str) -> None:
        self._rendered = None
        self.engine.quantization = quantization or "none"

    def observe_first_token(self, seconds: float) -> None:
        self._rendered = None
        for h in self._ttft:
            h.observe(seconds)

    def observe_inter_token(self, seconds: float, count: int = 1) -> None:
        self._rendered = None
        for h in self._itl:
            for _ in range(count):
                h.observe(seconds)

    def observe_finished(self, finished_reason: str, e2e_seconds: float) -> None:
        self._rendered = None
        for c in self._success:
            c.labels(self.model_name, finished_reason).inc()
        for h in self._e2e:
            h.observe(e2e_seconds)

    def observe_phases(self, phases: RequestPhases) -> None:
        self._rendered = None
        for histograms, value in ((self._queue, phases.queue), (self._prefill, phases.prefill),
                                  (self._decode, phases.decode),
                                  (self._inference, phases.inference),
                                  (self._tpot, phases.per_output_token)):
            for h in histograms:
                h.observe(value)

    def observe_rejected(self, status: int) -> None:
        self._rendered = None
        for c in self._rejected:
            c.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        """The exposition text, rendered again only after something changed: pickers scrape
        every 50 ms, and an idle engine's numbers do not move between scrapes."""
        if self._rendered is None:
            self._rendered = generate_latest(self.registry)
        return self._rendered
