"""A Gated DeltaNet layer's token mixing on the GPU: causal conv, recurrent step, chunked scan.

The same functions as ``runtime/model/delta_rule.py`` (the torch reference, which says what
they compute), over a whole step's rows in one launch each: rows are ``starts [R+1]`` (token
offsets) and ``slots [R]`` (each row's state slot), so no per-request Python loop and no
gather/scatter of states: the kernels read and write the slots in place.

- ``causal_conv``: one program per (row, channel block) walks its row's tokens a time block
  at a time; taps before the row's first token come from the slot's window, and the window
  is left holding the row's last ``K - 1`` inputs.
- ``recurrent_step``: one token per row (decode); one program per (row, value head, value
  block) holds that part of the float32 state in registers.
- ``chunked_scan``: any rows; one program per (row, value head, value block) carries the
  state across the row's chunks of ``CHUNK`` tokens in the WY/UT form: per chunk the
  unit-lower-triangular system of the chunk's writes is inverted by forward substitution,
  and the rest is matmuls (the state crosses chunks exactly as it would token by token).

q and k come per key head ([T, Hk, Dk], L2-normalised, q scaled); value head ``h`` reads key
head ``h // group`` (as ``repeat_interleave`` lays them out). Scan inputs are float32 and
its dots run as three tf32 products (``tf32x3``, float32's accuracy on tensor cores): the
state accumulates over the whole sequence, so plain tf32 is too coarse, and full-float32
(``ieee``) dots spill kilobytes of registers on Hopper at these tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.launch import check_launchable

# tokens per scan chunk (dots need >= 16): at 32 the chunk's tiles spill on Hopper
CHUNK = 16
CONV_BLOCK_T = 8


@triton.jit
def _causal_conv_kernel(x_ptr, out_ptr, weight_ptr, window_ptr, starts_ptr, slots_ptr,
                        stride_x, stride_out, stride_win, C,
                        K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    start = tl.load(starts_ptr + row).to(tl.int64)
    length = (tl.load(starts_ptr + row + 1) - start).to(tl.int32)
    window = window_ptr + tl.load(slots_ptr + row).to(tl.int64) * stride_win + cols * (K - 1)
    for t0 in range(0, length, BLOCK_T):
        times = t0 + tl.arange(0, BLOCK_T)
        live = (times < length)[:, None] & cmask[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(K):
            p = times - (K - 1) + j  # the tap's input, relative to the row's first token
            pc = p[:, None]
            from_x = tl.load(x_ptr + (start + pc) * stride_x + cols[None, :],
                             mask=live & (pc >= 0), other=0.0)
            from_window = tl.load(window[None, :] + (K - 1 + pc), mask=live & (pc < 0),
                                  other=0.0)
            w = tl.load(weight_ptr + cols * K + j, mask=cmask, other=0.0).to(tl.float32)
            acc += (from_x.to(tl.float32) + from_window.to(tl.float32)) * w[None, :]
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + (start + times[:, None]) * stride_out + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live)
    tl.debug_barrier()  # every warp has read the old window before it is overwritten
    for j in tl.static_range(K - 1):
        # the window's slot j takes the input at length - (K - 1) + j; an old slot it
        # still needs (index length + j) is above every slot written so far
        p = length - (K - 1) + j + tl.zeros_like(cols)
        new = tl.load(x_ptr + (start + p) * stride_x + cols, mask=cmask & (p >= 0), other=0.0)
        old = tl.load(window + (K - 1 + p), mask=cmask & (p < 0), other=0.0)
        tl.store(window + j, tl.where(p >= 0, new.to(old.dtype), old), mask=cmask)


@triton.jit
def _recurrent_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr,
                           out_ptr, stride_qk, stride_v, stride_g, stride_state, group,
                           DK: tl.constexpr, DV: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = dk < DK, dv < DV
    qk_at = row * stride_qk + (head // group) * DK + dk
    q = tl.load(q_ptr + qk_at, mask=kmask, other=0.0)
    k = tl.load(k_ptr + qk_at, mask=kmask, other=0.0)
    v = tl.load(v_ptr + row * stride_v + head * DV + dv, mask=vmask, other=0.0)
    g = tl.load(g_ptr + row * stride_g + head)
    beta = tl.load(beta_ptr + row * stride_g + head)
    state_at = (state_ptr + tl.load(slots_ptr + row) * stride_state + head * DK * DV
                + dk[:, None] * DV + dv[None, :])
    smask = kmask[:, None] & vmask[None, :]
    state = tl.load(state_at, mask=smask, other=0.0) * tl.exp(g)
    predicted = tl.sum(state * k[:, None], 0)
    state += k[:, None] * ((v - predicted) * beta)[None, :]
    tl.store(state_at, state, mask=smask)
    out = tl.sum(state * q[:, None], 0)
    tl.store(out_ptr + row * stride_v + head * DV + dv, out, mask=vmask)


@triton.jit
def _chunked_scan_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, starts_ptr,
                         slots_ptr, out_ptr, stride_qk, stride_v, stride_g, stride_state,
                         group, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_V: tl.constexpr, CHUNK_T: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    kmask, vmask = dk < DK, dv < DV
    start = tl.load(starts_ptr + row).to(tl.int64)
    length = (tl.load(starts_ptr + row + 1) - start).to(tl.int32)
    state_at = (state_ptr + tl.load(slots_ptr + row) * stride_state + head * DK * DV
                + dk[:, None] * DV + dv[None, :])
    smask = kmask[:, None] & vmask[None, :]
    state = tl.load(state_at, mask=smask, other=0.0)
    i = tl.arange(0, CHUNK_T)[:, None]
    j = tl.arange(0, CHUNK_T)[None, :]
    identity = tl.where(i == j, 1.0, 0.0)
    for t0 in range(0, length, CHUNK_T):
        times = start + t0 + tl.arange(0, CHUNK_T)
        tmask = (t0 + tl.arange(0, CHUNK_T)) < length
        # padded tokens load as k = v = 0, g = 0 (no decay), beta = 0 (no write): inert
        qk_at = times[:, None] * stride_qk + (head // group) * DK + dk[None, :]
        qk_mask = tmask[:, None] & kmask[None, :]
        q = tl.load(q_ptr + qk_at, mask=qk_mask, other=0.0)
        k = tl.load(k_ptr + qk_at, mask=qk_mask, other=0.0)
        v_at = times[:, None] * stride_v + head * DV + dv[None, :]
        v_mask = tmask[:, None] & vmask[None, :]
        v = tl.load(v_ptr + v_at, mask=v_mask, other=0.0)
        g = tl.load(g_ptr + times * stride_g + head, mask=tmask, other=0.0)
        beta = tl.load(beta_ptr + times * stride_g + head, mask=tmask, other=0.0)
        cum = tl.cumsum(g, 0)  # log decay from the chunk's start through each token
        total = tl.sum(g, 0)
        causal = i >= j
        decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)),
                         0.0)
        k_beta = k * beta[:, None]
        system = tl.dot(k_beta, tl.trans(k), input_precision="tf32x3")
        system = tl.where(i > j, system * decay, 0.0)
        # inverse of (I + system) by forward substitution, row by row: T_r = e_r - a_r T
        inverse = identity
        for r in range(1, CHUNK_T):
            a_r = tl.sum(tl.where(i == r, system, 0.0), 0)  # row r of the system, over j
            t_r = tl.sum(a_r[:, None] * inverse, 0)
            inverse = tl.where(i == r, inverse - t_r[None, :], inverse)
        values = tl.dot(inverse, v * beta[:, None], input_precision="tf32x3")
        state_keys = tl.dot(inverse, k_beta * tl.exp(cum)[:, None], input_precision="tf32x3")
        # the writes' new information, net of what the chunk-start state already predicts
        new = values - tl.dot(state_keys, state, input_precision="tf32x3")
        intra = tl.dot(q, tl.trans(k), input_precision="tf32x3") * decay
        out = (tl.dot(q * tl.exp(cum)[:, None], state, input_precision="tf32x3")
               + tl.dot(intra, new, input_precision="tf32x3"))
        tl.store(out_ptr + v_at, out, mask=v_mask)
        k_to_end = k * tl.exp(total - cum)[:, None]
        state = (state * tl.exp(total)
                 + tl.dot(tl.trans(k_to_end), new, input_precision="tf32x3"))
    tl.store(state_at, state, mask=smask)


def conv_config(channels: int) -> dict:
    """The launcher's choice: channels per program (the time block is fixed)."""
    return dict(BLOCK_C=min(128, triton.next_power_of_2(channels)), BLOCK_T=CONV_BLOCK_T)


def scan_config(head_k_dim: int, head_v_dim: int, recurrent: bool) -> dict:
    """The launcher's choice for one value head's state ``[Dk, Dv]``: the whole key dim per
    program, the value dim split in blocks (a 128 x 32 float32 tile stays in registers)."""
    block_k = max(16, triton.next_power_of_2(head_k_dim))
    block_v = max(16, min(32, triton.next_power_of_2(head_v_dim)))
    config = dict(DK=head_k_dim, DV=head_v_dim, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=4)
    if not recurrent:  # the chunk's [CHUNK, Dk] q, k and its system beside the state
        config.update(CHUNK_T=CHUNK, num_warps=8)
    return config


def causal_conv(x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor,
                starts: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``silu(conv)`` over every row of ``x [T, C]`` (row r: tokens ``starts[r]:starts[r+1]``,
    its window ``windows[slots[r]]`` of ``[slots, C, K-1]``, updated in place); ``weight
    [C, K]``. Returns ``[T, C]`` in x's dtype."""
    channels, width = weight.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if windows.shape[1:] != (channels, width - 1) or not windows.is_contiguous():
        raise ValueError(f"windows must be contiguous [slots, {channels}, {width - 1}]")
    out = torch.empty_like(x)
    rows = slots.shape[0]
    if rows and x.shape[0]:
        check_launchable(x, windows, weight, starts, slots)
        config = conv_config(channels)
        grid = (rows, triton.cdiv(channels, config["BLOCK_C"]))
        _causal_conv_kernel[grid](x, out, weight.contiguous(), windows, starts, slots,
                                  x.stride(0), out.stride(0), windows.stride(0), channels,
                                  K=width, **config)
    return out


def _check_scan(q, k, v, g, beta, states):
    tokens, k_heads, head_k_dim = q.shape
    v_heads, head_v_dim = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != tokens or g.shape != (tokens, v_heads) \
            or beta.shape != g.shape or v_heads % k_heads:
        raise ValueError(f"q/k [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv] expected, got "
                         f"{tuple(q.shape)} {tuple(k.shape)} {tuple(v.shape)} {tuple(g.shape)}")
    if states.shape[1:] != (v_heads, head_k_dim, head_v_dim) or not states.is_contiguous() \
            or states.dtype != torch.float32:
        raise ValueError(f"states must be contiguous float32 [slots, {v_heads}, {head_k_dim}, "
                         f"{head_v_dim}], got {tuple(states.shape)} {states.dtype}")
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    return q, k, v, g, beta, v_heads // k_heads


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, states: torch.Tensor, slots: torch.Tensor
                   ) -> torch.Tensor:
    """One token per row (row r: token r, state ``states[slots[r]]``, updated in place).
    Returns ``o [T, Hv, Dv]`` float32."""
    q, k, v, g, beta, group = _check_scan(q, k, v, g, beta, states)
    out = torch.empty_like(v)
    if slots.shape[0] != q.shape[0]:
        raise ValueError(f"one slot per token expected: {slots.shape[0]} for {q.shape[0]}")
    if q.shape[0]:
        check_launchable(q, k, v, g, beta, states, slots)
        config = scan_config(q.shape[2], v.shape[2], recurrent=True)
        grid = (q.shape[0], v.shape[1], triton.cdiv(v.shape[2], config["BLOCK_V"]))
        _recurrent_step_kernel[grid](q, k, v, g, beta, states, slots, out, q.stride(0),
                                     v.stride(0), g.stride(0), states.stride(0), group,
                                     **config)
    return out


def chunked_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, states: torch.Tensor, starts: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """Every row's tokens (row r: ``starts[r]:starts[r+1]``, from ``states[slots[r]]``,
    updated in place). Returns ``o [T, Hv, Dv]`` float32."""
    q, k, v, g, beta, group = _check_scan(q, k, v, g, beta, states)
    out = torch.empty_like(v)
    if slots.shape[0] and q.shape[0]:
        check_launchable(q, k, v, g, beta, states, starts, slots)
        config = scan_config(q.shape[2], v.shape[2], recurrent=False)
        grid = (slots.shape[0], v.shape[1], triton.cdiv(v.shape[2], config["BLOCK_V"]))
        _chunked_scan_kernel[grid](q, k, v, g, beta, states, starts, slots, out, q.stride(0),
                                   v.stride(0), g.stride(0), states.stride(0), group,
                                   **config)
    return out


def gpu_variants() -> list:
    """The conv per model dtype and per rank's channel count, the step and the scan per head
    dims (their inputs are float32 whatever the model dtype), over the hybrid models'
    shapes and tensor parallel sizes."""
    from shoal.kernels.gpu_check import variants as v

    out = []
    for model, tp in v.sharded_linear_attn_shapes():
        channels = (2 * model.num_k_heads * model.head_k_dim
                    + model.num_v_heads * model.head_v_dim) // tp
        tags = dict(model=model.name, tp=tp)
        for dtype in v.KV_DTYPES:
            ty = v.triton_type(dtype)
            constexprs = dict(conv_config(channels), K=model.conv_kernel)
            sig = v.signature(_causal_conv_kernel, constexprs,
                              dict(x_ptr=ty, out_ptr=ty, weight_ptr=ty, window_ptr=ty,
                                   starts_ptr="i32", slots_ptr="i64"))
            out.append(v.KernelVariant(
                f"causal_conv {ty} k{model.conv_kernel} block{constexprs['BLOCK_C']}",
                _causal_conv_kernel, sig, constexprs, tags=dict(tags, dtype=ty)))
        for kernel, recurrent in ((_recurrent_step_kernel, True), (_chunked_scan_kernel, False)):
            constexprs = scan_config(model.head_k_dim, model.head_v_dim, recurrent)
            num_warps = constexprs.pop("num_warps")
            pointers = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr",
                                      "state_ptr", "out_ptr"), "fp32")
            pointers.update(slots_ptr="i64", starts_ptr="i32")
            if recurrent:
                del pointers["starts_ptr"]
            sig = v.signature(kernel, constexprs, pointers)
            name = "recurrent_step" if recurrent else f"chunked_scan chunk{CHUNK}"
            out.append(v.KernelVariant(
                f"{name} fp32 dk{model.head_k_dim} dv{model.head_v_dim}", kernel, sig,
                constexprs, num_warps=num_warps, tags=dict(tags, dtype="fp32")))
    return v.unique(out)
