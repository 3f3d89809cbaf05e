"""--attention-backend resolution: auto is triton on CUDA (flashinfer only when asked for, until
it has been measured on a device); torch on CPU."""

from __future__ import annotations

import pytest
from shoal.runtime.attention.backend_choice import choose_attention_backend


@pytest.mark.parametrize(
    "device,flashinfer,triton,expected",
    [
        ("cuda", True, True, "triton"),
        ("cuda", False, True, "triton"),
        ("cuda", False, False, "torch"),
        ("cpu", True, True, "torch"),
        ("cpu", False, True, "torch"),
    ],
)
def test_auto_picks_the_fastest_backend_that_can_run(device, flashinfer, triton, expected):
    assert choose_attention_backend("auto", device, flashinfer, triton) == expected


def test_auto_never_picks_triton_on_cpu_even_under_the_interpreter():
    assert choose_attention_backend("auto", "cpu", False, True, triton_interpreted=True) == "torch"


def test_explicit_choices_are_honoured_where_they_can_run():
    assert choose_attention_backend("torch", "cuda", True, True) == "torch"
    assert choose_attention_backend("triton", "cuda", True, True) == "triton"
    assert choose_attention_backend("triton", "cpu", False, True, triton_interpreted=True) == "triton"
    assert choose_attention_backend("flashinfer", "cuda", True, False) == "flashinfer"


@pytest.mark.parametrize(
    "requested,device,flashinfer,triton,reason",
    [
        ("flashinfer", "cpu", True, True, "needs a CUDA device"),
        ("flashinfer", "cuda", False, True, "not installed"),
        ("triton", "cpu", False, True, "TRITON_INTERPRET"),
        ("triton", "cuda", False, False, "not installed"),
        ("cutlass", "cuda", True, True, "unknown attention backend"),
    ],
)
def test_impossible_choices_are_refused_with_the_reason(requested, device, flashinfer, triton, reason):
    with pytest.raises(ValueError, match=reason):
        choose_attention_backend(requested, device, flashinfer, triton)


def test_selector_builds_the_chosen_backend_and_refuses_flashinfer_on_cpu():
    import torch
    from shoal.runtime.attention.selector import get_attention_backend

    # float16 is not a dtype the native CPU kernels take (float32, bfloat16): torch serves it.
    assert get_attention_backend("auto", torch.device("cpu"), torch.float16).name == "torch"
    assert get_attention_backend("triton", torch.device("cpu")).name == "triton"  # interpreter on
    with pytest.raises(ValueError, match="CUDA"):
        get_attention_backend("flashinfer", torch.device("cpu"))


@pytest.mark.parametrize("backend,device,fused", [
    ("triton", "cuda", True),
    ("torch", "cuda", False),  # --attention-backend torch: no Triton code runs
    ("flashinfer", "cuda", False),
    ("triton", "cpu", False),  # the interpreter runs attention only
    ("cpu", "cpu", False),
])
def test_fused_triton_ops_follow_the_attention_backend(backend, device, fused):
    from shoal.runtime.attention.backend_choice import fused_triton_ops

    assert fused_triton_ops(backend, device) is fused
