"""Kernels chosen once: which implementation runs each op, decided per device and dtype.

``choose_kernels`` is the pure rule (tested without a GPU); ``Kernels`` binds the chosen
implementations, and the model's layers call them without ever asking which device or backend
they run on. The rule:

- native CPU ops (``shoal.kernels.cpu_ops``: norm with the residual add, SiLU-and-mul, neox
  rotary in place; in bfloat16 also the per-head q/k norm fused with the rotary) where the
  native ``cpu`` attention backend runs (float32 or bfloat16 on CPU, the library built); the
  ``torch`` backend keeps the whole model in plain torch, a reference;
- Triton kernels (RMSNorm, SiLU-and-mul, per-head q/k norm + rotary) on CUDA with the
  triton attention backend;
- on an AVX2 CPU (no AVX-512) where the native library runs, float32 and bfloat16 linear
  layers on the native panel kernel (``shoal.kernels.linear_panels_cpu``, the weight held
  only as its panels, a tied embedding's rows read there too: ``linear.use_panel_linears``;
  measured faster than the paths below there, docs/benchmarks.md);
- oneDNN-packed linear weights on CPU in float32, and in bfloat16 where oneDNN has bfloat16
  kernels for this CPU (AMX, AVX512-BF16, AVX-NE-CONVERT: ``linear.pack_cpu_linear_weights``);
  elsewhere bfloat16 linears on the native kernel (``shoal.kernels.linear_bf16_cpu``: the
  weight kept in bfloat16, widened as it is read) where the native library runs;
- the Gated DeltaNet layers' conv and delta rule (``shoal.kernels.gated_delta_rule``) in
  Triton where the other Triton kernels run, else in torch (``delta_rule.py``);
- the native routed-experts kernel (``shoal.kernels.moe_experts_cpu``) for float32 and
  bfloat16 MoE blocks where the native ``cpu`` backend runs;
- torch everywhere else, and for every shape a kernel does not take (an activation other
  than SiLU, partial or interleaved rotary, a 3-d norm input).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from shoal.runtime.attention.backend_choice import fused_triton_ops

if TYPE_CHECKING:
    from shoal.runtime.attention.backend import AttentionMetadata

Activation = Callable[[torch.Tensor], torch.Tensor]


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# transformers' ACT2FN names -> the same function in torch
ACTIVATION_FNS: dict[str, Activation] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": _relu2,
}


@dataclass(frozen=True)
class KernelChoice:
    norm: str  # "native_cpu" | "triton" | "torch"
    silu_and_mul: str  # "native_cpu" | "triton" | "torch"
    rotary: str  # "native_cpu" (neox, whole head, in place) | "torch"
    # "triton" | "native_cpu" (bfloat16, in place) (per-head norm + neox rotary, one kernel)
    # | "torch"
    qk_norm_rotary: str
    linear: str  # "onednn" (packed weights) | "native_bf16" (linear_bf16_cpu) | "torch"
    attention: str  # the attention backend's name
    # linear layers and the LM head on linear_panels_cpu (``linear``: any left dense)
    linear_panels: bool = False
    # "triton" (shoal/kernels/fused_moe.py) | "native_cpu" (moe_experts_cpu.py, float32 and
    # bfloat16) | "grouped" (torch._grouped_mm)
    moe: str = "grouped"
    lora: str = "masked"  # "triton" (shoal/kernels/lora_batched.py) | "masked" (torch matmuls)
    # Gated DeltaNet: "triton" (shoal/kernels/gated_delta_rule.py) | "torch" (delta_rule.py)
    linear_attention: str = "torch"


def choose_kernels(device_type: str, dtype: torch.dtype, attention: str,
                   triton_available: bool, onednn_available: bool,
                   onednn_bf16: bool = False, panels_faster: bool = False) -> KernelChoice:
    """``onednn_bf16``: oneDNN can pack bfloat16 weights on this CPU; ``panels_faster``: the
    panel kernel beats those paths on this CPU (``panel_linears_here``)."""
    native = attention == "cpu"  # that backend runs only where the native library loaded
    # the position-wise C ops take float32 and bfloat16 (other types run torch's)
    native_ops = native and dtype in (torch.float32, torch.bfloat16)
    # Triton only with the triton attention backend (backend_choice.fused_triton_ops), so
    # --attention-backend torch runs no Triton code: the way around a Triton failure
    triton = triton_available and fused_triton_ops(attention, device_type)
    fast = "native_cpu" if native_ops else "triton" if triton else "torch"
    linear = "torch"
    if device_type == "cpu" and onednn_available and (
            dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16)):
        linear = "onednn"
    elif device_type == "cpu" and dtype == torch.bfloat16 and native:
        linear = "native_bf16"
    return KernelChoice(
        norm=fast, silu_and_mul=fast,
        rotary="native_cpu" if native_ops else "torch",
        qk_norm_rotary="triton" if triton else "native_cpu"
        if native_ops and dtype == torch.bfloat16 else "torch",
        linear=linear, attention=attention,
        linear_panels=device_type == "cpu" and native_ops and panels_faster,
        moe="triton" if triton else "native_cpu"
        if native_ops and device_type == "cpu" else "grouped",
        lora="triton" if triton else "masked",
        linear_attention="triton" if triton else "torch")


def panel_linears_here() -> bool:
    """The panel linear kernel was measured faster than oneDNN (float32) and linear_bf16_cpu
    (bfloat16) on this kind of CPU: AVX2 without AVX-512 (Zen 3; docs/benchmarks.md, "Dense
    linears on the panel kernel"). Its loops are AVX2: against oneDNN's AVX-512 and AMX
    kernels it is unmeasured, and elsewhere they are portable C."""
    return torch.backends.cpu.get_cpu_capability() == "AVX2"


def onednn_packs_bf16() -> bool:
    """oneDNN has bfloat16 matmul kernels for this CPU (it refuses to pack otherwise)."""
    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def kernels_for(device: torch.device | str, dtype: torch.dtype, attention: str) -> Kernels:
    device_type = torch.device(device).type
    return Kernels(choose_kernels(device_type, dtype, attention, find_spec("triton") is not None,
                                  torch.backends.mkldnn.is_available(),
                                  device_type == "cpu" and onednn_packs_bf16(),
                                  device_type == "cpu" and panel_linears_here()))


@dataclass(frozen=True)
class LinearAttentionOps:
    """A Gated DeltaNet layer's two kernels over a step's rows (``delta_rule.conv_rows`` and
    ``delta_rule.delta_rule_rows`` say what they take)."""

    conv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
    delta_rule: Callable[..., torch.Tensor]


def _triton_linear_attention() -> LinearAttentionOps:
    from shoal.kernels import gated_delta_rule as gdr

    def conv(mixed, conv_states, weight, meta):
        return gdr.causal_conv(mixed, conv_states, weight, meta.query_start_loc,
                               meta.state_slots)

    def delta_rule(q, k, v, g, beta, states, meta):
        if meta.max_query_len == 1:  # every row decodes: one token each
            return gdr.recurrent_step(q, k, v, g, beta, states, meta.state_slots)
        return gdr.chunked_scan(q, k, v, g, beta, states, meta.query_start_loc,
                                meta.state_slots)

    return LinearAttentionOps(conv, delta_rule)


def _torch_linear_attention() -> LinearAttentionOps:
    from shoal.runtime.model import delta_rule

    return LinearAttentionOps(delta_rule.conv_rows, delta_rule.delta_rule_rows)


class Kernels:
    """The chosen implementations, bound once; what the layers call."""

    def __init__(self, choice: KernelChoice) -> None:
        self.choice = choice
        self.linear_attention = (_triton_linear_attention() if choice.linear_attention
                                 == "triton" else _torch_linear_attention())
        self.native = None
        if "native_cpu" in (choice.norm, choice.silu_and_mul, choice.rotary):
            from shoal.kernels import cpu_ops

            self.native = cpu_ops
        self._triton_norm = self._triton_silu = self.qk_norm_rotary = None
        # cpu_ops.qk_norm_rotary_: q's and k's heads normalised and rotated in place
        self.qk_norm_rotary_in_place = None
        if choice.qk_norm_rotary == "native_cpu":
            from shoal.kernels import cpu_ops

            self.qk_norm_rotary_in_place = cpu_ops.qk_norm_rotary_
        if choice.norm == "triton":
            from shoal.kernels.rms_norm import rms_norm

            self._triton_norm = rms_norm
        if choice.silu_and_mul == "triton":
            from shoal.kernels.silu_and_mul import silu_and_mul

            self._triton_silu = silu_and_mul
        if choice.qk_norm_rotary == "triton":
            from shoal.kernels.qk_norm_rotary import qk_norm_rotary

            self.qk_norm_rotary = qk_norm_rotary

    @property
    def rotates_in_place(self) -> bool:
        return self.choice.rotary == "native_cpu"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """``norm(x) * weight``; with ``residual``: ``(norm(x + residual), x + residual)``
        (the native kernel updates ``residual`` in place)."""
        if self.native is not None and self.choice.norm == "native_cpu" and x.dim() == 2:
            return (self.native.rms_norm(x, weight, eps) if residual is None
                    else (self.native.rms_norm(x, weight, eps, residual), residual))
        if residual is not None:
            residual = x + residual
            return self._norm(residual, weight, eps), residual
        return self._norm(x, weight, eps)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._triton_norm is not None:
            return self._triton_norm(x, weight, eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        # half precision: normalise in float32 like the reference implementation, then cast
        return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight

    def gated_activation(self, activation: str) -> Activation:
        """``act(gate) * up`` on ``[gate | up]`` rows."""
        if activation in ("silu", "swish"):
            if self.native is not None and self.choice.silu_and_mul == "native_cpu":
                return self.native.silu_and_mul
            if self._triton_silu is not None:
                return self._triton_silu
        act = ACTIVATION_FNS[activation]

        def gated(gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return act(gate) * up

        return gated

    def activation(self, activation: str) -> Activation:
        return ACTIVATION_FNS[activation]
