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
    """One request's ``L`` tokens: ``q``/``k [..., H, L, Dk]``, ``v [..., H, L, Dv]``,
    ``g``/``beta [..., H, L]`` (float32), continuing from ``state [..., H, Dk, Dv]`` (updated
    in place); leading dims batch requests padded to one length. Returns ``o [..., H, L,
    Dv]``."""
    length = q.shape[-2]
    pad = (-length) % CHUNK
    if pad:  # padded tokens have g = 0 (no decay) and beta = 0 (no write): inert
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    lead, total = q.shape[:-2], q.shape[-2]
    blocks = total // CHUNK
    q, k, v = (x.reshape(*lead, blocks, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(*lead, blocks, CHUNK), beta.reshape(*lead, blocks, CHUNK)
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
        new = values[..., b, :, :] - state_keys[..., b, :, :] @ state
        out[..., b, :, :] = q_decayed[..., b, :, :] @ state + intra[..., b, :, :] @ new
        state.mul_(block_decay[..., b, None, None]).add_(
            k_to_end[..., b, :, :].transpose(-1, -2) @ new)
    return out.reshape(*lead, total, -1)[..., :length, :]


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


def conv_rows(mixed: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
    """``silu(conv)`` over the step's rows: ``mixed [T, C]``, ``conv_states [slots, C, K-1]``
    (the rows' windows updated in place), ``weight [C, K]``."""
    if meta.max_query_len == 1:  # every row decodes: the one-token update, gathered
        assert meta.state_slots is not None
        windows = conv_states[meta.state_slots]
        out = causal_conv_step(mixed, windows, weight)
        conv_states[meta.state_slots] = windows
        return out
    # one pass for all rows: each row's window, then its tokens, side by side in one
    # sequence; a tap never reaches across into the row before
    starts, slots = meta.query_start_loc_cpu, meta.state_slots_cpu
    assert slots is not None
    rows, width = len(slots), weight.shape[1] - 1
    lengths = torch.tensor([starts[i + 1] - starts[i] for i in range(rows)])
    row_of = torch.repeat_interleave(torch.arange(rows), lengths)
    token_at = torch.arange(mixed.shape[0]) + width * (row_of + 1)
    window_at = (torch.tensor(starts[:-1]) + width * torch.arange(rows))[:, None] \
        + torch.arange(width)  # [rows, K-1]
    end_at = window_at + lengths[:, None]  # where each row's new window ends up
    slot_index = torch.tensor(slots, device=conv_states.device)
    device = mixed.device
    full = mixed.new_empty(mixed.shape[0] + rows * width, mixed.shape[1], dtype=torch.float32)
    full[token_at.to(device)] = mixed.float()
    full[window_at.flatten().to(device)] = \
        conv_states[slot_index].transpose(1, 2).reshape(-1, mixed.shape[1]).float()
    conv_states[slot_index] = full[end_at.flatten().to(device)].view(
        rows, width, -1).transpose(1, 2).to(conv_states.dtype)
    taps = weight.float().T  # [K, C]
    span = full.shape[0] - width  # the conv at every position, then the tokens' rows
    acc = full[:span] * taps[0]
    for j in range(1, width + 1):
        acc.addcmul_(full[j:j + span], taps[j])
    return F.silu(acc[(token_at - width).to(device)].to(mixed.dtype))


def scan_groups(lengths: list[int], waste: float = 1.25) -> list[list[int]]:
    """Rows of several tokens batched into one scan, each group padded to its longest row's
    blocks: longest first, a row joins while the group's padded blocks stay within
    ``waste`` times the blocks its rows need alone (rows of similar length share a scan's
    per-block matmuls; a short row never pays for a long one)."""
    blocks = [-(-n // CHUNK) for n in lengths]
    groups: list[list[int]] = []
    need = 0
    for i in sorted(range(len(lengths)), key=lambda i: -blocks[i]):
        group = groups[-1] if groups else None
        if group is not None and blocks[group[0]] * (len(group) + 1) <= waste * (need + blocks[i]):
            group.append(i)
            need += blocks[i]
        else:
            groups.append([i])
            need = blocks[i]
    return groups


def delta_rule_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, states: torch.Tensor, meta: AttentionMetadata
                    ) -> torch.Tensor:
    """The gated delta rule over the step's rows: ``q``/``k [T, Hk, Dk]`` per key head
    (normalised, q scaled), ``v [T, Hv, Dv]``, ``g``/``beta [T, Hv]`` float32, ``states
    [slots, Hv, Dk, Dv]`` (the rows' states updated in place). Returns ``o [T, Hv, Dv]``.
    One-token rows (decodes) run the one-token update together; longer rows the chunked
    scan, rows of similar length batched (``scan_groups``)."""
    group = v.shape[1] // q.shape[1]  # each key head serves ``group`` consecutive value heads
    q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    starts, slots = meta.query_start_loc_cpu, meta.state_slots_cpu
    assert slots is not None and meta.state_slots is not None
    if meta.max_query_len == 1:
        single, spans = list(range(len(slots))), []
    else:
        lengths = [starts[i + 1] - starts[i] for i in range(len(slots))]
        single = [i for i, n in enumerate(lengths) if n == 1]
        spans = [i for i, n in enumerate(lengths) if n > 1]
    out = torch.empty_like(v)
    device = v.device
    if single:
        at: torch.Tensor | slice = slice(None)
        index = meta.state_slots
        if meta.max_query_len > 1:
            at = torch.tensor([starts[i] for i in single], device=device)
            index = torch.tensor([slots[i] for i in single], device=device)
        picked = states[index]
        out[at] = recurrent_step(q[at], k[at], v[at], g[at], beta[at], picked)
        states[index] = picked
    for members in scan_groups([starts[i + 1] - starts[i] for i in spans]):
        rows = [spans[m] for m in members]
        _scan_group(q, k, v, g, beta, states, out, [(starts[i], starts[i + 1]) for i in rows],
                    [slots[i] for i in rows])
    return out


def _scan_group(q, k, v, g, beta, states, out, bounds: list[tuple[int, int]],
                slots: list[int]) -> None:
    """One chunked scan for rows ``bounds`` (token ranges), padded to the longest."""
    if len(bounds) == 1:
        (s, e), slot = bounds[0], slots[0]
        out[s:e] = chunked_scan(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                v[s:e].transpose(0, 1), g[s:e].T, beta[s:e].T,
                                states[slot]).transpose(0, 1)
        return
    longest = max(e - s for s, e in bounds)
    tokens = torch.cat([torch.arange(s, e) for s, e in bounds]).to(q.device)
    padded_at = torch.cat([torch.arange(e - s) + n * longest
                           for n, (s, e) in enumerate(bounds)]).to(q.device)

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [N, H, longest, ...]
        buf = x.new_zeros(len(bounds) * longest, *x.shape[1:])
        buf[padded_at] = x[tokens]
        return buf.view(len(bounds), longest, *x.shape[1:]).transpose(1, 2)

    index = torch.tensor(slots, device=states.device)
    picked = states[index]
    result = chunked_scan(padded(q), padded(k), padded(v), padded(g), padded(beta), picked)
    states[index] = picked
    out[tokens] = result.transpose(1, 2).reshape(-1, *out.shape[1:])[padded_at]
