"""The Gated DeltaNet Triton kernels (interpreted on CPU) against the torch reference in
``runtime/model/delta_rule.py``: the conv, the decode step and the chunked scan over a
step's rows at once, each row in its own state slot, states updated in place."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from shoal.runtime.model import delta_rule as ref

from shoal.kernels import gated_delta_rule as gdr


def _inputs(rng, tokens, k_heads, v_heads, dk, dv):
    q = ref.l2_normalise(torch.randn(tokens, k_heads, dk, generator=rng)) * dk ** -0.5
    k = ref.l2_normalise(torch.randn(tokens, k_heads, dk, generator=rng))
    v = torch.randn(tokens, v_heads, dv, generator=rng)
    # decays from strong to none, write strengths over (0, 1)
    g = -F.softplus(torch.randn(tokens, v_heads, generator=rng) * 2)
    beta = torch.rand(tokens, v_heads, generator=rng)
    return q, k, v, g, beta


def _per_value_head(x, group):
    return x.repeat_interleave(group, 1)


def test_chunked_scan_matches_the_reference_over_rows_of_mixed_lengths(rng):
    # a decode-like row, a row inside one chunk, rows over several chunks (CHUNK = 32)
    lengths, k_heads, v_heads, dk, dv = [1, 13, 70, 33], 2, 4, 16, 24
    slots_list = [3, 0, 4, 1]
    starts = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v, g, beta = _inputs(rng, int(starts[-1]), k_heads, v_heads, dk, dv)
    states = torch.randn(5, v_heads, dk, dv, generator=rng) * 0.3
    expected_states = states.clone()

    out = gdr.chunked_scan(q, k, v, g, beta, states, starts,
                           torch.tensor(slots_list, dtype=torch.int64))

    group = v_heads // k_heads
    for row, slot in enumerate(slots_list):
        s, e = int(starts[row]), int(starts[row + 1])
        qh, kh = (_per_value_head(x[s:e], group).transpose(0, 1) for x in (q, k))
        want = ref.chunked_scan(qh, kh, v[s:e].transpose(0, 1), g[s:e].T, beta[s:e].T,
                                expected_states[slot]).transpose(0, 1)
        torch.testing.assert_close(out[s:e], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, expected_states, rtol=1e-4, atol=1e-4)


def test_recurrent_step_matches_the_reference_and_leaves_other_slots(rng):
    rows, k_heads, v_heads, dk, dv = 3, 1, 3, 16, 40  # dv over one value block (32)
    q, k, v, g, beta = _inputs(rng, rows, k_heads, v_heads, dk, dv)
    states = torch.randn(4, v_heads, dk, dv, generator=rng) * 0.3
    slots = torch.tensor([2, 0, 3])
    expected_states = states.clone()
    picked = expected_states[slots]
    want = ref.recurrent_step(_per_value_head(q, 3), _per_value_head(k, 3), v, g, beta, picked)
    expected_states[slots] = picked

    out = gdr.recurrent_step(q, k, v, g, beta, states, slots)

    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected_states, rtol=1e-5, atol=1e-5)


def test_causal_conv_matches_the_reference_per_row_and_updates_windows(rng):
    channels, width = 40, 4
    lengths, slots_list = [1, 2, 20], [1, 2, 0]  # rows shorter than the window, and longer
    starts = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x = torch.randn(int(starts[-1]), channels, generator=rng)
    weight = torch.randn(channels, width, generator=rng)
    windows = torch.randn(3, channels, width - 1, generator=rng)
    expected_windows = windows.clone()

    out = gdr.causal_conv(x, windows, weight, starts, torch.tensor(slots_list))

    for row, slot in enumerate(slots_list):
        s, e = int(starts[row]), int(starts[row + 1])
        want = ref.causal_conv(x[s:e].T, expected_windows[slot], weight).T
        torch.testing.assert_close(out[s:e], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(windows, expected_windows)


def test_causal_conv_in_bfloat16_rounds_once_at_the_end(rng):
    channels, width = 8, 4
    x = torch.randn(5, channels, generator=rng).bfloat16()
    weight = torch.randn(channels, width, generator=rng).bfloat16()
    windows = torch.randn(1, channels, width - 1, generator=rng).bfloat16()
    before = windows[0].clone()

    out = gdr.causal_conv(x, windows, weight, torch.tensor([0, 5], dtype=torch.int32),
                          torch.tensor([0]))

    want = ref.causal_conv(x.float().T, before.float(), weight.float()).T
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(windows[0], x[-(width - 1):].T)  # the last inputs, as they were
