"""Multi-LoRA on the GPU: every slot's adapter over the step's rows, two launches per segment.

The step's token rows are grouped by adapter slot once per step (``group_rows_by_slot``:
fused_moe's ``align_by_expert`` with the base rows as one more group), each slot's run padded
to ``BLOCK_M`` rows, so every block of grouped rows uses one slot's A and B, read in place
from the LoRA layer's stacked ``[slots * max_rank, ...]`` tensors (runtime/model/lora.py),
and multiplies them as tiles. Shrink: ``shrunk[t, :] = x[t] @ A[slot].T``; expand:
``out[t, segment] += shrunk[t] @ B[slot]`` (B is stored transposed and already scaled).
Blocks of base rows return at once, so base rows are never read or written. A slot's unused
rank rows (an adapter of rank below ``max_rank``) are zero, so they add nothing.

Accumulates in float32; ``shrunk`` is rounded to the model dtype as the torch path rounds its
first matmul, and the sum into ``out`` is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels.fused_moe import align_by_expert
from shoal.kernels.launch import check_launchable

BLOCK_M = 16  # grouped rows per program (tl.dot's minimum); decode steps are a few rows a slot


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, out_ptr, sorted_ids_ptr, block_slot_ptr, num_tokens, K,
                        stride_x, stride_a, stride_out, MAX_RANK: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_IN_FP32: tl.constexpr):  # the interpreter mis-multiplies bfloat16
    pid = tl.program_id(0)
    slot = tl.load(block_slot_ptr + pid)
    if slot < 0:  # a block of base rows
        return
    ids = tl.load(sorted_ids_ptr + pid * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_tokens
    rows = ids.to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < MAX_RANK
    a_rows = slot.to(tl.int64) * MAX_RANK + ranks
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + (k0 + ks)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        # A[slot] is [MAX_RANK, K]; the tile is read as [BLOCK_K, BLOCK_R] (a transposed view)
        a = tl.load(a_ptr + a_rows[None, :] * stride_a + (k0 + ks)[:, None],
                    mask=k_ok[:, None] & rank_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a, input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_out + ranks[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & rank_ok[None, :])


@triton.jit
def _lora_expand_kernel(shrunk_ptr, b_ptr, out_ptr, sorted_ids_ptr, block_slot_ptr, num_tokens,
                        N, stride_s, stride_b, stride_out, MAX_RANK: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_IN_FP32: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < num_tokens
    rows = ids.to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    rank_ok = ranks < MAX_RANK
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    shrunk = tl.load(shrunk_ptr + rows[:, None] * stride_s + ranks[None, :],
                     mask=valid[:, None] & rank_ok[None, :], other=0.0)
    b = tl.load(b_ptr + (slot.to(tl.int64) * MAX_RANK + ranks)[:, None] * stride_b
                + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        shrunk, b = shrunk.to(tl.float32), b.to(tl.float32)
    delta = tl.dot(shrunk, b, input_precision="ieee")
    mask = valid[:, None] & col_ok[None, :]
    where = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tile = tl.load(where, mask=mask, other=0.0).to(tl.float32)
    tl.store(where, (tile + delta).to(out_ptr.dtype.element_ty), mask=mask)


def group_rows_by_slot(token_slots: torch.Tensor, num_slots: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_slots [T]`` (-1: base) -> (``sorted_ids``: row indices grouped by slot, each
    group padded with the sentinel ``T`` to a multiple of ``BLOCK_M``; ``block_slot``: each
    block's slot, -1 for the blocks of base rows). Once per step, shared by every layer."""
    groups = torch.where(token_slots < 0, num_slots, token_slots)
    sorted_ids, block_group = align_by_expert(groups[:, None], num_slots + 1, BLOCK_M)
    return sorted_ids, torch.where(block_group == num_slots, -1, block_group)


def launch_tiles(max_rank: int, dtype: torch.dtype, device_type: str) -> dict:
    """The launcher's choice for a ``max_rank``: the whole rank in one tile (padded to tl.dot's
    16), reduction/column tiles narrower for wide ranks to stay within shared memory.
    Under the interpreter, bfloat16 tiles are multiplied in float32."""
    block_r = max(16, triton.next_power_of_2(max_rank))
    return dict(BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=64 if block_r <= 64 else 32,
                BLOCK_N=64 if block_r <= 64 else 32,
                DOT_IN_FP32=device_type == "cpu" and dtype == torch.bfloat16)


def lora_shrink_expand(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                       max_rank: int, sorted_ids: torch.Tensor, block_slot: torch.Tensor
                       ) -> None:
    """``out [T, N]`` (a column slice of the projection's output may be passed) ``+=`` each
    adapter row's ``(x [T, K] @ A[slot].T) @ B[slot]``; ``a [slots * max_rank, K]``, ``b
    [slots * max_rank, N]``; rows of base blocks untouched. ``sorted_ids``/``block_slot``
    from ``group_rows_by_slot``."""
    tokens, k = x.shape
    n = out.shape[1]
    if tokens == 0 or block_slot.numel() == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    if out.stride(-1) != 1 or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("out, a and b must have unit stride along their last dimension")
    check_launchable(x, a, b, out, sorted_ids, block_slot)
    tiles = launch_tiles(max_rank, x.dtype, x.device.type)
    shared = dict(MAX_RANK=max_rank, BLOCK_M=tiles["BLOCK_M"], BLOCK_R=tiles["BLOCK_R"],
                  DOT_IN_FP32=tiles["DOT_IN_FP32"])
    shrunk = torch.empty(tokens, max_rank, dtype=x.dtype, device=x.device)
    blocks = block_slot.numel()
    _lora_shrink_kernel[(blocks,)](
        x, a, shrunk, sorted_ids, block_slot, tokens, k, x.stride(0), a.stride(0),
        shrunk.stride(0), BLOCK_K=tiles["BLOCK_K"], **shared)
    _lora_expand_kernel[(blocks, triton.cdiv(n, tiles["BLOCK_N"]))](
        shrunk, b, out, sorted_ids, block_slot, tokens, n, shrunk.stride(0), b.stride(0),
        out.stride(0), BLOCK_N=tiles["BLOCK_N"], **shared)


GPU_MAX_RANKS = (8, 16, 32, 64, 128, 256)  # the usual --max-lora-rank values


def gpu_variants() -> list:
    """Both kernels for every ``--max-lora-rank`` tile, in every model dtype."""
    from shoal.kernels.gpu_check import variants as v

    out = []
    for max_rank in GPU_MAX_RANKS:
        for dtype in v.KV_DTYPES:
            tiles = launch_tiles(max_rank, dtype, "cuda")
            ty = v.triton_type(dtype)
            ids = dict(sorted_ids_ptr="i64", block_slot_ptr="i64")
            for kernel, pointers, tile in (
                    (_lora_shrink_kernel, dict(x_ptr=ty, a_ptr=ty, out_ptr=ty), "BLOCK_K"),
                    (_lora_expand_kernel, dict(shrunk_ptr=ty, b_ptr=ty, out_ptr=ty),
                     "BLOCK_N")):
                constexprs = dict(MAX_RANK=max_rank, BLOCK_M=tiles["BLOCK_M"],
                                  BLOCK_R=tiles["BLOCK_R"], DOT_IN_FP32=tiles["DOT_IN_FP32"],
                                  **{tile: tiles[tile]})
                sig = v.signature(kernel, constexprs, {**pointers, **ids})
                name = kernel.fn.__name__.strip("_").removesuffix("_kernel")
                out.append(v.KernelVariant(f"{name} {ty} rank{max_rank}", kernel, sig,
                                           constexprs, tags=dict(dtype=ty)))
    return v.unique(out)
