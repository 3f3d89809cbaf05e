"""Offline throughput on CPU: our engine vs HF transformers, as a share of the CPU roofline.

Workload (fixed seed): the bench-size model (``shoal make-model --size bench``), 128
requests, prompt lengths uniform in 32..512, output lengths in 16..256, greedy with
ignore_eos, all submitted at once. In one run:

- HF ``generate`` in static batches (left-padded; each batch runs to its longest output),
  at the best batch size of a calibration on the first requests;
- HF ``generate_batch``-style continuous batching (the ContinuousBatchingManager, per-request
  max_new_tokens), warmed up first;
- ours: ``LLM.generate`` with token-id prompts.

For each: output tokens/s, ratio to the best HF figure, and share of the CPU roofline: the
workload's model FLOPs (2 x linear parameters per processed token, the LM head per generated
token, attention over each token's context) over the torch matmul rate measured in this run at
the steps' shapes. The machine is shared (2 cores): figures are noisy.

    .venv/bin/python bench/offline_throughput.py [--requests 128] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from shoal.runtime.model.config import ModelConfig, load_model_config


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def subset(self, count: int) -> Workload:
        return Workload(self.prompts[:count], self.output_lens[:count])


def make_workload(count: int, vocab: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))]
               for _ in range(count)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(count)])


# -- the roofline ------------------------------------------------------------------------------

def linear_shapes(mc: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one layer's matmuls."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return [(mc.hidden_size, q + 2 * kv), (q, mc.hidden_size),
            (mc.hidden_size, 2 * mc.intermediate_size), (mc.intermediate_size, mc.hidden_size)]


def workload_flops(mc: ModelConfig, work: Workload) -> float:
    per_token = 2 * mc.num_layers * sum(i * o for i, o in linear_shapes(mc))
    lm_head = 2 * mc.hidden_size * mc.vocab_size
    attn_per_ctx = 4 * mc.num_layers * mc.num_heads * mc.head_dim  # QK^T and PV per key
    total = 0.0
    for prompt, out in zip(work.prompts, work.output_lens, strict=True):
        tokens = len(prompt) + out - 1  # the last generated token is never fed back
        total += per_token * tokens + lm_head * out
        total += attn_per_ctx * tokens * (tokens + 1) / 2
    return total


def matmul_rate(mc: ModelConfig, rows: tuple[int, ...] = (128, 512, 2048),
                min_seconds: float = 1.0) -> dict[int, float]:
    """FLOP/s of torch matmuls at one layer's shapes (+ LM head) for each row count."""
    shapes = linear_shapes(mc) + [(mc.hidden_size, mc.vocab_size)]
    rates = {}
    for m in rows:
        weights = [torch.randn(i, o) for i, o in shapes]
        inputs = [torch.randn(m, i) for i, _ in shapes]
        flops_per_round = sum(2 * m * i * o for i, o in shapes)
        for x, w in zip(inputs, weights, strict=True):  # warm up
            x @ w
        rounds, start = 0, time.perf_counter()
        while time.perf_counter() - start < min_seconds:
            for x, w in zip(inputs, weights, strict=True):
                x @ w
            rounds += 1
        rates[m] = flops_per_round * rounds / (time.perf_counter() - start)
    return rates


# -- the three systems -------------------------------------------------------------------------

def run_ours(model_dir: Path, work: Workload, max_num_batched_tokens: int) -> float:
    from shoal.runtime.llm import LLM
    from shoal.runtime.sampling_params import SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_seqs=len(work.prompts),
              max_num_batched_tokens=max_num_batched_tokens,
              max_model_len=max(len(p) for p in work.prompts) + max(work.output_lens) + 16)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in work.output_lens]
    llm.generate(work.prompts[:2], params[:2])  # warm-up
    start = time.perf_counter()
    results = llm.generate(work.prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    if produced != work.output_tokens:
        raise RuntimeError(f"ours produced {produced} tokens, expected {work.output_tokens}")
    return elapsed


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def run_hf_static(model, work: Workload, batch_size: int) -> float:
    """Left-padded static batches; useful tokens are each request's own output length."""
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(work.prompts), batch_size):
            prompts = work.prompts[b:b + batch_size]
            width = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros(len(prompts), width, dtype=torch.long)
            for row, p in enumerate(prompts):
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            new = max(work.output_lens[b:b + batch_size])
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
            assert out.shape[1] == width + new
    return time.perf_counter() - start


def run_hf_continuous(model, work: Workload, max_batch_tokens: int) -> float:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model.set_attn_implementation("sdpa")
    config = GenerationConfig(max_new_tokens=max(work.output_lens), do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    # Sized for the workload like ours: left to itself it sized its cache from free RAM and
    # was OOM-killed at 13.6 GB on this 24 GB machine.
    page = 256
    pages = sum(-(-(len(p) + n) // page) for p, n in zip(work.prompts, work.output_lens,
                                                            strict=True))
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=pages + 16,
                                         max_batch_tokens=max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=config,
                                             continuous_batching_config=cb_config)
    manager.start()
    try:
        def run(prompts: list[list[int]], lens: list[int], tag: str) -> int:
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
                manager.add_request(p, request_id=f"{tag}{i}", max_new_tokens=n)
            done, produced = 0, 0
            while done < len(prompts):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("HF continuous batching thread died")
                    continue
                if result.is_finished():
                    done += 1
                    produced += len(result.generated_tokens)
            return produced

        run(work.prompts[:4], [8] * 4, "warm")  # its first requests are slow (warm-up)
        start = time.perf_counter()
        produced = run(work.prompts, work.output_lens, "r")
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    if produced != work.output_tokens:
        raise RuntimeError(f"HF continuous produced {produced}, expected {work.output_tokens}")
    return elapsed


# -- main --------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    parser.add_argument("--size", default="bench")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--hf-batch-sizes", default="8,16,32,64")
    parser.add_argument("--calibration-requests", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-hf-continuous", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 16 short requests: a smoke run of the script")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads for every system (0: torch's default); on a "
                        "loaded machine 1 avoids OpenMP barrier stalls")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from shoal.runtime.model.make_model import cached_model

    size, count = ("tiny", 16) if args.quick else (args.size, args.requests)
    prompt_range, output_range = ((8, 64), (4, 32)) if args.quick else ((32, 512), (16, 256))
    model_dir = cached_model(args.arch, size)
    mc = load_model_config(model_dir)
    work = make_workload(count, mc.vocab_size, prompt_range, output_range)
    flops = workload_flops(mc, work)
    rates = matmul_rate(mc)
    peak = max(rates.values())
    roofline_s = flops / peak
    print(f"model {model_dir.name}; {count} requests, {sum(map(len, work.prompts))} prompt + "
          f"{work.output_tokens} output tokens; {flops / 1e12:.2f} TFLOP; torch threads "
          f"{torch.get_num_threads()}")
    print("matmul GFLOP/s at rows " + ", ".join(f"{m}: {r / 1e9:.1f}" for m, r in rates.items())
          + f" -> roofline {roofline_s:.1f} s")

    rows: list[dict] = []
    model = load_hf(model_dir)
    calib = work.subset(min(args.calibration_requests, count))
    trials = {}
    for bs in (int(x) for x in args.hf_batch_sizes.split(",")):
        trials[bs] = calib.output_tokens / run_hf_static(model, calib, bs)
        print(f"  HF static batch {bs}: {trials[bs]:.1f} tok/s on {len(calib.prompts)} requests",
              flush=True)
    best_bs = max(trials, key=trials.get)
    def done(system: str, seconds: float) -> None:
        rows.append({"system": system, "seconds": seconds})
        print(f"  {system}: {seconds:.1f} s, {work.output_tokens / seconds:.1f} tok/s",
              flush=True)

    done(f"HF generate (static, batch {best_bs})", run_hf_static(model, work, best_bs))
    if not args.skip_hf_continuous:
        done("HF continuous batching", run_hf_continuous(load_hf(model_dir), work,
                                                         args.max_num_batched_tokens))
    del model
    done("shoal LLM.generate", run_ours(model_dir, work, args.max_num_batched_tokens))

    best_hf = max(work.output_tokens / r["seconds"] for r in rows if r["system"].startswith("HF"))
    print(f"\n{'system':<32} {'seconds':>8} {'out tok/s':>10} {'x best HF':>10} "
          f"{'% roofline':>11}")
    for r in rows:
        r["output_tok_s"] = work.output_tokens / r["seconds"]
        r["ratio_to_best_hf"] = r["output_tok_s"] / best_hf
        r["roofline_share"] = roofline_s / r["seconds"]
        print(f"{r['system']:<32} {r['seconds']:>8.1f} {r['output_tok_s']:>10.1f} "
              f"{r['ratio_to_best_hf']:>10.2f} {100 * r['roofline_share']:>10.1f}%")
    print("(targets: >= 70% of the roofline, >= 3x the best HF figure; shared machine: noisy)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": model_dir.name, "requests": count, "workload_flops": flops,
            "matmul_flops_per_s": {str(k): v for k, v in rates.items()},
            "roofline_seconds": roofline_s, "hf_static_trials_tok_s": trials,
            "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
