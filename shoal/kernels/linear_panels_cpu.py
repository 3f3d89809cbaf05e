"""Dense linear layers on CPU over weights prepacked into panels (``linear_panels_cpu.c`` in
the native library; the panel multiply is ``panel_cpu.h``'s, shared with the MoE experts).

``pack(weight)`` lays ``[out, in]`` out once, at load, as ``[ceil(out / 16), in, 16]`` in the
weight's own dtype (float32 or bfloat16): each 16 output features column by column, the
last panel padded with zero rows. ``linear(x, panels, out_features, bias)`` is ``x @ W.T +
bias`` on it, summed in float32 (bfloat16 weights widened in registers, so read at half the
bytes) and rounded once to x's dtype. The loader (``linear.use_panel_linears``) keeps only
the panels, the dense weight dropped, and runs every row count on them.

Why (docs/benchmarks.md, "Dense linears on the panel kernel"): a decode step streams every
weight once, and the panels stream each weight once for every 6 rows with no horizontal
sums, bfloat16 at half the bytes. On a Zen 3 core (``bench/linear_cpu.py``, the llama bench
shapes) they ran 1.04-1.38x oneDNN's packed float32 linear and 1.04-5x ``linear_bf16_cpu``
at every row count from 1 to 2048.
"""

from __future__ import annotations

import torch

from shoal.kernels.native_cpu import load

PANEL = 16  # output features a panel (PW in panel_cpu.h)
DTYPES = (torch.float32, torch.bfloat16)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` -> ``[ceil(out / PANEL), in, PANEL]``, same dtype; the tail panel's
    missing rows zero."""
    if weight.dim() != 2 or weight.dtype not in DTYPES or weight.device.type != "cpu":
        raise ValueError(f"panel weights: a float32 or bfloat16 [out, in] CPU matrix, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    out_features, in_features = weight.shape
    n_panels = -(-out_features // PANEL)
    panels = torch.zeros(n_panels, in_features, PANEL, dtype=weight.dtype)
    full = out_features // PANEL
    if full:
        panels[:full] = weight[:full * PANEL].reshape(full, PANEL, in_features).transpose(1, 2)
    if full < n_panels:
        panels[full, :, :out_features - full * PANEL] = weight[full * PANEL:].t()
    return panels


def linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` in x's dtype (the panels' dtype); ``x [..., in]``."""
    n_panels, in_features, width = panels.shape
    if (x.dtype != panels.dtype or x.shape[-1] != in_features or width != PANEL
            or not panels.is_contiguous() or -(-out_features // PANEL) != n_panels):
        raise ValueError(f"panel linear: x {tuple(x.shape)} {x.dtype} against panels "
                         f"{tuple(panels.shape)} {panels.dtype} for {out_features} outputs")
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (out_features,)):
        raise ValueError(f"panel linear: bias {tuple(bias.shape)} {bias.dtype}, expected "
                         f"[{out_features}] {x.dtype}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, in_features)
    out = torch.empty(rows.shape[0], out_features, dtype=x.dtype)
    if rows.shape[0]:
        xf = rows.to(torch.float32).contiguous()  # a no-op for contiguous float32 rows
        bias = None if bias is None else bias.contiguous()
        load().shoal_linear_panels(xf.data_ptr(), rows.shape[0], in_features, out_features,
                                   panels.data_ptr(), int(x.dtype == torch.bfloat16),
                                   None if bias is None else bias.data_ptr(), out.data_ptr())
    return out.reshape(*lead, out_features)


def rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the dense ``[out, in]`` weight, read from its panels: an embedding
    lookup in a table tied to an LM head held only as panels (``[*ids.shape, in]``)."""
    flat = ids.reshape(-1)
    return panels[flat // PANEL, :, flat % PANEL].reshape(*ids.shape, panels.shape[1])
