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
