"""Offline throughput on CPU: our engine against vLLM's CPU build, in the same run.

Workload (fixed seed): the bench-size llama (``shoal make-model --size bench``), ``--requests``
requests (default 128), prompt lengths uniform in ``--prompt-range`` (32..512), output lengths
in ``--output-range`` (16..256), greedy with ignore_eos, all submitted at once, token-id prompts.
Per round (``--rounds``, interleaved so a change in the shared machine's load hits every system):

- ours: ``LLM.generate`` (the engine is built once, before the first round), at each torch
  thread count in ``--threads`` (1 and 2: on a loaded 2-core machine one thread can win);
- vLLM: ``LLM.generate`` in its own venv (``bench/peers.py``), once per thread binding in
  ``--vllm-bind`` (its default ``auto`` and ``0-1``: both cores for the model); the better
  binding is the peer's figure and the better thread count ours;
- with ``--peer hf`` as well (context only): HF ``generate`` in static batches at the best
  batch size of a calibration, and HF continuous batching.

For each: output tokens/s, ratio to the peer (best vLLM binding), share of the CPU floor
measured in this run (``bench/floor.py``: the matmul FLOPs at the measured matmul rate plus the
decode K/V bytes at a streaming read rate) and the load average when it ran. The machine is
shared (2 cores): figures are noisy.

    .venv/bin/python bench/offline_throughput.py [--peer vllm[,hf]] [--requests 128]
        [--rounds 1] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.cli import OPENMP_DEFAULTS  # noqa: E402  (imports no torch)

# what `shoal` sets for every process it starts (docs/operations.md); this in-process engine
# gets the same
for _name, _value in OPENMP_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
from shoal.runtime.model.config import load_model_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers  # noqa: E402  (bench/ is not a package)
from floor import Floor, Work  # noqa: E402


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


# -- the three systems -------------------------------------------------------------------------

def build_ours(model_dir: Path, work: Workload, max_num_batched_tokens: int,
               dtype: str = "float32"):
    from shoal.runtime.llm import LLM

    return LLM(model_dir, dtype=dtype, device="cpu", max_num_seqs=len(work.prompts),
               max_num_batched_tokens=max_num_batched_tokens,
               max_model_len=max(len(p) for p in work.prompts) + max(work.output_lens) + 16)


def run_ours(llm, work: Workload) -> float:
    """One timed pass in the state the peer's fresh process starts each pass in: an empty
    prefix cache, then the same two-request warm-up (a second round must not find the first
    round's prompts cached)."""
    from shoal.runtime.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in work.output_lens]
    if not llm.engine.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset (requests still running)")
    llm.generate(work.prompts[:2], params[:2])  # warm-up, like the peer's
    start = time.perf_counter()
    results = llm.generate(work.prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    if produced != work.output_tokens:
        raise RuntimeError(f"ours produced {produced} tokens, expected {work.output_tokens}")
    return elapsed


def run_vllm(peer: peers.VllmPeer, model_dir: Path, work: Workload,
             max_num_batched_tokens: int, scratch: Path, dtype: str = "float32") -> float:
    result = peers.run_vllm_offline(peer, model_dir, work.prompts, work.output_lens,
                                    max_num_batched_tokens, scratch / "offline_work.json", dtype)
    if result["output_tokens"] != work.output_tokens:
        raise RuntimeError(f"{peer.name} produced {result['output_tokens']} tokens, expected "
                           f"{work.output_tokens}")
    print(f"  ({peer.name} started in {result['startup_seconds']:.0f} s)", flush=True)
    return float(result["seconds"])


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
    parser.add_argument("--model-dir", default="",
                        help="a checkpoint directory to run instead of --arch/--size (e.g. "
                             "bench/gpu/checkpoint.py's Qwen3-0.6B-shaped one)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="ours and the peer's serving dtype (HF runs float32)")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-range", default="32-512")
    parser.add_argument("--output-range", default="16-256")
    parser.add_argument("--peer", default="vllm", help="comma-separated: vllm, hf")
    parser.add_argument("--vllm-venv", default=peers.DEFAULT_VLLM_VENV)
    parser.add_argument("--vllm-bind", default="auto,0-1",
                        help="VLLM_CPU_OMP_THREADS_BIND values to measure (comma-separated)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleaved rounds of every system (the best round counts)")
    parser.add_argument("--hf-batch-sizes", default="8,16,32,64")
    parser.add_argument("--calibration-requests", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--skip-hf-continuous", action="store_true")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 16 short requests: a smoke run of the script")
    parser.add_argument("--threads", default="1,2",
                        help="torch thread counts to measure ours at (comma-separated; the "
                        "better is our figure, like the peer's bindings); HF runs at the first")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    torch.set_num_threads(thread_counts[0])
    wanted = {p.strip() for p in args.peer.split(",") if p.strip()}
    if wanted - {"vllm", "hf"}:
        parser.error(f"unknown peer(s) {sorted(wanted - {'vllm', 'hf'})}")
    vllm = (peers.vllm_peers(args.vllm_venv, args.vllm_bind, kv_cache_gib=2)
            if "vllm" in wanted else [])

    from shoal.runtime.model.make_model import cached_model

    size, count = ("tiny", 16) if args.quick else (args.size, args.requests)
    prompt_range = (8, 64) if args.quick else tuple(map(int, args.prompt_range.split("-")))
    output_range = (4, 32) if args.quick else tuple(map(int, args.output_range.split("-")))
    model_dir = Path(args.model_dir) if args.model_dir else cached_model(args.arch, size)
    mc = load_model_config(model_dir)
    work = make_workload(count, mc.vocab_size, prompt_range, output_range)  # type: ignore[arg-type]
    floor = Floor.measure(mc, max(thread_counts), getattr(torch, args.dtype))  # widest setting
    prompt_lens = [len(p) for p in work.prompts]
    compute_s, kv_s = floor.split(Work.of_requests(prompt_lens, work.output_lens))
    floor_s = compute_s + kv_s
    print(f"model {model_dir.name} in {args.dtype}; {count} requests, {sum(prompt_lens)} prompt + "
          f"{work.output_tokens} output tokens; torch threads {torch.get_num_threads()}; load "
          f"average {peers.load_average()}")
    print(f"{floor.describe()} -> floor {floor_s:.1f} s (matmuls or weight reads {compute_s:.1f} s + "
          f"decode K/V reads {kv_s:.1f} s; bench/floor.py)")

    rows: list[dict] = []

    def done(system: str, seconds: float, load: str, round_: int) -> None:
        rows.append({"system": system, "seconds": seconds, "load_average": load,
                     "round": round_})
        print(f"  round {round_} {system}: {seconds:.1f} s, {work.output_tokens / seconds:.1f} "
              f"tok/s (load {load})", flush=True)

    trials: dict[int, float] = {}
    if "hf" in wanted:
        model = load_hf(model_dir)
        calib = work.subset(min(args.calibration_requests, count))
        for bs in (int(x) for x in args.hf_batch_sizes.split(",")):
            trials[bs] = calib.output_tokens / run_hf_static(model, calib, bs)
            print(f"  HF static batch {bs}: {trials[bs]:.1f} tok/s on {len(calib.prompts)} "
                  "requests", flush=True)
        best_bs = max(trials, key=lambda bs: trials[bs])
        load = peers.load_average()
        done(f"HF generate (static, batch {best_bs})", run_hf_static(model, work, best_bs),
             load, 0)
        if not args.skip_hf_continuous:
            load = peers.load_average()
            done("HF continuous batching", run_hf_continuous(load_hf(model_dir), work,
                                                             args.max_num_batched_tokens),
                 load, 0)
        del model

    ours = build_ours(model_dir, work, args.max_num_batched_tokens, args.dtype)
    worker = getattr(ours.engine.executor, "worker", None)  # in-process: say what runs
    if worker is not None and worker.runner is not None:
        print(f"ours: {worker.runner.model.kernels.choice}")
    scratch = Path(tempfile.mkdtemp(prefix="shoal-bench-"))
    for round_ in range(1, args.rounds + 1):
        systems: list[int | peers.VllmPeer] = [*thread_counts, *vllm]
        if round_ % 2 == 0:
            systems.reverse()
        for system in systems:
            load = peers.load_average()
            if isinstance(system, int):
                torch.set_num_threads(system)
                done(f"shoal[threads={system}]", run_ours(ours, work), load, round_)
            else:
                assert isinstance(system, peers.VllmPeer)
                done(system.name, run_vllm(system, model_dir, work,
                                           args.max_num_batched_tokens, scratch, args.dtype),
                     load, round_)

    best: dict[str, float] = {}  # system -> its best round's tok/s
    for r in rows:
        r["output_tok_s"] = work.output_tokens / r["seconds"]
        r["floor_share"] = floor_s / r["seconds"]
        best[r["system"]] = max(best.get(r["system"], 0.0), r["output_tok_s"])
    peer_name = max((s for s in best if s.startswith("vllm")), key=best.__getitem__,
                    default=None)
    ours_name = max((s for s in best if s.startswith("shoal")), key=best.__getitem__)
    print(f"\n{'system':<34} {'round':>5} {'seconds':>8} {'out tok/s':>10} {'x peer':>7} "
          f"{'% floor':>8}  load 1/5/15")
    for r in rows:
        ratio = f"{r['output_tok_s'] / best[peer_name]:.2f}" if peer_name else "-"
        r["ratio_to_peer"] = r["output_tok_s"] / best[peer_name] if peer_name else None
        print(f"{r['system']:<34} {r['round']:>5} {r['seconds']:>8.1f} {r['output_tok_s']:>10.1f} "
              f"{ratio:>7} {100 * r['floor_share']:>7.1f}%  {r['load_average']}")
    if peer_name:
        print(f"{ours_name} / {peer_name} (the better setting of each, best rounds): "
              f"{best[ours_name] / best[peer_name]:.2f}x")
    print("(target: >= 1.2x the peer; shared machine: noisy)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": model_dir.name, "requests": count, "dtype": args.dtype,
            "matmul_flops_per_s": {str(k): v for k, v in floor.matmul_flops_per_s.items()},
            "read_bytes_per_s": floor.read_bytes_per_s, "floor_seconds": floor_s,
            "hf_static_trials_tok_s": trials,
            "peer": peer_name, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
