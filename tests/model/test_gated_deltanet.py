"""The Gated DeltaNet pieces against transformers' torch reference (``modeling_qwen3_next``):
the chunked scan and the one-token update continue a state exactly as the reference's
recurrent and chunked functions do, across chunk boundaries and split prefills; the causal
conv continued from a window equals the conv over the whole sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from shoal.runtime.model.delta_rule import (
    causal_conv,
    causal_conv_step,
    chunked_scan,
    l2_normalise,
    recurrent_step,
)

H, DK, DV = 4, 16, 8


def _inputs(length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, length, H, DK, generator=gen) for _ in range(2))
    v = torch.randn(1, length, H, DV, generator=gen)
    g = -torch.rand(1, length, H, generator=gen) * 2  # log decays in (-2, 0]
    beta = torch.rand(1, length, H, generator=gen)
    return q, k, v, g, beta


def _ours(q, k, v):
    """The reference's in-kernel normalisation, done by our caller (gated_deltanet.py)."""
    return l2_normalise(q) * DK ** -0.5, l2_normalise(k), v


@pytest.mark.parametrize("splits", [[150], [1, 63, 64, 2], [70, 1, 1, 30]])
def test_chunked_scan_and_steps_continue_the_state_as_the_reference(splits):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    total = sum(splits)
    q, k, v, g, beta = _inputs(total, seed=total)
    init = torch.randn(1, H, DK, DV) * 0.1
    want, want_state = torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=init.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    chunked, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta,
                                              initial_state=init.clone(),
                                              output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(chunked, want, rtol=1e-4, atol=1e-4)  # the reference agrees
    qn, kn, vn = _ours(q[0], k[0], v[0])
    state, outs, at = init[0].clone(), [], 0
    for n in splits:
        s = slice(at, at + n)
        if n == 1:  # a decode step: the batched one-token update
            out = recurrent_step(qn[s], kn[s], vn[s], g[0, s], beta[0, s], state[None])[0]
            outs.append(out[None])
        else:
            outs.append(chunked_scan(qn[s].transpose(0, 1), kn[s].transpose(0, 1),
                                     vn[s].transpose(0, 1), g[0, s].T, beta[0, s].T,
                                     state).transpose(0, 1))
        at += n
    torch.testing.assert_close(torch.cat(outs)[None], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[None], want_state, rtol=1e-4, atol=1e-4)


def test_causal_conv_continued_from_its_window_equals_the_whole_conv():
    gen = torch.Generator().manual_seed(0)
    channels, kernel, length = 6, 4, 20
    x = torch.randn(channels, length, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    whole = F.silu(F.conv1d(x[None], weight[:, None], padding=kernel - 1,
                            groups=channels)[0, :, :length])
    window = torch.zeros(channels, kernel - 1)
    first = causal_conv(x[:, :11], window, weight)
    steps = [causal_conv_step(x[None, :, t], window[None], weight)[0] for t in range(11, 13)]
    rest = causal_conv(x[:, 13:], window, weight)
    got = torch.cat([first, torch.stack(steps, -1), rest], dim=-1)
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)


def _step_meta(lengths: list[int], slots: list[int]):
    from shoal.runtime.attention.backend import AttentionMetadata

    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32), block_tables=torch.zeros(1, 1),
        slot_mapping=torch.zeros(1), max_query_len=max(lengths), max_seq_len=max(lengths),
        block_size=4, query_start_loc_cpu=starts, seq_lens_cpu=lengths,
        state_slots=torch.tensor(slots), state_slots_cpu=slots), starts


@pytest.mark.parametrize("lengths", [[70, 1, 65, 3, 1, 128, 2], [1, 1, 1]])
def test_a_steps_rows_together_equal_each_row_alone(lengths):
    """conv_rows and delta_rule_rows (rows of similar length batched into one padded scan,
    one conv pass over every row) against the per-row functions, each row in its own slot;
    GQA (2 value heads per key head)."""
    from shoal.runtime.model.delta_rule import conv_rows, delta_rule_rows

    gen = torch.Generator().manual_seed(len(lengths))
    slots = torch.randperm(len(lengths) + 2, generator=gen)[:len(lengths)].tolist()
    meta, starts = _step_meta(lengths, slots)
    tokens, channels, width = starts[-1], 12, 4
    mixed = torch.randn(tokens, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    windows = torch.randn(len(lengths) + 2, channels, width - 1, generator=gen)
    q, k = (l2_normalise(torch.randn(tokens, H // 2, DK, generator=gen)) for _ in range(2))
    v = torch.randn(tokens, H, DV, generator=gen)
    g = -torch.rand(tokens, H, generator=gen) * 2
    beta = torch.rand(tokens, H, generator=gen)
    states = torch.randn(len(lengths) + 2, H, DK, DV, generator=gen) * 0.1
    want_windows, want_states = windows.clone(), states.clone()

    conv = conv_rows(mixed.clone(), windows, weight, meta)
    out = delta_rule_rows(q, k, v, g, beta, states, meta)

    qh, kh = q.repeat_interleave(2, 1), k.repeat_interleave(2, 1)
    for row, slot in enumerate(slots):
        s, e = starts[row], starts[row + 1]
        want_conv = causal_conv(mixed[s:e].T, want_windows[slot], weight).T
        torch.testing.assert_close(conv[s:e], want_conv, rtol=1e-5, atol=1e-5)
        want = chunked_scan(qh[s:e].transpose(0, 1), kh[s:e].transpose(0, 1),
                            v[s:e].transpose(0, 1), g[s:e].T, beta[s:e].T,
                            want_states[slot]).transpose(0, 1)
        torch.testing.assert_close(out[s:e], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(windows, want_windows)
    torch.testing.assert_close(states, want_states, rtol=1e-4, atol=1e-4)


def test_scan_groups_batch_rows_of_similar_length_only():
    from shoal.runtime.model.delta_rule import scan_groups

    # blocks of 64 tokens: 2, 2, 1, 1, 8. The 8-block row alone; the 2s together with one
    # 1 (6 padded blocks for 5 needed, within 1.25x), the other 1 would make it 8 for 6
    assert scan_groups([100, 128, 64, 3, 500]) == [[4], [0, 1, 2], [3]]
    assert scan_groups([64] * 5) == [[0, 1, 2, 3, 4]]
    assert scan_groups([]) == []
