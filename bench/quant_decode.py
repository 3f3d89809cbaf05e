"""Decode throughput of quantized checkpoints against the same model in float32 (the CPU default) or bf16,
through the offline engine (``LLM.generate``), at several batch sizes, in one run.

The ``gguf-*`` modes serve the default model (SmolLM2-135M-Instruct, a Q4_1 GGUF with a Q8_0
embedding) instead: ``gguf-q`` as the engine loads it (its Q4_1 linear layers kept in their
blocks, on the native int kernel), ``gguf-f32`` with every tensor dequantized to float32 at
load, as before the kernel (``loader.keeps_gguf_quantized`` patched off in this process).
Each mode also prints the model's resident weight bytes.

The model has Qwen3-0.6B's layer shapes (hidden 1024, MLP 3072, 16 query heads and 8 KV heads
of 128) with ``--layers`` layers and the test tokenizer's 1024-token vocabulary, random weights;
it is quantized by ``make_quant_model`` (compressed-tensors int4 group 128 through the
compressed-tensors library; FP8 in 128x128 blocks). Each (mode, batch) generates ``--tokens``
tokens for ``batch`` prompts of 8 tokens, greedy, ignoring EOS, after one warm-up call; tok/s
counts generated tokens over the call's wall time (the short prefill included). Every
engine is loaded first; then, ``--rounds`` times, each (batch, mode) runs once with the modes
taking turns, and the median round is reported (with the process's CPU time per token). The
machine's load moves every row: compare rows of one run.

    .venv/bin/python bench/quant_decode.py [--layers 8] [--batches 1,16,64] [--tokens 16]
        [--modes f32,bf16,int4-w4a16,int4-bf16,gguf-q,gguf-f32] [--vllm bf16,int8-w8a8]
        [--moe]

``--moe``: the model is ``make_moe_model``'s Qwen3-MoE ``bench`` shape (hidden 1024, 64
experts of 256, top-8, 16 query / 4 KV heads of 64, an 8192-token vocabulary) with
``--layers`` layers, saved in bfloat16 (a bfloat16 release: compressed-tensors then writes
bfloat16 scales); its experts stay quantized (``model/quant/experts.py``), one grouped kernel
call per block, against the bf16 experts on the float experts kernel.

``--vllm MODES``: vLLM's CPU build (``bench/peers.py``, ``SHOAL_VLLM_VENV``) on the same
checkpoints and prompts in the same run, after Shoal's rounds: one process per mode, the
same batches and rounds in it, the median round; printed as Shoal / vLLM per mode. What
vLLM 0.32's CPU build serves on an AVX2 CPU: compressed-tensors W8A8 int8 (``int8-w8a8``;
vLLM quantizes the activations per token, Shoal runs the int8 weights on bf16 activations)
and the dense model; its compressed-tensors W4A16 dies without the ``cpu_gemm_wna16`` op.

int4 runs on the native weight-only kernel (``shoal/kernels/int_matmul_cpu.c``) wherever the
native library builds; without a C compiler it falls back to torch's packed int4 op, which
runs far below float32 on a CPU without AVX-512 (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/ is not a package)

MODES = {  # name -> (checkpoint format or None for the dense one, engine dtype)
    "f32": (None, "float32"),  # the engine's CPU default
    "bf16": (None, "bfloat16"),  # not in the default set: see below
    "int4-w4a16": ("ct-w4-group128", "float32"),
    "fp8-block": ("fp8-block128", "float32"),
    "int4-bf16": ("ct-w4-group128", "bfloat16"),
    "int4-g32-bf16": ("ct-w4-group", "bfloat16"),  # group 32, as published W4A16 MoEs
    "fp8-bf16": ("fp8-block128", "bfloat16"),
    "int8-w8a8": ("ct-w8a8-int", "bfloat16"),  # compressed-tensors W8A8 (vLLM serves it)
    "gguf-q": ("gguf", "float32"),  # the default model, Q4_1 layers kept quantized
    "gguf-f32": ("gguf", "float32"),  # the same file dequantized to float32 at load
}
DEFAULT_MODES = "f32,bf16,int4-w4a16,int4-bf16,gguf-q,gguf-f32"


def dense_checkpoint(layers: int) -> Path:
    import torch
    from shoal.runtime.model.make_model import cache_dir, cached_model
    from shoal.runtime.model.make_quant_model import TOKENIZER_FILES
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = cache_dir() / "models" / f"qwen3-0.6b-shape-{layers}l"
    if (out / "config.json").exists():
        return out
    tokenizer_source = cached_model("qwen3", "tiny")
    config = Qwen3Config(vocab_size=1024, hidden_size=1024, intermediate_size=3072,
                         num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         max_position_embeddings=512, eos_token_id=2, bos_token_id=0)
    torch.manual_seed(0)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).is_file() and name != "generation_config.json":
            shutil.copy(tokenizer_source / name, tmp / name)
    os.rename(tmp, out)
    return out


def moe_checkpoint(layers: int) -> Path:
    import torch
    from shoal.runtime.model.make_model import cache_dir, random_model, save_checkpoint
    from shoal.runtime.model.make_moe_model import moe_hf_config

    out = cache_dir() / "models" / f"qwen3_moe-bench-shape-{layers}l-bf16"
    if (out / "config.json").exists():
        return out
    config = moe_hf_config("qwen3_moe", "bench")
    config.num_hidden_layers = layers
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_checkpoint(random_model(config, 0).to(torch.bfloat16), tmp, config.vocab_size)
    os.rename(tmp, out)
    return out


def checkpoint(dense: Path, fmt: str | None) -> Path:
    from shoal.runtime.model.make_quant_model import make_quant_model
    from shoal.runtime.model_source import default_model

    if fmt is None:
        return dense
    if fmt == "gguf":
        return default_model()
    out = dense.with_name(f"{dense.name}-{fmt}")
    if not (out / "config.json").exists():
        make_quant_model(dense, fmt, out.with_name(out.name + ".tmp"))
        os.rename(out.with_name(out.name + ".tmp"), out)
    return out


def start(mode: str, model_dir: Path, dtype: str, batches: list[int]):
    from shoal.runtime.llm import LLM
    from shoal.runtime.model import loader
    from shoal.runtime.model.linear import resident_weight_bytes

    keeps = loader.keeps_gguf_quantized
    if mode == "gguf-f32":
        loader.keeps_gguf_quantized = lambda *args: False  # type: ignore[assignment]
    try:
        llm = LLM(str(model_dir), dtype=dtype, num_kv_blocks=max(batches) * 4 + 8,
                  max_num_seqs=max(batches),
                  max_num_batched_tokens=max(512, 8 * max(batches)))
    finally:
        loader.keeps_gguf_quantized = keeps  # type: ignore[assignment]
    model = llm.engine.executor.worker.runner.model  # type: ignore[attr-defined]
    print(f"{mode:>11} resident weights {resident_weight_bytes(model) / 2**20:.1f} MiB",
          flush=True)
    return llm


def timed(llm, batch: int, tokens: int) -> tuple[float, float]:
    """(tok/s over the call's wall time, the process's CPU seconds per generated token)."""
    from shoal.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [[3 + (i * 7 + j) % 1000 for j in range(8)] for i in range(batch)]
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return produced / wall, cpu / produced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every (batch, mode), modes taking turns within a "
                             "round; the median round is reported")
    parser.add_argument("--vllm", default="", help="modes to run on vLLM's CPU build too")
    parser.add_argument("--moe", action="store_true",
                        help="a Qwen3-MoE-shaped model: quantized experts against bf16 ones")
    parser.add_argument("--vllm-venv", default=peers.DEFAULT_VLLM_VENV)
    parser.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    dense = moe_checkpoint(args.layers) if args.moe else dense_checkpoint(args.layers)
    # every engine loaded first, then the modes take turns: a neighbour's load moves them
    # all alike within a round
    engines = {}
    for mode in modes:
        fmt, dtype = MODES[mode]
        engines[mode] = start(mode, checkpoint(dense, fmt), dtype, batches)
        timed(engines[mode], 1, 4)  # warm-up
    samples: dict[str, dict[int, list[tuple[float, float]]]] = {
        m: {b: [] for b in batches} for m in modes}
    for round_index in range(args.rounds):
        for batch in batches:
            for mode in modes:
                rate, cpu = timed(engines[mode], batch, args.tokens)
                samples[mode][batch].append((rate, cpu))
                print(f"round {round_index} {mode:>11} batch {batch:>3}: {rate:8.1f} tok/s, "
                      f"{cpu * 1e3:7.1f} CPU ms/token", flush=True)
    results = {m: {b: statistics.median(r for r, _ in samples[m][b]) for b in batches}
               for m in modes}
    cpu_ms = {m: {b: statistics.median(c for _, c in samples[m][b]) * 1e3 for b in batches}
              for m in modes}
    for mode in modes:
        print(f"{mode:>11} median: " + ", ".join(
            f"b{b} {results[mode][b]:.1f} tok/s ({cpu_ms[mode][b]:.1f} CPU ms/token)"
            for b in batches))
    # the Qwen3-shaped modes against its dense float32 and bf16 runs; the GGUF ones against
    # the dequantized file
    for base_name in ("f32", "bf16", "gguf-f32"):
        if base_name not in results:
            continue
        gguf_base = base_name.startswith("gguf")
        for mode, rows in results.items():
            if mode == base_name or mode.startswith("gguf") != gguf_base:
                continue
            ratios = ", ".join(f"b{b} {rows[b] / results[base_name][b]:.2f}x" for b in batches)
            print(f"{mode:>11} vs {base_name}: {ratios}")
    vllm = {mode: vllm_rates(args, mode, dense, batches) for mode in args.vllm.split(",")
            if mode}
    for mode, rows in vllm.items():
        print(f"vllm {mode:>11} median: " + ", ".join(f"b{b} {rows[b]:.1f} tok/s"
                                                     for b in batches))
        if mode in results:
            print(f"shoal/vllm {mode:>11}: " + ", ".join(
                f"b{b} {results[mode][b] / rows[b]:.2f}x" for b in batches))
    print(json.dumps({"load_average": os.getloadavg(), "results": results, "cpu_ms": cpu_ms,
                      "vllm": vllm}))
    return 0


def vllm_rates(args: argparse.Namespace, mode: str, dense: Path, batches: list[int]
               ) -> dict[int, float]:
    """vLLM's decode tok/s per batch on ``mode``'s checkpoint: the median of the rounds."""
    import tempfile

    fmt, dtype = MODES[mode]
    (peer,) = peers.vllm_peers(args.vllm_venv, args.vllm_bind, kv_cache_gib=2)
    prompts = [[3 + (i * 7 + j) % 1000 for j in range(8)] for i in range(max(batches))]
    print(f"vllm {mode}: starting (load {peers.load_average()})", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        result = peers.run_vllm_offline(
            peer, checkpoint(dense, fmt), prompts, [args.tokens] * len(prompts),
            max(512, 8 * max(batches)), Path(scratch) / "work.json", dtype=dtype,
            batches=batches, rounds=args.rounds)
    runs = result["batch_runs"]
    for b in batches:
        for i, (seconds, tokens) in enumerate(runs[str(b)]):
            print(f"round {i} vllm {mode:>11} batch {b:>3}: {tokens / seconds:8.1f} tok/s",
                  flush=True)
    return {b: statistics.median(t / s for s, t in runs[str(b)]) for b in batches}


if __name__ == "__main__":
    raise SystemExit(main())
