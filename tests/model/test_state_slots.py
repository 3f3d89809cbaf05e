"""The linear-attention state cache's slot bookkeeping: a request keeps its slot while it
runs, release frees it for the next, a row starting at position 0 starts from zeros while a
continuing row keeps its state, and more running requests than slots is an error (the
running batch's max_num_seqs is the bound the engine keeps)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from shoal.runtime.model.linear_attn_config import LinearAttnConfig
from shoal.runtime.worker.state_slots import StateCache

LIN = LinearAttnConfig(num_k_heads=1, num_v_heads=2, head_k_dim=4, head_v_dim=3,
                       conv_kernel=4, linear_layers=(True, False, True))


def test_slots_are_kept_released_reused_and_zeroed_at_position_0():
    cache = StateCache(LIN, 2, torch.float32, torch.device("cpu"))
    assert sorted(cache.layers) == [0, 2]  # the attention layer has no state
    assert cache.layers[0][0].shape == (2, 2 * 4 + 2 * 3, 3)
    assert cache.layers[0][1].shape == (2, 2, 4, 3)
    a, b = cache.assign(["a", "b"], np.array([0, 0]))
    assert a != b and cache.num_held == 2
    for conv, recurrent in cache.layers.values():
        conv.fill_(1.0)
        recurrent.fill_(1.0)
    assert cache.assign(["a", "b"], np.array([5, 9])) == [a, b]  # kept, state untouched
    assert all(bool((t == 1).all()) for pair in cache.layers.values() for t in pair)
    with pytest.raises(RuntimeError, match="no free linear-attention state slot"):
        cache.assign(["a", "b", "c"], np.array([6, 10, 0]))
    cache.release(["a"])
    (c,) = cache.assign(["c"], np.array([0]))
    assert c == a  # a's slot, zeroed for c; b's still holds its state
    for conv, recurrent in cache.layers.values():
        assert bool((conv[c] == 0).all()) and bool((recurrent[c] == 0).all())
        assert bool((conv[b] == 1).all()) and bool((recurrent[b] == 1).all())
    assert cache.bytes_per_request == 2 * ((2 * 4 + 2 * 3) * 3 * 4 + 2 * 4 * 3 * 4)
