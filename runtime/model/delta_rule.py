"""The gated delta rule and the causal conv of a Gated DeltaNet layer, in plain torch (CPU).

``conv_rows`` and ``delta_rule_rows`` run them over a step's rows (each row's state in its
slot); ``shoal/kernels/gated_delta_rule.py`` is the same on CUDA, chosen in ``ops``.

Per value head, with the recurrent state ``S [key dim, value dim]`` and per token a decay
``g <= 0`` (log space), a write strength ``beta`` in (0, 1), L2-normalised ``k`` and ``q``
(``q`` also scaled by ``key_dim ** -0.5``)::

    S = exp(g) * S
    S = S + beta * k (v - S^T k)^T      # write only what S does not already predict
    o = S^T q

``recurrent_step`` is that for one token per request (decode). ``chunked_scan`` is the same
function for a prefill chunk, computed a block of ``CHUNK`` tokens at a time: within a
block the sequential writes are condensed by solving one unit-lower-triangular system (the
WY/UT form of DeltaNet), so the work is a few matmuls per block instead of one rank-1
update per token, and the state crosses blocks exactly as it would token by token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from shoal.runtime.attention.backend import AttentionMetadata

CHUNK = 64


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As the reference kernels (FLA) normalise q and k: eps inside the square root."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token for each of B requests: ``q``/``k [B, H, Dk]`` (normalised, q scaled),
    ``v [B, H, Dv]``, ``g``/``beta [B, H]``, ``state [B, H, Dk, Dv]`` float32, updated in
    place. Returns ``o [B, H, Dv]``."""
    state.mul_(g.exp()[..., None, None])
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    state.add_(k.unsqueeze(-1) * ((v - predicted) * beta.unsqueeze(-1)).unsqueeze(-2))
    return torch.einsum("bhkv,bhk->bhv", state, q)


def chunked_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One request's ``L`` tokens: ``q``/``k [H, L, Dk]``, ``v [H, L, Dv]``, ``g``/``beta
    [H, L]`` (float32), continuing from ``state [H, Dk, Dv]`` (updated in place). Returns
    ``o [H, L, Dv]``."""
    length = q.shape[1]
    pad = (-length) % CHUNK
    if pad:  # padded tokens have g = 0 (no decay) and beta = 0 (no write): inert
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    heads, total = q.shape[0], q.shape[1]
    blocks = total // CHUNK
    q, k, v = (x.reshape(heads, blocks, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, blocks, CHUNK), beta.reshape(heads, blocks, CHUNK)
    cum = g.cumsum(-1)  # log of the decay from the block's start through token i
    # decay between tokens j <= i of a block, exp(cum_i - cum_j); zero above the diagonal
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    # token i's write depends on the earlier writes j < i of its block through
    # beta_i k_i.k_j decay_ij: solve (I + that strictly lower matrix) once per block
    system = (k_beta @ k.transpose(-1, -2)) * decay
    system = system.tril(-1) + torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    values = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False,
                                           unitriangular=True)
    state_keys = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1),
                                               upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # q_i.k_j for j <= i, decayed
    q_decayed = q * cum.exp().unsqueeze(-1)  # what of the block-start state token i reads
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # decayed to the block's end
    block_decay = cum[..., -1].exp()
    out = torch.empty_like(v)
    for b in range(blocks):
        # the writes' new information, net of what the block-start state already predicts
        new = values[:, b] - state_keys[:, b] @ state
        out[:, b] = q_decayed[:, b] @ state + intra[:, b] @ new
        state.mul_(block_decay[:, b, None, None]).add_(k_to_end[:, b].transpose(-1, -2) @ new)
    return out.reshape(heads, total, -1)[:, :length]


def causal_conv(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv + SiLU over one request's ``x [C, L]``, continuing from its last
    ``K - 1`` inputs ``window [C, K-1]`` (updated in place); ``weight [C, K]``."""
    full = torch.cat([window.to(x.dtype), x], dim=-1)
    window.copy_(full[:, -window.shape[-1]:])
    out = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=x.shape[0])[0]
    return F.silu(out)


def causal_conv_step(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor
                     ) -> torch.Tensor:
    """One token for each of B requests: ``x [B, C]``, ``windows [B, C, K-1]`` (updated in
    place), ``weight [C, K]``. Returns ``silu(conv) [B, C]``."""
    full = torch.cat([windows.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    windows.copy_(full[..., 1:])
    return F.silu((full * weight).sum(-1))


class StepRows:
    """The step's rows by kind: one-token rows (decodes, the odd one-token chunk) run the
    batched recurrent update together; a row of several tokens runs the chunked scan. A
    mixed step would otherwise pad each decode row to a whole scan block."""

    def __init__(self, meta: AttentionMetadata) -> None:
        starts, slots = meta.query_start_loc_cpu, meta.state_slots_cpu
        assert slots is not None and meta.state_slots is not None, \
            "a linear-attention layer needs AttentionMetadata.state_slots"
        self.single_slots: torch.Tensor | None = None
        self.single_tokens: torch.Tensor | slice = slice(None)
        if meta.max_query_len == 1:  # pure decode: every token is its row's only one
            self.single_slots, self.spans = meta.state_slots, []
            return
        single = [i for i in range(len(slots)) if starts[i + 1] - starts[i] == 1]
        self.spans = [(starts[i], starts[i + 1], slots[i]) for i in range(len(slots))
                      if starts[i + 1] - starts[i] > 1]
        if single:
            device = meta.state_slots.device
            self.single_slots = torch.tensor([slots[i] for i in single], device=device)
            self.single_tokens = torch.tensor([starts[i] for i in single], device=device)


def conv_rows(mixed: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
    """``silu(conv)`` over the step's rows: ``mixed [T, C]``, ``conv_states [slots, C, K-1]``
    (the rows' windows updated in place), ``weight [C, K]``."""
    rows = StepRows(meta)
    out = torch.empty_like(mixed) if rows.spans else mixed
    if rows.single_slots is not None:  # one-token rows together: gather, step, scatter
        windows = conv_states[rows.single_slots]
        out[rows.single_tokens] = causal_conv_step(mixed[rows.single_tokens], windows, weight)
        conv_states[rows.single_slots] = windows
    for s, e, slot in rows.spans:  # prefill chunks: each from its own window
        out[s:e] = causal_conv(mixed[s:e].T, conv_states[slot], weight).T
    return out


def delta_rule_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, states: torch.Tensor, meta: AttentionMetadata
                    ) -> torch.Tensor:
    """The gated delta rule over the step's rows: ``q``/``k [T, Hk, Dk]`` per key head
    (normalised, q scaled), ``v [T, Hv, Dv]``, ``g``/``beta [T, Hv]`` float32, ``states
    [slots, Hv, Dk, Dv]`` (the rows' states updated in place). Returns ``o [T, Hv, Dv]``."""
    rows = StepRows(meta)
    group = v.shape[1] // q.shape[1]  # each key head serves ``group`` consecutive value heads
    q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    out = torch.empty_like(v)
    if rows.single_slots is not None:
        at, picked = rows.single_tokens, states[rows.single_slots]
        out[at] = recurrent_step(q[at], k[at], v[at], g[at], beta[at], picked)
        states[rows.single_slots] = picked
    for s, e, slot in rows.spans:
        out[s:e] = chunked_scan(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                v[s:e].transpose(0, 1), g[s:e].T, beta[s:e].T,
                                states[slot]).transpose(0, 1)
    return out
