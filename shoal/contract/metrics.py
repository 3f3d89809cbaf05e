"""The engine metrics other processes read, by name, and how they read them.

An engine exports them under ``shoal:`` (and ``vllm:`` with ``--metrics-compat vllm``) with
vLLM's names; the router scrapes them to route, the operator to fill an InferenceService's
status and to autoscale. Both read the text through ``prometheus_client``'s own parser into
one ``EngineMetrics``, each reader parsing only the lines of the samples it reads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "shoal"

# metric family names (unprefixed); counters' samples end in _total
NUM_REQUESTS_RUNNING = "num_requests_running"
NUM_REQUESTS_WAITING = "num_requests_waiting"
KV_CACHE_USAGE = "kv_cache_usage_perc"
PREFIX_CACHE_QUERIES = "prefix_cache_queries"
PREFIX_CACHE_HITS = "prefix_cache_hits"
NUM_PREEMPTIONS = "num_preemptions"
REQUEST_SUCCESS = "request_success"
# LoRA: the info gauge the Gateway API inference extension's model-server protocol and
# llm-d's lora-affinity scorer read (labels below, comma lists; value: last update time), and
# requests per adapter
LORA_REQUESTS_INFO = "lora_requests_info"
LORA_MAX_LABEL = "max_lora"
LORA_RUNNING_LABEL = "running_lora_adapters"
LORA_WAITING_LABEL = "waiting_lora_adapters"
LORA_REQUESTS = "lora_requests"  # counter, label lora_name
# Shoal's own: one sample (value 1) per adapter an engine serves, running or not, so a router
# knows where an adapter can run at all (vLLM's info gauge names only busy adapters)
LORA_ADAPTER_INFO = "lora_adapter_info"
LORA_NAME_LABEL = "lora_name"


def sample_name(family: str, counter: bool = False, prefix: str = PREFIX) -> str:
    """``num_preemptions`` -> ``shoal:num_preemptions_total`` (counter=True)."""
    return f"{prefix}:{family}{'_total' if counter else ''}"


@dataclass(frozen=True)
class EngineMetrics:
    """One engine's scrape, each metric summed over its label sets (one model per engine)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0  # 0-1
    prefix_cache_queries: float = 0.0  # tokens, cumulative
    prefix_cache_hits: float = 0.0  # tokens, cumulative
    preemptions: float = 0.0
    finished: float = 0.0  # requests finished, cumulative (any reason): activity for scale to 0


# EngineMetrics field -> the sample it is read from
SAMPLES = {
    "running": sample_name(NUM_REQUESTS_RUNNING),
    "waiting": sample_name(NUM_REQUESTS_WAITING),
    "kv_cache_usage": sample_name(KV_CACHE_USAGE),
    "prefix_cache_queries": sample_name(PREFIX_CACHE_QUERIES, counter=True),
    "prefix_cache_hits": sample_name(PREFIX_CACHE_HITS, counter=True),
    "preemptions": sample_name(NUM_PREEMPTIONS, counter=True),
    "finished": sample_name(REQUEST_SUCCESS, counter=True),
}
assert set(SAMPLES) == {f.name for f in fields(EngineMetrics)}


def _families(text: str) -> Iterable[Metric]:
    """The parser's families; a line it rejects (a truncated scrape, a stray line) costs only
    that line: the text is then parsed line by line, so the rest still counts."""
    try:
        return list(text_string_to_metric_families(text))
    except ValueError:
        families: list[Metric] = []
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                try:
                    families.extend(text_string_to_metric_families(line + "\n"))
                except ValueError:
                    continue
        return families


def only_samples(text: str, names: Iterable[str]) -> str:
    """The lines of ``text`` that carry a sample of one of ``names``: what a reader parses
    when it wants a few of an engine's ~600 samples. A router scrapes every engine every
    second or faster, and the full parse was half of its CPU (a P/D profile, 2026-12-07)."""
    wanted = tuple(names)
    kept = []
    for line in text.splitlines():
        if line.startswith(wanted):
            end = line.find("{")
            name = line[:end] if end >= 0 else line.split(" ", 1)[0]
            if name in wanted:
                kept.append(line)
    return "\n".join(kept) + "\n" if kept else ""


def parse_samples(text: str, names: Iterable[str] | None = None) -> dict[str, float]:
    """Sample name -> the sum of its finite values over every label set (of ``names`` only,
    when given)."""
    if names is not None:
        text = only_samples(text, names)
    totals: dict[str, float] = {}
    for family in _families(text):
        for sample in family.samples:
            if math.isfinite(sample.value):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def parse_engine_metrics(text: str) -> EngineMetrics:
    samples = parse_samples(text, SAMPLES.values())
    values = {field: samples.get(name, 0.0) for field, name in SAMPLES.items()}
    values["kv_cache_usage"] = min(max(values["kv_cache_usage"], 0.0), 1.0)
    return EngineMetrics(**values)


@dataclass(frozen=True)
class LoraInfo:
    """An engine's ``lora_requests_info``: its adapter slots and the adapters in them."""

    max_lora: int = 0
    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    base_models: frozenset[str] = frozenset()  # the base's served name(s): not adapters
    loaded: frozenset[str] = frozenset()  # every adapter it serves (lora_adapter_info)

    @property
    def active(self) -> frozenset[str]:
        """Adapters with requests running or queued: those it holds (or is about to)."""
        return self.running | self.waiting

    @property
    def has_free_slot(self) -> bool:
        return len(self.running) < self.max_lora


def _names(value: str) -> frozenset[str]:
    return frozenset(n for n in (p.strip() for p in value.split(",")) if n)


def parse_lora_info(text: str, prefix: str = PREFIX) -> LoraInfo | None:
    """The latest-stamped ``lora_requests_info`` sample (any prefix given), or None when the
    engine exports none (LoRA off)."""
    wanted = f"{prefix}:{LORA_REQUESTS_INFO}"
    base_sample = sample_name(NUM_REQUESTS_RUNNING, prefix=prefix)
    loaded_sample = sample_name(LORA_ADAPTER_INFO, prefix=prefix)
    best: tuple[float, LoraInfo] | None = None
    bases: set[str] = set()
    loaded: set[str] = set()
    for family in _families(only_samples(text, (wanted, base_sample, loaded_sample))):
        for sample in family.samples:
            if sample.name == base_sample and "model_name" in sample.labels:
                bases.add(sample.labels["model_name"])
            if sample.name == loaded_sample and sample.labels.get(LORA_NAME_LABEL):
                loaded.add(sample.labels[LORA_NAME_LABEL])
            if sample.name != wanted:
                continue
            labels = sample.labels
            try:
                max_lora = int(labels.get(LORA_MAX_LABEL, "0") or 0)
            except ValueError:
                max_lora = 0
            info = LoraInfo(max_lora, _names(labels.get(LORA_RUNNING_LABEL, "")),
                            _names(labels.get(LORA_WAITING_LABEL, "")))
            if best is None or sample.value >= best[0]:
                best = (sample.value, info)
    if best is None:
        return None
    return LoraInfo(best[1].max_lora, best[1].running, best[1].waiting, frozenset(bases),
                    frozenset(loaded))
