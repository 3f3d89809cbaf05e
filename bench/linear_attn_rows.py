"""A Gated DeltaNet layer's token mixing over one step's rows on CPU: the rows one at a time
(a conv and a chunked scan per prefill row, as before) against ``delta_rule.conv_rows`` +
``delta_rule_rows`` (one conv pass over every row, rows of similar length in one padded
scan), in the same run, on one rank's heads of a Qwen3.5-2B-shaped layer by default.

Prints milliseconds per step for each and their ratio; the machine is shared, so only the
same-run ratio means anything. Outputs are checked equal before timing.

    .venv/bin/python bench/linear_attn_rows.py [--heads 16] [--head-dim 128] [--threads 0]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from shoal.runtime.attention.backend import AttentionMetadata
from shoal.runtime.model.delta_rule import (
    causal_conv,
    causal_conv_step,
    chunked_scan,
    conv_rows,
    delta_rule_rows,
    l2_normalise,
    recurrent_step,
)

KERNEL = 4
# (name, prefill rows' lengths, decode rows)
STEPS = (
    ("32 prompts x 16", [16] * 32, 0),
    ("8 prompts x 64 + 16 dec", [64] * 8, 16),
    ("mixed 200/150/90/40 + 32", [200, 150, 90, 40], 32),
    ("2 chunks x 512", [512, 512], 0),
    ("1 chunk x 2048", [2048], 0),
)


def meta_for(lengths: list[int]) -> AttentionMetadata:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    slots = list(range(len(lengths)))
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32), block_tables=torch.zeros(1, 1),
        slot_mapping=torch.zeros(1), max_query_len=max(lengths), max_seq_len=max(lengths),
        block_size=16, query_start_loc_cpu=starts, seq_lens_cpu=lengths,
        state_slots=torch.tensor(slots), state_slots_cpu=slots)


def one_row_at_a_time(mixed, windows, weight, q, k, v, g, beta, states, meta):
    """The loop the batched functions replaced: each prefill row alone."""
    starts, slots = meta.query_start_loc_cpu, meta.state_slots_cpu
    group = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    conv, out = torch.empty_like(mixed), torch.empty_like(v)
    single = [i for i in range(len(slots)) if starts[i + 1] - starts[i] == 1]
    if single:
        at, index = torch.tensor([starts[i] for i in single]), torch.tensor([slots[i] for i in single])
        picked = windows[index]
        conv[at] = causal_conv_step(mixed[at], picked, weight)
        windows[index] = picked
        picked = states[index]
        out[at] = recurrent_step(q[at], k[at], v[at], g[at], beta[at], picked)
        states[index] = picked
    for i, slot in enumerate(slots):
        s, e = starts[i], starts[i + 1]
        if e - s > 1:
            conv[s:e] = causal_conv(mixed[s:e].T, windows[slot], weight).T
            out[s:e] = chunked_scan(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                    v[s:e].transpose(0, 1), g[s:e].T, beta[s:e].T,
                                    states[slot]).transpose(0, 1)
    return conv, out


def batched(mixed, windows, weight, q, k, v, g, beta, states, meta):
    return (conv_rows(mixed, windows, weight, meta),
            delta_rule_rows(q, k, v, g, beta, states, meta))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=16, help="key and value heads per rank")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    heads, dim = args.heads, args.head_dim
    channels = 3 * heads * dim
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(channels, KERNEL, generator=gen) * 0.3
    print(f"{heads} key/value heads x {dim}, conv {channels} channels, torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'step':<28} {'tokens':>6} {'per row ms':>11} {'batched ms':>11} {'ratio':>6}")
    for name, prefills, decodes in STEPS:
        lengths = prefills + [1] * decodes
        meta = meta_for(lengths)
        tokens = sum(lengths)
        mixed = torch.randn(tokens, channels, generator=gen)
        q = l2_normalise(torch.randn(tokens, heads, dim, generator=gen)) * dim ** -0.5
        k = l2_normalise(torch.randn(tokens, heads, dim, generator=gen))
        v = torch.randn(tokens, heads, dim, generator=gen)
        g = -F.softplus(torch.randn(tokens, heads, generator=gen))
        beta = torch.rand(tokens, heads, generator=gen)
        windows = torch.randn(len(lengths), channels, KERNEL - 1, generator=gen)
        states = torch.randn(len(lengths), heads, dim, dim, generator=gen) * 0.1
        results, times = {}, {}
        for fn in (one_row_at_a_time, batched):
            w, s = windows.clone(), states.clone()
            results[fn] = fn(mixed, w, weight, q, k, v, g, beta, s, meta) + (w, s)
            times[fn] = float("inf")
        for _ in range(args.reps):  # alternating, the best of each: load drifts on a shared box
            for fn in (one_row_at_a_time, batched):
                w, s = windows.clone(), states.clone()
                start = time.perf_counter()
                fn(mixed, w, weight, q, k, v, g, beta, s, meta)
                times[fn] = min(times[fn], time.perf_counter() - start)
        for a, b in zip(results[one_row_at_a_time], results[batched], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
        ratio = times[one_row_at_a_time] / times[batched]
        print(f"{name:<28} {tokens:>6} {times[one_row_at_a_time] * 1e3:>11.1f} "
              f"{times[batched] * 1e3:>11.1f} {ratio:>5.2f}x")


if __name__ == "__main__":
    main()
