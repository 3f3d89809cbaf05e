"""Triton kernels for the GPU path (imports nothing from the runtime).

``reshape_and_cache`` (new K/V into the paged cache), ``paged_attention`` (a flat mixed
batch of prefill chunks and decodes in one launch) and ``qk_norm_rotary`` (Qwen3's q/k
norm + rotary), each with a plain torch reference in ``reference.py``. On CPU they run only
under ``TRITON_INTERPRET=1`` set before import (tests); see ``launch.py``.
"""
