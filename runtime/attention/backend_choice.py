"""Which attention backend runs: a pure rule, so it is tested without a GPU.

``auto``: triton on CUDA (flashinfer only when asked for: it has never been measured on a
device here, runs decode without CUDA graphs and syncs the host each step); on CPU the native
decode kernel (``cpu``) when it builds here and the model is float32 or bfloat16, else torch.
An explicit choice is honoured where it can run at all, and refused with a reason where it
cannot: flashinfer needs CUDA (importing it on CPU-only machines has crashed); triton needs
CUDA or the interpreter (``TRITON_INTERPRET=1``, tests).

Models (and ``--kv-cache-dtype fp8``) need features of attention (``BACKEND_FEATURES``): a backend ``auto`` would pick that
lacks one is passed over for the next that has it, with a log line saying so; an explicit
choice that lacks one is refused, naming the feature.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from shoal.runtime.attention.kv_cache_dtype import FP8_KV_FEATURE

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "cpu", "triton", "flashinfer")
# what each backend's kernels implement beyond causal attention over paged KV
# (latent_attention: DeepSeek's MLA over the latent cache, attention/mla_torch.py)
BACKEND_FEATURES: dict[str, frozenset[str]] = {
    "torch": frozenset({"sliding_window", "softcap", "sinks", "latent_attention",
                        FP8_KV_FEATURE}),
    "cpu": frozenset({"sliding_window", "softcap", "sinks", FP8_KV_FEATURE}),
    "triton": frozenset({"sliding_window", "softcap", "sinks"}),
    "flashinfer": frozenset({"sliding_window", "softcap"}),
}


def choose_attention_backend(
    requested: str,
    device_type: str,
    flashinfer_available: bool,
    triton_available: bool,
    triton_interpreted: bool = False,
    cpu_kernel: str | None = "not checked",
    dtype_native: bool = True,
    needs: frozenset[str] = frozenset(),
) -> str:
    """Resolve ``--attention-backend`` to a concrete backend name, or raise ValueError.

    ``cpu_kernel``: None when the native CPU decode kernel loads here, else why it does not.
    ``dtype_native``: the model's dtype is one the native CPU kernels take (float32, bfloat16).
    ``needs``: the model's attention features (``BACKEND_FEATURES``' keys)."""
    if requested not in BACKEND_NAMES:
        raise ValueError(
            f"unknown attention backend {requested!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    on_cuda = device_type == "cuda"
    if requested == "auto":
        candidates = []  # flashinfer never: see the module's doc
        if on_cuda and triton_available:
            candidates.append("triton")
        if device_type == "cpu" and cpu_kernel is None and dtype_native:
            candidates.append("cpu")
        candidates.append("torch")
        for name in candidates:
            missing = sorted(needs - BACKEND_FEATURES[name])
            if not missing:
                return name
            logger.warning("attention backend %s passed over: the model needs %s, which its "
                        "kernels do not implement", name, ", ".join(missing))
        raise ValueError(f"no attention backend implements {', '.join(sorted(needs))}")
    if requested == "cpu":
        if device_type != "cpu":
            raise ValueError(f"the cpu attention backend runs on CPU, not {device_type}")
        if cpu_kernel is not None:
            raise ValueError(f"the cpu attention backend is unavailable: {cpu_kernel}")
        if not dtype_native:
            raise ValueError("the cpu attention backend runs float32 and bfloat16 models "
                             "only; use --attention-backend torch")
    if requested == "flashinfer":
        if not on_cuda:
            raise ValueError(f"the flashinfer attention backend needs a CUDA device, not {device_type}")
        if not flashinfer_available:
            raise ValueError("the flashinfer attention backend was requested but flashinfer is not installed")
    if requested == "triton":
        if not triton_available:
            raise ValueError("the triton attention backend was requested but triton is not installed")
        if not on_cuda and not triton_interpreted:
            raise ValueError(
                f"the triton attention backend needs a CUDA device, not {device_type} "
                "(or TRITON_INTERPRET=1 for tests)"
            )
    missing = sorted(needs - BACKEND_FEATURES[requested])
    if missing:
        able = [n for n, f in BACKEND_FEATURES.items() if needs <= f]
        raise ValueError(f"the {requested} attention backend does not implement "
                         f"{', '.join(missing)}, which this model needs; backends that do: "
                         f"{', '.join(able)}")
    return requested


def module_available(name: str) -> bool:
    """Installed, without importing it (importing flashinfer without CUDA has crashed)."""
    return importlib.util.find_spec(name) is not None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cpu_kernel_status() -> str | None:
    """None when the native CPU kernels' library builds and loads here, else why not."""
    from shoal.kernels.native_cpu import unavailable_reason

    return unavailable_reason()


def choose_for_device(requested: str, device_type: str, dtype_native: bool = True,
                      needs: frozenset[str] = frozenset()) -> str:
    """The rule applied to this machine (the CPU kernel is built only when it could run)."""
    wants_cpu_kernel = device_type == "cpu" and requested in ("auto", "cpu")
    return choose_attention_backend(
        requested,
        device_type,
        flashinfer_available=device_type == "cuda" and module_available("flashinfer"),
        triton_available=module_available("triton"),
        triton_interpreted=triton_interpreted(),
        cpu_kernel=cpu_kernel_status() if wants_cpu_kernel else "not on CPU",
        dtype_native=dtype_native,
        needs=needs,
    )


def fused_triton_ops(backend: str, device_type: str) -> bool:
    """Whether the model's position-wise ops (RMSNorm, SiLU-and-mul, qk-norm + rotary) run as
    Triton kernels: with the triton attention backend on CUDA, so that ``--attention-backend
    torch`` (or flashinfer) runs no Triton code at all and a Triton failure has a way around."""
    return backend == "triton" and device_type == "cuda"
