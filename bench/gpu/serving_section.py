"""Section ``serving``: the engine at 1, 16, 64 and 256 requests in flight, and transformers'
``generate_batch`` on the same checkpoint as the on-device baseline (vLLM cannot be installed
on the device machine).

An in-process EngineCore (triton attention, CUDA graphs) is kept at ``c`` requests in flight
(a closed loop: a finished request is replaced at once) for a fixed count of requests per
level; prompts of 256 random tokens, 64 output tokens, ignore_eos, greedy. Per level: output
tok/s, TTFT (request added to its first token) and ITL (gaps between a request's tokens),
p50 and p99. Baseline: the same 64 requests through ``model.generate_batch`` (transformers'
continuous batching), output tok/s, beside the engine's 64-in-flight figure. Each level is
written as it is measured.
"""

from __future__ import annotations

import random
import time

import torch
from checkpoint import EOS_TOKEN_ID, ensure_checkpoint
from common import log, write_result


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def sweep_level(core, concurrency: int, total: int, prompt_len: int, out_len: int,
                vocab: int) -> dict:
    from shoal.runtime.sampling_params import SamplingParams
    from shoal.runtime.wire.messages import EngineCoreRequest

    prompts = _prompts(total, prompt_len, vocab, concurrency)
    added: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    next_index = tokens = 0

    def add() -> None:
        nonlocal next_index
        rid = f"c{concurrency}-{next_index}"
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len)
        core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompts[next_index],
                                           sampling_params=params, eos_token_ids=[EOS_TOKEN_ID]))
        added[rid] = time.perf_counter()
        next_index += 1

    start = time.perf_counter()
    while next_index < min(concurrency, total):
        add()
    while core.has_unfinished_requests():
        outputs = core.step()
        now = time.perf_counter()
        for output in outputs:
            if not output.new_token_ids:
                continue
            tokens += len(output.new_token_ids)
            rid = output.request_id
            if rid in last:
                itl.append(now - last[rid])
            else:
                ttft.append(now - added[rid])
            last[rid] = now
            if output.finish_reason is not None and next_index < total:
                add()
    elapsed = time.perf_counter() - start
    ms = 1e3
    return {"concurrency": concurrency, "requests": total, "output_tokens": tokens,
            "seconds": round(elapsed, 2), "output_tok_s": round(tokens / elapsed, 1),
            "ttft_p50_ms": round(_percentile(ttft, 0.5) * ms, 2) if ttft else None,
            "ttft_p99_ms": round(_percentile(ttft, 0.99) * ms, 2) if ttft else None,
            "itl_p50_ms": round(_percentile(itl, 0.5) * ms, 2) if itl else None,
            "itl_p99_ms": round(_percentile(itl, 0.99) * ms, 2) if itl else None}


def transformers_baseline(model_dir, device: str, prompts: list[list[int]], out_len: int,
                          smoke: bool = False) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    config = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    # On the device transformers sizes its paged cache from free memory, as a user would run it.
    # The CPU smoke run fixes a small cache: sized from this host's memory it took 7 GB and was
    # OOM-killed while a test suite ran beside it.
    batching = {}
    if smoke:
        from transformers import ContinuousBatchingConfig
        batching["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=64, max_batch_tokens=256)
    model.generate_batch(inputs=prompts[:2], generation_config=config, **batching)  # warm up
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=config, **batching)
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in results.values())
    return {"requests": len(prompts), "output_tokens": tokens, "seconds": round(elapsed, 2),
            "output_tok_s": round(tokens / elapsed, 1)}


def run(smoke: bool) -> dict:
    from shoal.runtime.config import EngineConfig
    from shoal.runtime.engine.core import EngineCore
    from shoal.runtime.model.config import load_model_config

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = ensure_checkpoint(smoke)
    vocab = load_model_config(model_dir).vocab_size
    prompt_len, out_len = (8, 4) if smoke else (256, 64)
    levels = (1, 4) if smoke else (1, 16, 64, 256)
    result: dict = {"model": "tiny qwen3" if smoke else "Qwen3-0.6B-shaped bf16",
                    "workload": f"prompt {prompt_len}, output {out_len}, ignore_eos, greedy",
                    "rows": []}
    config = EngineConfig(
        model=str(model_dir), device=device, dtype="bfloat16" if device == "cuda" else "float32",
        max_num_seqs=256, max_num_batched_tokens=64 if smoke else 8192,
        max_model_len=prompt_len + out_len + 16, num_kv_blocks=64 if smoke else None,
        attention_backend="triton" if device == "cuda" else "auto")
    started = time.perf_counter()
    core = EngineCore(config)
    result["setup_seconds"] = round(time.perf_counter() - started, 1)
    write_result("serving", result)
    try:
        for concurrency in levels:
            total = concurrency if smoke else max(2 * concurrency, 16)
            row = sweep_level(core, concurrency, total, prompt_len, out_len, vocab)
            result["rows"].append(row)
            log(f"serving {row}")
            write_result("serving", result)
    finally:
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del core
        if device == "cuda":
            torch.cuda.empty_cache()
    batch = 4 if smoke else 64
    try:
        result["transformers"] = transformers_baseline(
            model_dir, device, _prompts(batch, prompt_len, vocab, batch), out_len, smoke)
    except Exception as exc:  # noqa: BLE001 - the engine's rows stand without the baseline
        result["transformers"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    log(f"transformers generate_batch: {result['transformers']}")
    write_result("serving", result)
    return result
